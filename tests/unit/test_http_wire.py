"""The native HTTP server's framing rules (orchestrator/frontend/http_wire.py), without a socket.

Responses are read back with h11, an independent HTTP/1.1 implementation, so a framing mistake cannot
hide behind the parser that wrote it.
"""

import json

import pytest

from h11_helpers import read_back_responses
from orchestrator.frontend import http_wire as wire


def _read_back(data: bytes):
    [(response, body)] = read_back_responses(data)
    return response, body


def test_a_chunked_response_reads_back_whole():
    head = wire.render_head(200, [(b"content-type", b"text/event-stream")], chunked=True, close=False)
    data = head + wire.frame_chunk(b"data: 1\n\n") + wire.frame_chunk(b"") + wire.frame_chunk(b"x" * 300)
    response, body = _read_back(data + wire.LAST_CHUNK)
    assert response.status_code == 200
    assert dict(response.headers)[b"transfer-encoding"] == b"chunked"
    assert body == b"data: 1\n\n" + b"x" * 300


def test_an_empty_chunk_frames_to_nothing_so_it_cannot_end_the_body_early():
    assert wire.frame_chunk(b"") == b""
    assert wire.frame_chunk(b"abc") == b"3\r\nabc\r\n"
    assert wire.frame_chunk(b"a" * 255).startswith(b"ff\r\n")


def test_the_head_carries_date_and_connection_close_only_when_asked():
    keep = wire.render_head(204, [], chunked=False, close=False)
    close = wire.render_head(204, [], chunked=False, close=True)
    assert keep.startswith(b"HTTP/1.1 204 No Content\r\n") and keep.endswith(b"\r\n\r\n")
    assert b"\r\ndate: " in keep and b"connection" not in keep
    assert b"connection: close\r\n" in close


@pytest.mark.parametrize("header", [(b"x-request-id", b"a\r\nset-cookie: evil=1"), (b"x-a\nb", b"1"),
                                    (b"x-a: b", b"1"), (b"x-id", b"a\rb")])
def test_a_header_with_a_line_break_is_refused_not_written(header):
    with pytest.raises(ValueError, match="line break"):
        wire.render_head(200, [header], chunked=False, close=False)


def test_unknown_statuses_have_an_empty_reason_and_nonsense_is_refused():
    assert wire.status_line(599) == b"HTTP/1.1 599 \r\n"
    assert wire.status_line(431) == b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    with pytest.raises(ValueError):
        wire.status_line(42)


def test_an_error_response_is_an_openai_error_and_closes_the_connection():
    response, body = _read_back(wire.error_response(431, "the request head is too large", "too_large"))
    assert response.status_code == 431
    assert dict(response.headers)[b"connection"] == b"close"
    assert json.loads(body) == {"error": {"message": "the request head is too large",
                                          "type": "invalid_request_error", "param": None, "code": "too_large"}}
    _, body = _read_back(wire.error_response(500, "boom", "internal_error"))
    assert json.loads(body)["error"]["type"] == "server_error"


@pytest.mark.parametrize("target, expected", [
    (b"/v1/models", ("/v1/models", b"/v1/models", b"")),
    (b"/v1/models?a=1&b=2", ("/v1/models", b"/v1/models", b"a=1&b=2")),
    (b"/v1/chat%2Fcompletions", ("/v1/chat/completions", b"/v1/chat%2Fcompletions", b"")),
    (b"/caf%C3%A9", ("/caf\u00e9", b"/caf%C3%A9", b"")),
    (b"/x#frag", ("/x", b"/x", b"")),
    (b"http://proxy.example:8000/health?full=1", ("/health", b"/health", b"full=1")),
    (b"http://proxy.example", ("/", b"/", b"")),
])
def test_request_targets_split_into_decoded_path_raw_path_and_query(target, expected):
    assert wire.split_target(target) == expected


def test_a_malformed_percent_escape_does_not_raise():
    path, _, _ = wire.split_target(b"/a%ZZ%C3")
    assert path.startswith("/a%ZZ")


def test_content_length_is_found_in_any_case():
    assert wire.has_content_length([(b"Content-Length", b"3")])
    assert not wire.has_content_length([(b"content-type", b"text/plain")])
