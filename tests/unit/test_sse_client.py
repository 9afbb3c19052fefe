"""The load generator's HTTP client (orchestrator/bench/sse_client.py): whatever way a response is cut into
TCP reads, it hands back each SSE `data:` payload once and in order, and a whole body once."""

from __future__ import annotations

import json
import random

import pytest
import trio
import trio.lowlevel

from orchestrator.bench.sse_client import Connection, HttpError

EVENTS = [b'{"id":"c","choices":[{"delta":{"content":"' + b"x" * n + b'"}}]}' for n in range(12)] + [b"[DONE]"]


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, at = b"", 0
    for size in sizes:
        piece, at = body[at:at + size], at + size
        if piece:
            out += b"%x\r\n" % len(piece) + piece + b"\r\n"
    return out + (b"%x\r\n" % len(body[at:]) + body[at:] + b"\r\n" if body[at:] else b"") + b"0\r\n\r\n"


def response(status: int, body: bytes, *, chunks: list[int] | None = None, close: bool = False) -> bytes:
    head = f"HTTP/1.1 {status} X\r\n" + ("connection: close\r\n" if close else "")
    if chunks is None:
        return (head + f"content-length: {len(body)}\r\n\r\n").encode() + body
    return (head + "transfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n").encode() + chunked(
        body, chunks)


async def serve(responses: list[bytes], cuts: random.Random, task_status=trio.TASK_STATUS_IGNORED):
    """Answers each request on one connection with the next response, written in randomly cut pieces."""
    async def handler(stream: trio.SocketStream):
        buffer = b""
        for raw in responses:
            while b"\r\n\r\n" not in buffer:
                buffer += await stream.receive_some(65536)
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(buffer) < length:
                buffer += await stream.receive_some(65536)
            buffer = buffer[length:]
            at = 0
            while at < len(raw):
                step = cuts.randint(1, 40)
                await stream.send_all(raw[at:at + step])
                at += step
                await trio.lowlevel.checkpoint()
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handler, listeners)


async def run_client(responses: list[bytes], requests: int, seed: int):
    received: list[list[bytes]] = []
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve, responses, random.Random(seed))
        connection = Connection(f"http://127.0.0.1:{port}")
        outcomes: list[int | HttpError] = []  # a status, or the error raised instead
        for _ in range(requests):
            payloads: list[bytes] = []
            try:
                outcomes.append(await connection.post_stream("/v1/chat/completions", {"n": 1},
                                                             lambda data, at: payloads.append(data)))  # noqa: B023
            except HttpError as error:
                outcomes.append(error)
            received.append(payloads)
        await connection.aclose()
        nursery.cancel_scope.cancel()
    return outcomes, received


@pytest.mark.parametrize("seed", range(8))
async def test_events_arrive_once_and_in_order_however_the_chunks_and_reads_are_cut(seed):
    rng = random.Random(seed)
    body = b"".join(b"data: " + event + b"\n\n" for event in EVENTS)
    sizes = [rng.randint(1, 120) for _ in range(40)]
    outcomes, received = await run_client([response(200, body, chunks=sizes)] * 2, 2, seed)
    assert outcomes == [200, 200]  # the second request on the same keep-alive connection
    assert received == [EVENTS, EVENTS]


async def test_a_body_with_a_length_is_handed_back_whole_once():
    body = json.dumps({"choices": [{"message": {"content": "hello"}}]}).encode()
    outcomes, received = await run_client([response(200, body)], 1, 0)
    assert outcomes == [200] and received == [[body]]


@pytest.mark.parametrize("chunks", [None, [3, 5, 7]])
async def test_an_error_status_is_an_http_error_with_the_body_and_no_events(chunks):
    body = b'data: {"error": {"message": "bad"}}\n\n' if chunks else b'{"error": {"message": "bad"}}'
    outcomes, received = await run_client([response(400, body, chunks=chunks)], 1, 0)
    assert isinstance(outcomes[0], HttpError) and outcomes[0].status == 400 and outcomes[0].body == body
    assert received == [[]]


async def test_a_response_that_closes_the_connection_is_followed_by_a_new_one():
    body = b"data: [DONE]\n\n"
    outcomes, received = await run_client([response(200, body, chunks=[4], close=True)], 2, 0)
    assert outcomes == [200, 200] and received == [[b"[DONE]"], [b"[DONE]"]]
