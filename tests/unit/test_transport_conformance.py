"""Conformance of the worker transport (transport/h2_channel.py over transport/http2.py) to RFC 9113 and gRPC over
HTTP/2, call by call: what a broken worker (or a proxy in front of one) can send, against h2's server side
(tests/h2_scripted_server.py), and what a stock grpc.aio server with production-like options does
(tests/grpc_servers.py: its default ping policy, max_concurrent_streams, max_connection_age, compression),
the gRPC-level cases on both stream_transport options. The pure framing's frame-level rules are in
tests/unit/test_http2.py."""

from __future__ import annotations

import asyncio
import gzip
import logging

import grpc
import pytest
import trio
import trio.testing

from grpc_servers import grpc_aio_server
from h2_scripted_server import GRPC_HEADERS, SettingCodes, grpc_message, scripted_server
from orchestrator.engine import EngineError, Finished, Tokens, WorkerUnavailable
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.openengine.v1 import openengine_pb2_grpc
from orchestrator.transport import grpc_framing, http2
from orchestrator.transport import h2_channel as h2_streams

HANG_GUARD_S = 10  # what a broken transport would wait forever for fails the test instead


def token(i: int, text: str = "") -> bytes:
    return g.GenerateResponse(token=g.TokenOutput(tokens=[g.TokenInfo(token_id=i)], text=text)).SerializeToString()


FINISHED = g.GenerateResponse(finished=g.GenerationFinished(reason=g.FINISH_REASON_LENGTH)).SerializeToString()


def request(rid: str) -> g.GenerateRequest:
    return g.GenerateRequest(request_id=rid, model="tiny-chat", token_ids=g.TokenIds(ids=[1, 2, 3]))


async def events_of(client, rid: str) -> list:
    with trio.fail_after(HANG_GUARD_S):
        async with client.generate(request(rid)) as stream:
            return [event async for event in stream]


async def outcome_of(client, rid: str):
    """The call's events, or the EngineError it ended with."""
    try:
        return await events_of(client, rid)
    except EngineError as exc:
        return exc


def token_ids(events) -> list[int]:
    return [t for e in events if isinstance(e, Tokens) for t in e.token_ids]


async def answer_normally(call) -> None:
    await call.respond()
    await call.message(token(7))
    await call.message(FINISHED)
    await call.trailers(0)


# ---- 1. keepalive that respects the server's ping policy ---------------------------------------------------

class SilentAfterTwoTokens(openengine_pb2_grpc.InferenceServicer):
    """A prefill queued behind long prompts: two tokens, then nothing for `silence` seconds."""

    def __init__(self, silence: float):
        self.silence = silence

    async def Generate(self, request, context):
        yield g.GenerateResponse.FromString(token(0))
        yield g.GenerateResponse.FromString(token(1))
        await asyncio.sleep(self.silence)
        yield g.GenerateResponse.FromString(FINISHED)


@pytest.mark.parametrize("transport, interval", [("h2", 0.2), ("grpcio", 1.0)])
async def test_a_stream_silent_for_five_keepalive_intervals_survives_the_default_ping_policy(
        engine_client, transport, interval):
    """grpc-core's default policy (one PING per 5 min without data, GOAWAY too_many_pings after 2 strikes) and
    our 30 s interval, both scaled down alike (grpcio's client pings at most once a second: its larger scale)."""
    options = [("grpc.http2.min_ping_interval_without_data_ms", int(interval * 10 * 1000))]
    with grpc_aio_server(SilentAfterTwoTokens(5 * interval), options=options) as server:
        async with engine_client(server.address, stream_transport=transport, keepalive_interval_s=interval,
                                 keepalive_timeout_s=5.0) as client:
            events = await events_of(client, "silent")
            if transport == "h2":  # the keepalive did run: it pinged the silent connection
                assert client._channel._connection.pings_sent >= 1
    assert token_ids(events) == [0, 1] and isinstance(events[-1], Finished)


