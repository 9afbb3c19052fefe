"""The native HTTP/1.1 server (orchestrator/frontend/http_server.py) on a real socket, with small ASGI apps.

Clients are raw trio streams read back with h11 (an independent parser) where the bytes matter, and
httpx where a real client's behaviour matters (keep-alive reuse). The orchestrator's own routes run on
this server in every end-to-end test; these tests pin the HTTP rules themselves.
"""

import json
from contextlib import asynccontextmanager
from functools import partial

import httpx
import pytest
import trio

from h11_helpers import read_back_responses as parse_responses
from orchestrator.frontend.http_server import ServerLimits, open_listener, serve_http
from orchestrator.frontend.server_extensions import ServerExtensions


@asynccontextmanager
async def running(app, **limits):
    listener = await open_listener("127.0.0.1", 0, backlog=64)
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(serve_http, app, listener, limits=ServerLimits(**limits),
                                          shutdown=shutdown))
        server = Server(url, shutdown, int(url.rsplit(":", 1)[1]))
        yield server
        nursery.cancel_scope.cancel()


class Server:
    def __init__(self, url, shutdown, port):
        self.url, self.shutdown, self.port = url, shutdown, port

    async def connect(self) -> trio.SocketStream:
        return await trio.open_tcp_stream("127.0.0.1", self.port)


async def read_until_closed(stream, timeout=5.0) -> bytes:
    data = b""
    with trio.fail_after(timeout):
        while chunk := await stream.receive_some(65536):
            data += chunk
    return data


