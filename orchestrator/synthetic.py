"""Synthetic inputs shared by the simulated worker and the load generator, so both follow one rule:
the readable word pieces of a tokenizer's vocabulary, and a valid one-colour PNG."""

from __future__ import annotations

import struct
import zlib


def solid_png(width: int = 8, height: int = 8, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    """A valid PNG of one color, made with zlib (for tests, demos and benchmark workloads)."""
    raw = b"".join(b"\x00" + bytes(color) * width for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def word_pieces(vocab: dict[str, int]) -> dict[str, int]:
    """Word -> id for the pieces that are a space plus ASCII letters.

    Byte-level BPE marks a leading space with "Ġ"; those pieces give readable text.
    """
    return {piece[1:]: i for piece, i in vocab.items()
            if piece.startswith("Ġ") and piece[1:].isascii() and piece[1:].isalpha()}