async def test_keepalive_pings_only_a_connection_that_received_nothing_for_the_interval(engine_client):
    interval = 0.3
    pings_while_busy: list[int] = []

    async def answer(call):
        await call.respond()
        for i in range(30):  # a token every tenth of the interval, for three intervals
            await call.message(token(i))
            await trio.sleep(interval / 10)
        pings_while_busy.append(len(call.connection.pings))
        with trio.fail_after(HANG_GUARD_S):
            await call.connection.pinged.wait()  # silent now: a PING comes
        await call.message(FINISHED)
        await call.trailers(0)

    async with scripted_server(answer) as server, engine_client(
            server.address, stream_transport="h2", keepalive_interval_s=interval) as client:
        events = await events_of(client, "busy")
    assert pings_while_busy == [0] and len(token_ids(events)) == 30 and isinstance(events[-1], Finished)


async def test_goaway_too_many_pings_names_itself_doubles_the_interval_and_is_logged_once(engine_client, caplog):
    caplog.set_level(logging.WARNING, logger="orchestrator.engine")

    async def answer(call):  # grpc-core's answer to a client that pings too often
        await call.respond()
        await call.connection.pinged.wait()
        await call.connection.goaway(0xb, b"too_many_pings", last_stream_id=call.stream_id)
        await call.connection.close()

    async with scripted_server(answer) as server, engine_client(
            server.address, stream_transport="h2", keepalive_interval_s=0.1) as client:
        first = await outcome_of(client, "one")
        assert client._channel.keepalive.interval_s == pytest.approx(0.2)
        second = await outcome_of(client, "two")
        assert client._channel.keepalive.interval_s == pytest.approx(0.4)
    for error in (first, second):
        assert isinstance(error, WorkerUnavailable) and error.retryable
        assert "ENHANCE_YOUR_CALM" in str(error) and "too_many_pings" in str(error)
    warnings = [r for r in caplog.records if "too_many_pings" in r.getMessage()]
    assert len(warnings) == 1 and server.address in warnings[0].getMessage()


# ---- 2, 3, 6, 7: a broken response fails its own call, and only it -------------------------------------------

BROKEN_RESPONSES = {
    # name: (what the worker sends on the stream, the gRPC status our call ends with, whether the stream is
    # still open on the worker then (so we must reset it))
    "compressed message, no grpc-encoding": ("compressed", grpc.StatusCode.INTERNAL, True),
    "compressed message, unknown grpc-encoding": ("snappy", grpc.StatusCode.INTERNAL, True),
    "gzip message inflating above 64 MiB": ("gzip bomb", grpc.StatusCode.RESOURCE_EXHAUSTED, True),
    "message above 64 MiB": ("too large", grpc.StatusCode.RESOURCE_EXHAUSTED, True),
    "non-numeric grpc-status": ("bad status", grpc.StatusCode.INTERNAL, False),
    "DATA before HEADERS": ("data first", grpc.StatusCode.INTERNAL, True),
    "trailers without END_STREAM": ("open trailers", grpc.StatusCode.INTERNAL, True),
    "content-type text/html": ("html", grpc.StatusCode.INTERNAL, True),
}


async def send_broken(call, how: str) -> None:
    if how == "compressed":
        await call.respond()
        await call.message(token(1), flag=1)
    elif how == "snappy":
        await call.respond([*GRPC_HEADERS, (b"grpc-encoding", b"snappy")])
        await call.message(token(1), flag=1)
    elif how == "gzip bomb":  # 64 MiB + 1 of zeros is 65 KB of gzip
        await call.respond([*GRPC_HEADERS, (b"grpc-encoding", b"gzip")])
        await call.message(gzip.compress(bytes(64 * 1024 * 1024 + 1), compresslevel=1), flag=1)
    elif how == "too large":  # the prefix promises 64 MiB + 1; a few bytes follow, and then nothing
        await call.respond()
        await call.data(b"\x00" + (64 * 1024 * 1024 + 1).to_bytes(4, "big") + b"12345")
    elif how == "bad status":
        await call.respond()
        await call.message(token(1))
        await call.trailers(b"zero")
        return
    elif how == "data first":
        await call.raw(http2.frame(http2.DATA, 0, call.stream_id, grpc_message(token(1))))
    elif how == "open trailers":
        await call.respond()
        await call.raw(http2.frame(http2.HEADERS, http2.END_HEADERS, call.stream_id,
                                   http2.encode_headers([(b"grpc-status", b"0")])))
    elif how == "html":
        await call.respond([(b":status", b"200"), (b"content-type", b"text/html")])
        await call.message(token(1))
    with trio.fail_after(HANG_GUARD_S):
        await call.reset.wait()  # the stream stays open on our side until the client resets it