async def read_body(receive) -> bytes:
    """The whole request body, as an ASGI app reads it."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def echo(scope, receive, send):
    """Replies with the method, path, query and the body it read, as JSON."""
    body = await read_body(receive)
    data = json.dumps({"method": scope["method"], "path": scope["path"], "query": scope["query_string"].decode(),
                       "body_bytes": len(body), "client_port": scope["client"][1]}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def head(method="GET", target="/", headers=(), body=b"") -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "host: test", *headers]
    if body:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def test_a_streamed_response_is_chunked_and_reads_back_whole():
    async def stream(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(5):
            await send({"type": "http.response.body", "body": b"data: %d\n\n" % i, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async with running(stream) as server:
        client = await server.connect()
        await client.send_all(head(headers=["connection: close"]))
        [(response, body)] = parse_responses(await read_until_closed(client))
    assert response.status_code == 200
    headers = dict(response.headers)
    assert headers[b"transfer-encoding"] == b"chunked" and headers[b"connection"] == b"close"
    assert body == b"".join(b"data: %d\n\n" % i for i in range(5)) + b"data: [DONE]\n\n"


async def test_keep_alive_serves_many_requests_on_one_connection_with_httpx():
    async with running(echo) as server:
        async with httpx.AsyncClient(base_url=server.url) as http:
            replies = [(await http.post(f"/v1/x?n={i}", content=b"a" * i)).json() for i in range(1, 6)]
    assert [r["body_bytes"] for r in replies] == [1, 2, 3, 4, 5]
    assert [r["query"] for r in replies] == [f"n={i}" for i in range(1, 6)]
    assert len({r["client_port"] for r in replies}) == 1  # one connection, reused


async def test_pipelined_requests_are_answered_in_order():
    async with running(echo) as server:
        client = await server.connect()
        await client.send_all(head(target="/first") + head("POST", "/second", body=b"xyz")
                              + head(target="/third", headers=["connection: close"]))
        replies = parse_responses(await read_until_closed(client), requests=3)
    assert [json.loads(body)["path"] for _, body in replies] == ["/first", "/second", "/third"]
    assert json.loads(replies[1][1])["body_bytes"] == 3


async def test_expect_100_continue_is_answered_before_the_body_is_sent():
    async with running(echo) as server:
        client = await server.connect()
        await client.send_all(b"POST /up HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\nexpect: 100-continue\r\n\r\n")
        with trio.fail_after(5):
            interim = await client.receive_some(100)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        await client.send_all(b"hello")
        data = b""
        with trio.fail_after(5):
            while not data.endswith(b"}"):
                data += await client.receive_some(65536)
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["body_bytes"] == 5


async def test_a_chunked_request_body_reaches_the_app_decoded():
    async with running(echo) as server:
        client = await server.connect()
        await client.send_all(b"POST /c HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
                              b"3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n")
        [(_, body)] = parse_responses(await read_until_closed(client))
    assert json.loads(body)["body_bytes"] == 7


async def test_a_big_body_arrives_intact_though_the_app_reads_it_slowly():
    """Reading pauses when the app falls behind (backpressure); nothing is lost."""
    async def slow_sum(scope, receive, send):
        total = 0
        while True:
            message = await receive()
            total += len(message.get("body", b""))
            await trio.sleep(0.001)
            if not message.get("more_body"):
                break
        data = str(total).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(data))]})
        await send({"type": "http.response.body", "body": data})

    async with running(slow_sum) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            reply = await http.post("/", content=b"z" * (6 << 20))
    assert reply.text == str(6 << 20)


async def test_a_head_larger_than_the_limit_is_a_431_in_the_openai_format():
    async with running(echo, max_header_bytes=1024) as server:
        client = await server.connect()
        await client.send_all(head(headers=[f"x-big: {'a' * 2000}"]))
        [(response, body)] = parse_responses(await read_until_closed(client))
    assert response.status_code == 431
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"


async def test_a_head_sent_byte_by_byte_past_the_limit_is_refused_too():
    async with running(echo, max_header_bytes=512) as server:
        client = await server.connect()
        await client.send_all(b"GET / HTTP/1.1\r\nhost: t\r\nx-slow: ")
        with trio.fail_after(5):
            for _ in range(600):
                try:
                    await client.send_all(b"a")
                except trio.BrokenResourceError:
                    break
        [(response, _)] = parse_responses(await read_until_closed(client))
    assert response.status_code == 431


async def test_bytes_that_are_not_http_get_a_400_and_the_connection_closes():
    async with running(echo) as server:
        client = await server.connect()
        await client.send_all(b"\x16\x03\x01 this is not HTTP\r\n\r\n")
        [(response, body)] = parse_responses(await read_until_closed(client))
    assert response.status_code == 400
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


async def test_the_app_learns_of_a_client_disconnect_mid_response():
    seen = trio.Event()

    async def waits_for_disconnect(scope, receive, send):
        await receive()  # the (empty) body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        with trio.fail_after(5):
            message = await receive()
        assert message == {"type": "http.disconnect"}
        seen.set()

    async with running(waits_for_disconnect) as server:
        client = await server.connect()
        await client.send_all(head())
        with trio.fail_after(5):
            assert b"first" in await client.receive_some(65536)
        await client.aclose()
        with trio.fail_after(5):
            await seen.wait()


async def done_then_streaming_then_hang_up(app, gone: trio.Event, before_hang_up=lambda: True):
    """Two pipelined requests, /done then /streaming; once /streaming's first bytes arrived the client closes,
    and `gone` is awaited. `before_hang_up()` must hold when those bytes are in."""
    async with running(app) as server:
        client = await server.connect()
        await client.send_all(head(target="/done") + head(target="/streaming"))
        with trio.fail_after(5):
            received = b""
            while b"first" not in received:
                received += await client.receive_some(65536)
        assert before_hang_up()
        await client.aclose()
        with trio.fail_after(5):
            await gone.wait()
        await trio.sleep(0.05)  # time for a wrong second call


async def test_the_on_disconnect_callback_runs_once_when_the_client_goes_and_never_for_a_finished_request():
    """The extension the orchestrator uses instead of a watcher task per request: the connection's reader calls
    the callback of the request being answered; a request that has ended is not called back."""
    calls: list[str] = []
    gone = trio.Event()

    async def app(scope, receive, send):
        await receive()
        name = scope["path"]
        def on_disconnect() -> None:
            calls.append(name)
            gone.set()

        ServerExtensions.of(scope).on_disconnect(on_disconnect)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]
                    if name == "/done" else []})
        if name == "/done":
            await send({"type": "http.response.body", "body": b"ok"})
            return
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await trio.sleep_forever()  # cancelled only by the drain at the end: the callback does not cancel it

    await done_then_streaming_then_hang_up(app, gone, before_hang_up=lambda: calls == [])
    assert calls == ["/streaming"]


async def test_a_request_that_is_over_is_not_called_back_even_when_it_registers_late():
    registrars = []
    calls = []
    gone = trio.Event()

    def called_back(name: str) -> None:
        calls.append(name)
        gone.set()

    async def app(scope, receive, send):
        await receive()
        registrars.append(ServerExtensions.of(scope).on_disconnect)
        if scope["path"] == "/done":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        registrars[1](partial(called_back, "/streaming"))
        registrars[0](partial(called_back, "/done, registered late"))  # the first request's, over
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await trio.sleep_forever()

    await done_then_streaming_then_hang_up(app, gone)
    assert calls == ["/streaming"]


async def test_an_on_disconnect_callback_registered_after_the_client_went_runs_at_once():
    registered = trio.Event()
    calls = []

    async def app(scope, receive, send):
        await receive()
        while (await receive())["type"] != "http.disconnect":
            pass
        ServerExtensions.of(scope).on_disconnect(lambda: calls.append("gone"))
        registered.set()

    async with running(app) as server:
        client = await server.connect()
        await client.send_all(head())
        await client.aclose()
        with trio.fail_after(5):
            await registered.wait()
    assert calls == ["gone"]


async def test_an_idle_keep_alive_connection_and_an_unfinished_head_are_closed_after_keep_alive_s():
    async with running(echo, keep_alive_s=0.3) as server:
        idle = await server.connect()
        await idle.send_all(head())
        slow = await server.connect()
        await slow.send_all(b"GET / HTTP/1.1\r\nhost:")  # never finished
        start = trio.current_time()
        reply = await read_until_closed(idle)
        assert await read_until_closed(slow) == b""
        elapsed = trio.current_time() - start
    assert parse_responses(reply)[0][0].status_code == 200
    assert 0.2 < elapsed < 3


async def test_a_response_longer_than_keep_alive_s_is_whole_and_the_client_going_is_still_seen_meanwhile():
    """keep_alive_s bounds the idle time between requests only: while a request is answered the reader keeps
    watching for the client, then the idle time counts from the end of the response."""
    gone = trio.Event()

    async def slow_then_watch(scope, receive, send):
        await receive()
        ServerExtensions.of(scope).on_disconnect(gone.set)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(4):
            await trio.sleep(0.2)
            await send({"type": "http.response.body", "body": b"part ", "more_body": True})
        if scope["path"] == "/last":
            await send({"type": "http.response.body", "body": b"end", "more_body": False})
            return
        await trio.sleep_forever()

    async with running(slow_then_watch, keep_alive_s=0.3) as server:
        client = await server.connect()
        await client.send_all(head(target="/last"))
        data = b""
        with trio.fail_after(5):
            while not data.endswith(b"0\r\n\r\n"):
                data += await client.receive_some(65536)
        ended = trio.current_time()
        assert parse_responses(data)[0][1] == b"part " * 4 + b"end"
        assert await read_until_closed(client) == b""  # then idle for keep_alive_s: closed
        assert 0.2 < trio.current_time() - ended < 3

        client = await server.connect()
        await client.send_all(head(target="/watch"))
        with trio.fail_after(5):
            received = b""
            while received.count(b"part") < 4:  # 0.8 s into the response, past keep_alive_s
                received += await client.receive_some(65536)
        await client.aclose()
        with trio.fail_after(5):
            await gone.wait()


async def test_body_arrived_tells_whether_receive_has_the_whole_body_at_once():
    seen: list[tuple[bool, int]] = []

    async def app(scope, receive, send):
        arrived = ServerExtensions.of(scope).body_arrived
        seen.append((arrived, len(await read_body(receive))))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async with running(app) as server:
        client = await server.connect()
        await client.send_all(head("POST", body=b"x" * 100))
        with trio.fail_after(5):
            await client.receive_some(65536)
        await client.send_all(head("POST", body=b"y" * 100)[:-40])  # the head and part of the body
        await trio.sleep(0.2)
        await client.send_all(b"y" * 40)
        with trio.fail_after(5):
            await client.receive_some(65536)
    assert seen == [(True, 100), (False, 100)]


async def test_send_now_writes_a_chunk_from_another_task_while_the_app_waits():
    """What a streamed token does: the engine connection's reader task writes it, the request's task waits."""
    async def app(scope, receive, send):
        send_now = ServerExtensions.of(scope).send_now
        assert send_now is not None  # plain TCP
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: 0\n\n", "more_body": True})
        written = trio.Event()

        def elsewhere() -> None:
            assert send_now(b"data: 1\n\n") and send_now(b"data: 2\n\n")
            written.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_call_in_a_task, elsewhere)
            await written.wait()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async with running(app) as server:
        client = await server.connect()
        await client.send_all(head(headers=["connection: close"]))
        [(response, body)] = parse_responses(await read_until_closed(client))
    assert response.status_code == 200 and dict(response.headers)[b"transfer-encoding"] == b"chunked"
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"


async def _call_in_a_task(function) -> None:
    function()


async def test_what_send_now_could_not_write_goes_first_with_the_next_send_and_in_order():
    """A client that does not read fills the socket: send_now says so (False) and keeps the rest; the app's
    next send (an empty chunk will do) waits for the client and writes the rest before anything else."""
    chunk = b"x" * 65530
    taken_at_once: list[int] = []  # the chunks send_now wrote whole
    filled, flushed = trio.Event(), trio.Event()

    async def app(scope, receive, send):
        send_now = ServerExtensions.of(scope).send_now
        assert send_now is not None  # plain TCP
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"start", "more_body": True})
        while send_now(b"%05d" % len(taken_at_once) + chunk):
            taken_at_once.append(len(taken_at_once))
        filled.set()
        await send({"type": "http.response.body", "body": b"", "more_body": True})
        flushed.set()
        await send({"type": "http.response.body", "body": b"end", "more_body": False})

    async with running(app) as server:
        client = await server.connect()
        await client.send_all(head(headers=["connection: close"]))
        with trio.fail_after(10):
            await filled.wait()
        await trio.sleep(0.2)
        assert not flushed.is_set()  # the empty send waits for the client to take the rest
        [(_response, body)] = parse_responses(await read_until_closed(client, timeout=20))
    assert flushed.is_set()
    chunks = len(taken_at_once) + 1  # and the one that went in part
    assert body == b"start" + b"".join(b"%05d" % index + chunk for index in range(chunks)) + b"end"


async def test_send_now_refuses_a_response_that_has_not_started():
    seen = []

    async def app(scope, receive, send):
        send_now = ServerExtensions.of(scope).send_now
        assert send_now is not None  # plain TCP
        with pytest.raises(RuntimeError, match="started"):
            send_now(b"too early")
        seen.append(True)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async with running(app) as server:
        client = await server.connect()
        await client.send_all(head(headers=["connection: close"]))
        await read_until_closed(client)
    assert seen == [True]


async def test_drain_closes_idle_connections_at_once_and_lets_in_flight_responses_finish():
    release = trio.Event()
    started = trio.Event()

    async def slow(scope, receive, send):
        await receive()
        if scope["path"] == "/slow":
            started.set()
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async with running(slow, keep_alive_s=60, grace_s=10) as server:
        idle = await server.connect()
        await idle.send_all(head())
        with trio.fail_after(5):
            await idle.receive_some(65536)  # answered; now idle on keep-alive
        busy = await server.connect()
        await busy.send_all(head(target="/slow"))
        await started.wait()
        server.shutdown.set()
        assert await read_until_closed(idle, timeout=2) == b""  # closed at once, not after 60 s
        with pytest.raises(OSError):
            await trio.open_tcp_stream("127.0.0.1", server.port)  # no longer accepting
        release.set()
        [(response, body)] = parse_responses(await read_until_closed(busy))
    assert (response.status_code, body) == (200, b"ok")
    assert dict(response.headers)[b"connection"] == b"close"


async def test_drain_cancels_what_is_still_running_when_the_grace_ends():
    cancelled = trio.Event()

    async def never_ends(scope, receive, send):
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.set()
            raise

    listener = await open_listener("127.0.0.1", 0, backlog=8)
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(serve_http, never_ends, listener, limits=ServerLimits(grace_s=0.3),
                                          shutdown=shutdown))
        client = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
        await client.send_all(head())
        await trio.sleep(0.1)
        shutdown.set()
        with trio.fail_after(5):
            await cancelled.wait()
    # the nursery exited: serve_http returned on its own after the grace


async def test_an_app_failure_before_the_response_is_a_500_and_after_it_the_connection_ends():
    async def fails(scope, receive, send):
        if scope["path"] == "/late":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"partial", "more_body": True})
        raise RuntimeError("boom")

    async with running(fails) as server:
        early = await server.connect()
        await early.send_all(head())
        [(response, body)] = parse_responses(await read_until_closed(early))
        assert response.status_code == 500 and json.loads(body)["error"]["code"] == "internal_error"
        late = await server.connect()
        await late.send_all(head(target="/late"))
        data = await read_until_closed(late)
    assert b"partial" in data and not data.endswith(b"0\r\n\r\n")  # no terminator: the client sees it cut


async def streamed(scope, receive, send):
    """A body without content-length (chunked), in several sends, one of them through send_now."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"one ", "more_body": True})
    send_now = ServerExtensions.of(scope).send_now
    assert send_now is not None  # plain TCP
    send_now(b"two ")
    await send({"type": "http.response.body", "body": b"three"})


