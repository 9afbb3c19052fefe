"""HTTP/1.1 response framing and request-target parsing for the native server. Pure, no I/O.

The server (frontend/http_server.py) parses requests with httptools and writes what these functions
render: a response head, chunked-transfer frames, the error response of a request that never reached
the application. Kept apart so that every framing rule is unit-tested without a socket
(tests/unit/test_http_wire.py).
"""

from __future__ import annotations

import json
import time
from email.utils import formatdate
from http import HTTPStatus
from urllib.parse import unquote

LAST_CHUNK = b"0\r\n\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        if not 100 <= status <= 999:
            raise ValueError(f"an HTTP status is a three-digit number, got {status!r}")
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = ""
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {reason}\r\n".encode("ascii")
    return line


class _DateHeader:
    """The Date header, rendered at most once a second (it has one-second resolution)."""

    def __init__(self) -> None:
        self._second = -1
        self._line = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._line = f"date: {formatdate(now, usegmt=True)}\r\n".encode("ascii")
        return self._line


date_header = _DateHeader()


def render_head(status: int, headers, *, chunked: bool, close: bool) -> bytes:
    """A response head: status line, the application's headers, then date, framing and connection headers.

    Header names and values must not hold CR or LF (one would split the head: response splitting).
    """
    parts = [status_line(status)]
    for name, value in headers:
        if b"\r" in value or b"\n" in value or b"\r" in name or b"\n" in name or b":" in name:
            raise ValueError(f"response header {name!r} holds a line break or its name a colon")
        parts.append(b"%s: %s\r\n" % (name, value))
    parts.append(date_header())
    if chunked:
        parts.append(b"transfer-encoding: chunked\r\n")
    if close:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def frame_chunk(body: bytes) -> bytes:
    """One chunk of a chunked body (an empty body would end the message, so it frames to nothing)."""
    if not body:
        return b""
    return b"%x\r\n%s\r\n" % (len(body), body)


def has_content_length(headers) -> bool:
    return any(name.lower() == b"content-length" for name, _ in headers)


def split_target(target: bytes) -> tuple[str, bytes, bytes]:
    """(path, raw path, query string) of an origin-form request target (`/v1/models?x=1`).

    The path is percent-decoded (as ASGI's `path`); an absolute-form target (`http://host/path`, which
    proxies send) keeps only its path.
    """
    raw_path, _, query = target.partition(b"?")
    raw_path = raw_path.partition(b"#")[0]
    if raw_path[:1] != b"/" and b"://" in raw_path:
        after_scheme = raw_path.split(b"://", 1)[1]
        slash = after_scheme.find(b"/")
        raw_path = after_scheme[slash:] if slash >= 0 else b"/"
    path = raw_path.decode("latin-1")
    if "%" in path:
        path = unquote(path, encoding="utf-8", errors="replace")
    return path, raw_path, query


def error_response(status: int, message: str, code: str, *, retry_after: int | None = None,
                   with_body: bool = True) -> bytes:
    """A whole response in the OpenAI error format, for a request the application never saw (unparseable,
    head too large, too many connections) or failed; the connection closes after it. Without its body for
    a HEAD."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}},
                      allow_nan=False).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    head = render_head(status, headers, chunked=False, close=True)
    return head + body if with_body else head