@pytest.mark.parametrize("case", list(BROKEN_RESPONSES))
async def test_a_broken_response_fails_its_own_call_resets_its_stream_and_spares_the_others(engine_client, case):
    how, status, still_open = BROKEN_RESPONSES[case]
    broken_sent = trio.Event()

    async def answer(call):
        if b"broken" in call.body:
            await send_broken(call, how)
            broken_sent.set()
        else:  # the neighbour on the same connection: answered once the broken one went wrong
            await call.respond()
            await call.message(token(7))
            await broken_sent.wait()
            await call.message(FINISHED)
            await call.trailers(0)

    async with scripted_server(answer) as server, engine_client(server.address, stream_transport="h2") as client:
        outcomes: dict = {}

        async def run(rid):
            outcomes[rid] = await outcome_of(client, rid)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "neighbour")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(run, "broken")
        after = await outcome_of(client, "after")  # the connection still serves
        connection = client._channel._connection
        assert len(server.connections) == 1 and connection.framing.streams == {} and connection.streams == {}
    error = outcomes["broken"]
    assert isinstance(error, EngineError) and error.grpc_status == status, error
    assert token_ids(outcomes["neighbour"]) == [7] and isinstance(outcomes["neighbour"][-1], Finished)
    assert isinstance(after[-1], Finished)
    broken = next(call for call in server.calls if b"broken" in call.body)
    if still_open:
        assert broken.reset_code in (http2.CANCEL, http2.PROTOCOL_ERROR)


async def test_requests_say_they_accept_only_identity_encoding(engine_client):
    async with scripted_server(answer_normally) as server, engine_client(server.address,
                                                                         stream_transport="h2") as client:
        await events_of(client, "plain")
    assert (b"grpc-accept-encoding", b"identity") in server.calls[0].headers


class Compressing(openengine_pb2_grpc.InferenceServicer):
    """A server with compression on (grpc.aio.server's `compression`: gzip), which grpc-core applies whatever the
    client accepts; a call named `deflate` asks for deflate instead."""

    async def Generate(self, request, context):
        if request.request_id == "deflate":
            context.set_compression(grpc.Compression.Deflate)
        yield g.GenerateResponse.FromString(token(7, text="x" * 4000))
        yield g.GenerateResponse.FromString(FINISHED)


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
async def test_a_server_with_compression_on_is_read_whatever_we_accept(engine_client, transport):
    with grpc_aio_server(Compressing(), compression=grpc.Compression.Gzip) as server:
        async with engine_client(server.address, stream_transport=transport) as client:
            for rid in ("gzip", "deflate"):
                events = await events_of(client, rid)
                assert token_ids(events) == [7] and isinstance(events[-1], Finished), rid  # inflated and parsed


class OneHugeMessage(openengine_pb2_grpc.InferenceServicer):
    async def Generate(self, request, context):
        yield g.GenerateResponse.FromString(token(1, text="x" * (grpc_framing.MAX_MESSAGE_BYTES + 1)))
        yield g.GenerateResponse.FromString(FINISHED)


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
async def test_a_message_above_64_mib_fails_its_call_resource_exhausted(engine_client, transport):
    with grpc_aio_server(OneHugeMessage()) as server:
        async with engine_client(server.address, stream_transport=transport) as client:
            error = await outcome_of(client, "huge")
    assert isinstance(error, EngineError) and error.grpc_status == grpc.StatusCode.RESOURCE_EXHAUSTED, error