async def no_content(scope, receive, send):
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


@pytest.mark.parametrize("app, length", [(echo, True), (streamed, False)])
async def test_a_head_response_has_no_body_and_the_next_response_on_the_connection_reads_back_whole(app, length):
    """A HEAD answered with a body put two bodies on a keep-alive connection: what a health checker sent next
    read the HEAD's body as its response."""
    async with running(app) as server:
        client = await server.connect()
        await client.send_all(head("HEAD", "/first") + head(target="/second", headers=["connection: close"]))
        data = await read_until_closed(client)
    (head_response, head_body), (get_response, get_body) = parse_responses(data, methods=("HEAD", "GET"))
    assert head_response.status_code == 200 and head_body == b""
    assert get_response.status_code == 200 and get_body
    if length:  # the head says what a GET would get
        what_get_would_get = json.dumps({**json.loads(get_body), "method": "HEAD", "path": "/first"}).encode()
        assert int(dict(head_response.headers)[b"content-length"]) == len(what_get_would_get)
    else:
        assert get_body == b"one two three"


async def test_a_204_response_has_no_body_and_no_chunked_framing():
    async with running(no_content) as server:
        client = await server.connect()
        await client.send_all(head(target="/a") + head(target="/b", headers=["connection: close"]))
        data = await read_until_closed(client)
    replies = parse_responses(data, requests=2)
    assert [(r.status_code, body) for r, body in replies] == [(204, b""), (204, b"")]
    assert b"transfer-encoding" not in data


