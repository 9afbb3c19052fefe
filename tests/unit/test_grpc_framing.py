"""gRPC's framing of one response (transport/grpc_framing.py), I/O-free: messages cut from DATA whatever its split,
compressed ones inflated within the limit, and what the header blocks and the end say about the call."""

from __future__ import annotations

import gzip
import zlib

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.transport import grpc_framing
from orchestrator.transport.grpc_framing import CallFailure, ResponseFraming

RESPONSE = [(b":status", b"200"), (b"content-type", b"application/grpc")]


def framed(message: bytes, *, compress: str | None = None) -> bytes:
    if compress is None:
        return grpc_framing.prefix(message) + message
    packed = gzip.compress(message) if compress == "gzip" else zlib.compress(message)
    return b"\x01" + len(packed).to_bytes(4, "big") + packed


def fed(response: ResponseFraming, wire: bytes, cuts=()) -> list[bytes]:
    messages: list[bytes] = []
    at = 0
    for cut in [*sorted(set(cuts)), len(wire)]:
        if at < cut <= len(wire):
            messages += response.data(wire[at:cut])
            at = cut
    return messages


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=300), st.booleans()), min_size=1, max_size=6),
       st.sampled_from(["gzip", "deflate"]), st.lists(st.integers(min_value=1, max_value=2000), max_size=12))
def test_every_split_of_the_bytes_gives_the_same_messages_compressed_or_not(messages, encoding, cuts):
    wire = b"".join(framed(message, compress=encoding if compressed else None) for message, compressed in messages)
    response = ResponseFraming()
    assert response.headers([*RESPONSE, (b"grpc-encoding", encoding.encode())]) is None
    assert fed(response, wire, cuts) == [message for message, _ in messages]
    assert response.failure is None
    response.headers([(b"grpc-status", b"0")])
    assert response.end() is None


def test_a_message_cut_by_the_end_of_the_data_waits_for_the_rest_and_a_stream_ending_there_fails():
    response = ResponseFraming()
    assert response.data(framed(b"whole") + framed(b"in part")[:6]) == [b"whole"]
    response.headers([(b"grpc-status", b"0")])
    assert response.end() == CallFailure(None, "the stream ended inside a message")


def test_a_length_above_the_limit_fails_at_its_prefix_after_the_messages_before_it_and_at_the_limit_it_waits():
    limit = grpc_framing.MAX_MESSAGE_BYTES
    at_limit = ResponseFraming()
    assert at_limit.data(b"\x00" + limit.to_bytes(4, "big") + b"part of it") == [] and at_limit.failure is None
    above = ResponseFraming()
    assert above.data(framed(b"first") + b"\x00" + (limit + 1).to_bytes(4, "big") + b"part of it") == [b"first"]
    assert above.failure is not None and above.failure.status == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not above.pending  # nothing of it kept


@pytest.mark.parametrize("headers, wire, status, words", [
    (RESPONSE, framed(b"x", compress="gzip"), grpc.StatusCode.INTERNAL, "which we do not inflate"),
    ([*RESPONSE, (b"grpc-encoding", b"snappy")], framed(b"x", compress="gzip"), grpc.StatusCode.INTERNAL, "snappy"),
    (RESPONSE, b"\x02" + framed(b"x")[1:], grpc.StatusCode.INTERNAL, "flags 0x2"),
    ([*RESPONSE, (b"grpc-encoding", b"gzip")], b"\x01\x00\x00\x00\x03abc", grpc.StatusCode.INTERNAL,
     "does not inflate"),
])
def test_a_message_we_cannot_read_fails_the_call(headers, wire, status, words):
    response = ResponseFraming()
    response.headers(headers)
    assert response.data(wire) == []
    assert response.failure is not None and response.failure.status == status and words in response.failure.why


def test_a_compressed_message_inflating_above_the_limit_fails_resource_exhausted(monkeypatch):
    monkeypatch.setattr(grpc_framing, "MAX_MESSAGE_BYTES", 1000)
    response = ResponseFraming()
    response.headers([*RESPONSE, (b"grpc-encoding", b"gzip")])
    assert response.data(framed(b"\x00" * 1000, compress="gzip")) == [b"\x00" * 1000]
    assert response.data(framed(b"\x00" * 1001, compress="gzip")) == []
    assert response.failure is not None and response.failure.status == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("headers, expected", [
    ([(b":status", b"200"), (b"content-type", b"application/grpc+proto")], None),
    ([(b":status", b"503")], grpc.StatusCode.UNAVAILABLE),
    ([(b":status", b"404"), (b"content-type", b"text/html")], grpc.StatusCode.UNIMPLEMENTED),
    ([(b":status", b"418")], grpc.StatusCode.UNKNOWN),
    ([(b":status", b"200"), (b"content-type", b"text/html")], grpc.StatusCode.INTERNAL),
    ([(b":status", b"200"), (b"content-type", b"application/grpc"), (b"grpc-status", b"five")],
     grpc.StatusCode.INTERNAL),
    ([(b":status", b"503"), (b"grpc-status", b"0")], None),  # a gRPC status says more than the HTTP one
])
def test_what_a_header_block_says_about_the_call(headers, expected):
    failure = ResponseFraming().headers(headers)
    assert (failure.status if failure is not None else None) == expected


def test_the_trailers_status_and_its_percent_encoded_message_end_the_call():
    response = ResponseFraming()
    assert response.headers([*RESPONSE, (b"grpc-status", b"5"), (b"grpc-message", b"no%20such%20model")]) is None
    assert response.end() == CallFailure(grpc.StatusCode.NOT_FOUND, "no such model")
    unknown = ResponseFraming()
    unknown.headers([(b"grpc-status", b"99")])
    assert unknown.end() == CallFailure(grpc.StatusCode.UNKNOWN, "")


def test_a_stream_that_ends_without_a_grpc_status_fails_without_a_status():
    response = ResponseFraming()
    response.headers(RESPONSE)
    assert response.end() == CallFailure(None, "the stream ended without a grpc-status")