# ---- 4. receive flow control: a reader that does not read stops the worker ---------------------------------

async def test_a_reader_that_does_not_read_stops_the_worker_at_its_stream_window(engine_client):
    message, count = token(1, text="x" * 65_000), 128  # 8 MB in all
    finished = trio.Event()
    calls = []

    async def answer(call):
        calls.append(call)
        await call.respond()
        for _ in range(count):
            await call.message(message)
        await call.message(FINISHED)
        await call.trailers(0)
        finished.set()

    async with scripted_server(answer) as server, engine_client(server.address, stream_transport="h2") as client:
        with trio.fail_after(HANG_GUARD_S):
            async with client.generate(request("slow reader")) as stream:
                async with trio.open_nursery() as nursery:  # the worker stops (blocked) or sends everything
                    async def stop_when(event):
                        await event.wait()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(stop_when, finished)
                    while not server.connections:
                        await trio.sleep(0.01)
                    nursery.start_soon(stop_when, server.connections[0].blocked)
                sent_unread = calls[0].sent
                events = [event async for event in stream]
    assert not finished.is_set() or sent_unread < count * len(message)
    assert sent_unread <= h2_streams.STREAM_RECEIVE_WINDOW + len(message) + 5
    assert len(token_ids(events)) == count and isinstance(events[-1], Finished)


class ManyBigMessages(openengine_pb2_grpc.InferenceServicer):
    def __init__(self, count: int):
        self.count, self.yielded = count, 0

    async def Generate(self, request, context):
        for _ in range(self.count):
            yield g.GenerateResponse.FromString(token(1, text="x" * 65_000))
            self.yielded += 1
        yield g.GenerateResponse.FromString(FINISHED)


async def test_a_grpc_server_streaming_to_a_reader_that_does_not_read_is_held_at_the_stream_window(engine_client):
    """grpc.aio's writes do not wait for the client's credit (its transport buffers them): what is held is what
    crosses to us, a stream window's worth, the rest waiting on the worker's side."""
    servicer = ManyBigMessages(128)
    with grpc_aio_server(servicer) as server:
        async with engine_client(server.address, stream_transport="h2") as client:
            with trio.fail_after(HANG_GUARD_S):
                async with client.generate(request("slow reader")) as stream:
                    inbox = stream._call
                    settled, last = 0, -1
                    while settled < 10:  # until everything is written on the worker's side and nothing more comes
                        await trio.sleep(0.05)
                        arrived = len(inbox._items) if servicer.yielded == servicer.count else -1
                        settled, last = (settled + 1, last) if arrived == last else (0, arrived)
                    queued = len(inbox._items) * 65_000 + len(inbox.response.pending)
                    events = [event async for event in stream]
    assert queued <= h2_streams.STREAM_RECEIVE_WINDOW + 65_000
    assert len(token_ids(events)) == servicer.count and isinstance(events[-1], Finished)


# ---- 5. GOAWAY: calls waiting for a slot go to a fresh connection -------------------------------------------

async def test_calls_waiting_for_a_stream_slot_when_goaway_comes_go_to_a_fresh_connection(engine_client):
    release = trio.Event()

    async def answer(call):
        await call.respond()
        await call.message(token(len(call.connection.server.connections)))
        if call.connection is call.connection.server.connections[0]:
            await release.wait()
        await call.message(FINISHED)
        await call.trailers(0)

    async with scripted_server(answer, settings={SettingCodes.MAX_CONCURRENT_STREAMS: 1}) as server, \
            engine_client(server.address, stream_transport="h2") as client:
        outcomes: dict = {}
        async with trio.open_nursery() as nursery:
            async def first():
                with trio.fail_after(HANG_GUARD_S):
                    async with client.generate(request("first")) as stream:
                        events = [await stream.__anext__()]  # the server's SETTINGS came before this
                        started.set()
                        outcomes["first"] = events + [event async for event in stream]

            async def waiting():
                outcomes["waiting"] = await outcome_of(client, "waiting")

            started = trio.Event()
            nursery.start_soon(first)
            await started.wait()
            nursery.start_soon(waiting)
            await trio.testing.wait_all_tasks_blocked()  # it waits for the one slot
            await server.connections[0].goaway(http2.NO_ERROR, b"max_age", last_stream_id=1)
            await trio.testing.wait_all_tasks_blocked()
            release.set()
    assert token_ids(outcomes["first"]) == [1] and isinstance(outcomes["first"][-1], Finished)
    assert not isinstance(outcomes["waiting"], EngineError), outcomes["waiting"]
    assert token_ids(outcomes["waiting"]) == [2] and len(server.connections) == 2