async def test_a_head_whose_application_fails_gets_a_500_head_without_a_body():
    async def fails(scope, receive, send):
        raise RuntimeError("boom")

    async with running(fails) as server:
        client = await server.connect()
        await client.send_all(head("HEAD", "/x"))
        data = await read_until_closed(client)
    [(response, body)] = parse_responses(data, methods=("HEAD",))
    assert response.status_code == 500 and body == b"" and data.endswith(b"\r\n\r\n")


async def test_a_response_header_with_a_line_break_is_never_written():
    async def injects(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"x-request-id", b"a\r\nset-cookie: evil=1"), (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async with running(injects) as server:
        client = await server.connect()
        await client.send_all(head())
        data = await read_until_closed(client)
    assert b"set-cookie" not in data
    assert parse_responses(data)[0][0].status_code == 500


async def test_http_1_0_gets_an_unchunked_body_and_a_closed_connection():
    async def unsized(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"one ", "more_body": True})
        await send({"type": "http.response.body", "body": b"two"})

    async with running(unsized) as server:
        client = await server.connect()
        await client.send_all(b"GET / HTTP/1.0\r\n\r\n")
        data = await read_until_closed(client)
    assert data.startswith(b"HTTP/1.1 200 OK\r\n") and b"chunked" not in data
    assert data.endswith(b"\r\n\r\none two")


