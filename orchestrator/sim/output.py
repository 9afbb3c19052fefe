"""Deterministic output tokens: each one a pure function of everything before it (media identities, seed,
prompt tokens, the tokens generated so far), as greedy decoding of a real model is.

So the same request yields the same tokens on an aggregated worker and on a prefill + decode pair, and a
request continued elsewhere with its prompt plus the tokens already sent (migration) goes on with
exactly the tokens the first worker would have produced. Tokens are drawn from the tokenizer's
word-like pieces so that the detokenized text is readable.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from orchestrator.synthetic import word_pieces

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def request_key(prompt_ids: list[int] | tuple[int, ...], media_ids: list[str], seed: int | None,
                adapter: str = "") -> int:
    """The output state after the prompt: seed, media and LoRA adapter first (each adapter writes its own text),
    then every prompt token, in order."""
    digest = hashlib.blake2b(digest_size=8)
    for media_id in media_ids:
        digest.update(b"\x00" + media_id.encode())
    digest.update(b"\x01" + str(seed if seed is not None else 0).encode())
    if adapter:
        digest.update(b"\x02" + adapter.encode())
    state = int.from_bytes(digest.digest(), "little")
    for token in prompt_ids:
        state = advance(state, token)
    return state


def advance(state: int, token: int) -> int:
    """The output state after one more token (of the prompt or of the output: they are one sequence)."""
    return _splitmix64(state ^ ((token + 1) * 0x9E3779B97F4A7C15 & _MASK))


def prompt_digest(prompt_ids: list[int] | tuple[int, ...]) -> str:
    return hashlib.blake2b(struct.pack(f"<{len(prompt_ids)}I", *prompt_ids), digest_size=12).hexdigest()


def media_digest(media_ids: list[str]) -> str:
    return hashlib.blake2b("\x00".join(media_ids).encode(), digest_size=12).hexdigest()


class Vocabulary:
    """The ids the simulator may emit, and the model's EOS id."""

    def __init__(self, word_ids: list[int], eos_id: int):
        if not word_ids:
            raise ValueError("vocabulary has no word-like tokens to emit")
        self.word_ids = word_ids
        self.eos_id = eos_id

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> Vocabulary:
        tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
        vocab: dict[str, int] = tokenizer["model"]["vocab"]
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        special = {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}
        eos_id = special.get(config.get("eos_token") or "", None)
        if eos_id is None:
            raise ValueError(f"{model_dir}/tokenizer_config.json: eos_token not among the added tokens")
        return cls(sorted(i for word, i in word_pieces(vocab).items() if len(word) > 1), eos_id)

    def next_token(self, state: int) -> int:
        return self.word_ids[_splitmix64(state ^ 0xD1B54A32D192ED03) % len(self.word_ids)]

    def ends(self, state: int, probability: float) -> bool:
        """Whether the next sampled token is EOS (only when an EOS probability is set)."""
        if probability <= 0.0:
            return False
        return (_splitmix64(state + 0x5EED) % 1_000_000) < probability * 1_000_000