async def test_goaway_keeps_its_code_and_debug_data_in_the_error_of_the_calls_it_refuses(engine_client):
    async def answer(call):
        if call.stream_id == 1:
            await call.respond()
            await call.message(token(1))
            await trio.sleep_forever()
        await call.connection.goaway(0xb, b"load shedding", last_stream_id=1)

    async with scripted_server(answer) as server, engine_client(server.address, stream_transport="h2") as client:
        async with trio.open_nursery() as nursery:
            async def hold():
                async with client.generate(request("kept")) as stream:
                    await stream.__anext__()
                    await trio.sleep_forever()

            nursery.start_soon(hold)
            while not server.calls:
                await trio.sleep(0.01)
            refused = await outcome_of(client, "refused")
            nursery.cancel_scope.cancel()
    assert isinstance(refused, WorkerUnavailable) and refused.retryable
    assert "ENHANCE_YOUR_CALM" in str(refused) and "load shedding" in str(refused)


class HeldOpen(openengine_pb2_grpc.InferenceServicer):
    async def Generate(self, request, context):
        yield g.GenerateResponse.FromString(token(1))
        if request.request_id == "first":
            await asyncio.sleep(1.0)
        yield g.GenerateResponse.FromString(FINISHED)


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
async def test_a_grpc_server_ageing_out_its_connection_does_not_fail_the_calls_queued_on_it(engine_client, transport):
    """grpc.max_connection_age: GOAWAY while the one stream slot (max_concurrent_streams 1) is taken."""
    options = [("grpc.max_concurrent_streams", 1), ("grpc.max_connection_age_ms", 400),
               ("grpc.max_connection_age_grace_ms", 10_000)]
    with grpc_aio_server(HeldOpen(), options=options) as server:
        async with engine_client(server.address, stream_transport=transport) as client:
            outcomes: dict = {}

            async def run(rid):
                outcomes[rid] = await outcome_of(client, rid)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "first")
                await trio.sleep(0.1)
                nursery.start_soon(run, "queued")
    for rid in ("first", "queued"):
        assert not isinstance(outcomes[rid], EngineError), outcomes[rid]
        assert isinstance(outcomes[rid][-1], Finished)


# ---- 9. a burst at connect, before the server's SETTINGS ------------------------------------------------------

async def test_a_burst_of_calls_at_connect_is_not_refused_by_a_server_whose_settings_come_late(engine_client):
    async def answer(call):
        await call.respond()
        await trio.sleep(0.05)
        await call.message(token(1))
        await call.message(FINISHED)
        await call.trailers(0)

    async with scripted_server(answer, settings={SettingCodes.MAX_CONCURRENT_STREAMS: 100}, refuse_above=100,
                               settings_delay=0.2) as server, \
            engine_client(server.address, stream_transport="h2") as client:
        outcomes: list = []

        async def run(i):
            outcomes.append(await outcome_of(client, f"burst-{i}"))

        async with trio.open_nursery() as nursery:
            for i in range(150):
                nursery.start_soon(run, i)
    failed = [o for o in outcomes if isinstance(o, EngineError)]
    assert server.refused == 0 and failed == [] and len(outcomes) == 150