async def test_a_response_that_leaves_the_body_unread_closes_the_connection():
    async def refuses(scope, receive, send):  # answers (as a 401 would) without reading the body
        await send({"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async with running(refuses) as server:
        client = await server.connect()
        await client.send_all(b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 100000\r\n\r\n" + b"a" * 10)
        data = await read_until_closed(client)
    response = parse_responses(data)[0][0]
    assert response.status_code == 401 and dict(response.headers)[b"connection"] == b"close"


async def test_an_upgrade_request_is_answered_as_http_1_1_and_the_connection_then_closes():
    async with running(echo) as server:
        client = await server.connect()
        await client.send_all(head(target="/up", headers=["connection: Upgrade, HTTP2-Settings", "upgrade: h2c",
                                                          "http2-settings: AAMAAABkAAQAAP__"]))
        data = b""
        with trio.fail_after(5):
            while not data.endswith(b"}"):
                data += await client.receive_some(65536)
        rest = await read_until_closed(client)  # what follows an upgrade is not HTTP/1.1: no second request
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["path"] == "/up"
    assert rest == b""


async def test_the_scope_has_a_decoded_path_and_lower_case_header_names():
    scopes = []

    async def records(scope, receive, send):
        scopes.append(scope)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async with running(records) as server:
        client = await server.connect()
        await client.send_all(head(target="/a%20b?q=1", headers=["X-Request-Id: abc", "connection: close"]))
        await read_until_closed(client)
    [scope] = scopes
    assert (scope["path"], scope["raw_path"], scope["query_string"]) == ("/a b", b"/a%20b", b"q=1")
    assert (b"x-request-id", b"abc") in scope["headers"]
    assert scope["method"] == "GET" and scope["http_version"] == "1.1" and scope["scheme"] == "http"


async def test_two_listeners_can_share_a_port_with_reuse_port():
    first = await open_listener("127.0.0.1", 0, backlog=8, reuse_port=True)
    port = first.socket.getsockname()[1]
    second = await open_listener("127.0.0.1", port, backlog=8, reuse_port=True)
    try:
        with pytest.raises(OSError):
            await open_listener("127.0.0.1", port, backlog=8)  # without it: address in use
    finally:
        await first.aclose()
        await second.aclose()


async def test_out_of_descriptors_accept_pauses_and_logs_one_line_per_interval_without_a_traceback(
        autojump_clock, caplog):
    import errno
    import logging

    from orchestrator.frontend.http_server import _Server

    class OutOfDescriptors:
        attempts = 0

        async def accept(self):
            await trio.lowlevel.checkpoint()
            self.attempts += 1
            raise OSError(errno.EMFILE, "Too many open files")

    listener = OutOfDescriptors()
    with caplog.at_level(logging.ERROR, logger="orchestrator.frontend.http_server"):
        async with trio.open_nursery() as nursery:
            with trio.move_on_after(25):
                await _Server(echo, ServerLimits(), None).accept(listener, nursery)  # type: ignore[arg-type]
    lines = [r for r in caplog.records if "cannot accept connections" in r.getMessage()]
    assert 200 < listener.attempts <= 251  # it kept trying, 0.1 s apart (25 s of the test's clock)
    # one line (RateLimitedLog: one per 10 s of the wall clock, which hardly moved), and no traceback
    assert len(lines) == 1 and lines[0].exc_info is None and "Too many open files" in lines[0].getMessage()


async def test_a_connection_beyond_max_connections_is_refused_with_a_503_when_none_is_idle():
    release = trio.Event()

    async def busy(scope, receive, send):
        await release.wait()
        await echo(scope, receive, send)

    async with running(busy, max_connections=1) as server:
        first = await server.connect()
        # being answered: not idle, so it is not the one closed
        await first.send_all(head(headers=["connection: close"]))
        await trio.sleep(0.2)
        second = await server.connect()
        [(response, body)] = parse_responses(await read_until_closed(second))
        release.set()
        [(answered, _)] = parse_responses(await read_until_closed(first, timeout=5), requests=1)
    assert response.status_code == 503 and dict(response.headers)[b"retry-after"] == b"1"
    assert json.loads(body)["error"]["code"] == "too_many_connections"
    assert answered.status_code == 200


async def headers_after_body(scope, receive, send):
    """Reads the whole body, then replies with the request's header names as JSON (trailers arrive after the
    body: a server merging them would show them here); returns without a response when the body broke off."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return  # the server answers a body it refused itself
        if not message.get("more_body"):
            break
    data = json.dumps([name.decode() for name, _ in scope["headers"]]).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(data))]})
    await send({"type": "http.response.body", "body": data})


async def test_chunked_trailer_fields_never_become_request_headers():
    async with running(headers_after_body) as server:
        client = await server.connect()
        await client.send_all(b"POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
                              b"3\r\nabc\r\n0\r\nauthorization: Bearer sneaked\r\nx-request-id: set-by-trailer\r\n\r\n")
        [(response, body)] = parse_responses(await read_until_closed(client))
    assert response.status_code == 200
    assert json.loads(body) == ["host", "transfer-encoding", "connection"]


async def test_a_trailer_section_larger_than_the_head_limit_is_a_431_and_reading_stops():
    async with running(headers_after_body, max_header_bytes=1024) as server:
        client = await server.connect()
        await client.send_all(b"POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n")
        with trio.fail_after(10):
            try:
                for _ in range(1000):  # 4 MB of trailer fields, the section never ended
                    await client.send_all(b"x-filler: " + b"a" * 4000 + b"\r\n")
            except trio.BrokenResourceError:
                pass
        [(response, body)] = parse_responses(await read_until_closed(client))
    assert response.status_code == 431
    assert "trailer" in json.loads(body)["error"]["message"]


async def test_one_endless_chunk_extension_is_refused_like_a_long_trailer():
    async with running(headers_after_body, max_header_bytes=1024) as server:
        client = await server.connect()
        await client.send_all(b"POST / HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n3;ext=")
        with trio.fail_after(10):
            try:
                for _ in range(2000):
                    await client.send_all(b"a" * 4096)
            except trio.BrokenResourceError:
                pass
        [(response, _)] = parse_responses(await read_until_closed(client))
    assert response.status_code == 431
