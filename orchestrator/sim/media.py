"""Resolve image MediaItems like the engine would: fetch URLs, decode data URIs, check the bytes.

Each image's identity (the engine's media hash) is its caller uuid when given, else a digest of
its bytes; identities feed the deterministic output and the KV-session check.
"""

from __future__ import annotations

import base64
import binascii
import hashlib

import attrs
import httpx

from orchestrator.openengine.v1 import generation_pb2

MAGIC = {
    b"\x89PNG\r\n\x1a\n": "image/png",
    b"\xff\xd8\xff": "image/jpeg",
    b"GIF87a": "image/gif",
    b"GIF89a": "image/gif",
}


class MediaError(Exception):
    """An image the engine cannot use; becomes INVALID_ARGUMENT."""


def sniff_image(data: bytes) -> str | None:
    for magic, mime in MAGIC.items():
        if data.startswith(magic):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


@attrs.frozen
class MediaLimits:
    max_bytes: int = 20 * 1024 * 1024
    fetch_timeout_s: float = 10.0


async def _fetch(url: str, limits: MediaLimits, client: httpx.AsyncClient) -> bytes:
    try:
        async with client.stream("GET", url, timeout=limits.fetch_timeout_s) as response:
            if response.status_code != 200:
                raise MediaError(f"fetching {url}: HTTP {response.status_code}")
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limits.max_bytes:
                    raise MediaError(f"fetching {url}: more than {limits.max_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as exc:
        raise MediaError(f"fetching {url}: {exc!r}") from exc


def decode_data_uri(uri: str) -> bytes:
    header, sep, payload = uri.partition(",")
    if not sep or not header.startswith("data:") or not header.endswith(";base64"):
        raise MediaError("data URI must be data:<mime>;base64,<payload>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"data URI payload is not valid base64: {exc}") from exc


async def resolve(item: generation_pb2.MediaItem, limits: MediaLimits, client: httpx.AsyncClient) -> str:
    """Return the identity of one image, after checking that its bytes are an image."""
    if item.modality != generation_pb2.MODALITY_IMAGE:
        raise MediaError(f"modality {generation_pb2.Modality.Name(item.modality)} is not supported")
    source = item.WhichOneof("source")
    if source == "url":
        if not item.url.startswith(("http://", "https://")):
            raise MediaError(f"url scheme not supported: {item.url[:32]!r}")
        data = await _fetch(item.url, limits, client)
    elif source == "data_uri":
        data = decode_data_uri(item.data_uri)
    elif source == "raw_bytes":
        data = item.raw_bytes
    else:
        raise MediaError("media item has no source (url, data_uri or raw_bytes)")
    if len(data) > limits.max_bytes:
        raise MediaError(f"image of {len(data)} bytes is over the {limits.max_bytes}-byte limit")
    if sniff_image(data) is None:
        raise MediaError(f"{source} does not hold a PNG, JPEG, GIF or WebP image")
    return item.uuid or "sha256:" + hashlib.sha256(data).hexdigest()
