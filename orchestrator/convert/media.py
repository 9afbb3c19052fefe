"""Image media rules: what an image part may be, in what order images travel, and their UUIDs.

Pure functions over the parsed JSON; nothing is fetched here (the engine fetches URLs). Every
rejection is a 400 naming the message and part index.
"""

from __future__ import annotations

import base64
import binascii
import re
from urllib.parse import urlsplit

import attrs

from orchestrator.errors import invalid

ALLOWED_SCHEMES = ("http", "https", "data")
_DATA_URI = re.compile(r"^data:(?P<mime>[^;,]+)(?P<params>(?:;[^;,]+)*),(?P<payload>.*)$", re.DOTALL)


@attrs.frozen
class MediaLimits:
    max_url_chars: int = 8192  # an http(s) URL the engine will fetch
    max_images: int = 16
    max_image_bytes: int = 20 * 1024 * 1024
    max_total_image_bytes: int = 64 * 1024 * 1024


@attrs.frozen
class ImageRef:
    """One image, in request order. Exactly one of url / data_uri is set."""

    url: str | None = None
    data_uri: str | None = None
    mime_type: str = ""
    uuid: str | None = None
    where: str = ""  # e.g. "messages[1].content[0]"; for error messages

    def __attrs_post_init__(self) -> None:
        if (self.url is None) == (self.data_uri is None):
            raise ValueError("an image has exactly one of url or data_uri")


def _check_uuid(value, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise invalid(f"{where}: a media UUID must be a non-empty string, got {value!r}", param=where)
    return value


def decoded_size(payload: str) -> int:
    stripped = payload.rstrip("=")
    return len(stripped) * 3 // 4


def parse_image_part(part: dict, where: str, limits: MediaLimits) -> tuple[ImageRef, int]:
    """Validate one `{"type": "image_url", ...}` part; returns the image and its byte size (0 for URLs)."""
    image_url = part.get("image_url")
    if isinstance(image_url, str):  # some clients send the bare string
        url = image_url
    elif isinstance(image_url, dict) and isinstance(image_url.get("url"), str):
        url = image_url["url"]
        detail = image_url.get("detail")
        if detail is not None and detail not in ("auto", "low", "high"):
            raise invalid(f"{where}.image_url.detail: expected auto, low or high, got {detail!r}",
                          param=f"{where}.image_url.detail")
    else:
        raise invalid(f"{where}.image_url: expected an object with a string url", param=f"{where}.image_url")
    uuid = _check_uuid(part["uuid"], f"{where}.uuid") if part.get("uuid") is not None else None
    if "uuid" in part and part["uuid"] is None:
        uuid = None
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in ALLOWED_SCHEMES:
        raise invalid(f"{where}.image_url.url: scheme {scheme or '(none)'!r} is not allowed; "
                      "use http, https or a data: URI", param=f"{where}.image_url.url")
    if scheme in ("http", "https"):
        if len(url) > limits.max_url_chars:
            raise invalid(f"{where}.image_url.url: the URL has {len(url)} characters; at most {limits.max_url_chars} "
                          "are allowed", param=f"{where}.image_url.url")
        if not urlsplit(url).hostname:
            raise invalid(f"{where}.image_url.url: the URL has no host", param=f"{where}.image_url.url")
        return ImageRef(url=url, uuid=uuid, where=where), 0
    match = _DATA_URI.match(url)
    if match is None:
        raise invalid(f"{where}.image_url.url: malformed data URI (expected data:image/...;base64,...)",
                      param=f"{where}.image_url.url")
    mime = match["mime"].strip().lower()
    if ";base64" not in match["params"].lower():
        raise invalid(f"{where}.image_url.url: a data URI must be base64-encoded", param=f"{where}.image_url.url")
    if not mime.startswith("image/"):
        raise invalid(f"{where}.image_url.url: data URI media type {mime!r} is not an image/* type",
                      param=f"{where}.image_url.url")
    payload = match["payload"]
    size = decoded_size(payload)
    if size > limits.max_image_bytes:
        raise invalid(f"{where}.image_url.url: image of about {size} bytes is over the "
                      f"{limits.max_image_bytes}-byte limit", param=f"{where}.image_url.url")
    try:
        base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{where}.image_url.url: the data URI's base64 payload does not decode",
                      param=f"{where}.image_url.url") from None
    return ImageRef(data_uri=url, mime_type=mime, uuid=uuid, where=where), size


def apply_request_uuids(images: list[ImageRef], uuids, limits: MediaLimits) -> tuple[ImageRef, ...]:
    """Attach request-level `multi_modal_uuids` (matched by position) and enforce the count limit."""
    if len(images) > limits.max_images:
        raise invalid(f"the request has {len(images)} images; at most {limits.max_images} are allowed",
                      param="messages")
    if uuids is None:
        return tuple(images)
    if not isinstance(uuids, list):
        raise invalid("multi_modal_uuids: expected a list of strings", param="multi_modal_uuids")
    if len(uuids) != len(images):
        raise invalid(f"multi_modal_uuids has {len(uuids)} entries but the request has {len(images)} images",
                      param="multi_modal_uuids")
    result = []
    for i, (image, uuid) in enumerate(zip(images, uuids)):
        if uuid is None:
            result.append(image)
            continue
        uuid = _check_uuid(uuid, f"multi_modal_uuids[{i}]")
        if image.uuid is not None and image.uuid != uuid:
            raise invalid(f"multi_modal_uuids[{i}] ({uuid!r}) contradicts {image.where}.uuid ({image.uuid!r})",
                          param=f"multi_modal_uuids[{i}]")
        result.append(attrs.evolve(image, uuid=uuid))
    return tuple(result)
