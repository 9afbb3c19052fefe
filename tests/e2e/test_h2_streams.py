"""Generate over our own HTTP/2 client (transport/h2_channel.py): the wire rules it keeps, and the same
behaviour as grpcio against real simulated workers (tests/e2e/test_engine_client.py runs on both too)."""

from __future__ import annotations

import random
import signal

import pytest
import trio
import trio.testing

from orchestrator.engine import EngineError, Finished, Tokens, WorkerUnavailable
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.testkit.plugin import wait_for_load
from orchestrator.transport import grpc_framing, http2
from orchestrator.transport.h2_channel import H2Stream, WorkerConnection
from sim_helpers import read_to_finished


def request(rid, max_tokens=8, ids=(5, 6, 7, 8, 9), **stopping):
    return g.GenerateRequest(request_id=rid, model="tiny-chat", token_ids=g.TokenIds(ids=list(ids)),
                             stopping=g.StoppingOptions(max_tokens=max_tokens, **stopping))


def framed(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


class _Channel:
    worker, authority = "w", "127.0.0.1:1"


def data_frame(connection: WorkerConnection, stream: H2Stream, data: bytes) -> None:
    """The connection acting on a read of one DATA frame's payload for `stream`, as transport/http2.py reports it
    (then its messages go to the reader)."""
    connection._act([(http2.DATA_RECEIVED, stream, data)])


def bare_connection() -> WorkerConnection:
    # no socket, and a stand-in for the channel: what the frame parsing reads of them
    return WorkerConnection(transport=None, channel=_Channel(), scheme="http")  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(20))
def test_messages_are_cut_from_data_frames_whatever_their_split(seed):
    rng = random.Random(seed)
    messages = [g.GenerateResponse(request_id=f"r{i}", token=g.TokenOutput(tokens=[g.TokenInfo(token_id=i)]))
                for i in range(rng.randint(1, 6))]
    wire = b"".join(framed(m.SerializeToString()) for m in messages)
    cuts = sorted(rng.sample(range(1, len(wire)), k=min(len(wire) - 1, rng.randint(0, 8))))
    connection, stream = bare_connection(), H2Stream("Generate", g.GenerateResponse.FromString, b"")
    for start, end in zip([0, *cuts], [*cuts, len(wire)]):
        data_frame(connection, stream, wire[start:end])
    assert list(stream._items) == messages and not stream.response.pending and not stream.closed


async def test_a_message_that_decodes_to_nothing_is_dropped_and_the_stream_reads_only_events():
    """A PromptOutput (prompt logprobs) has no event for the orchestrator: events.decode gives None."""
    from orchestrator.engine import events as ev
    from orchestrator.engine.client import GenerateStream

    connection = bare_connection()
    stream = H2Stream("Generate", lambda payload: ev.decode_bytes(payload, worker="w"), b"")
    messages = [g.GenerateResponse(prompt=g.PromptOutput(tokens=[g.TokenInfo(token_id=1)])),
                g.GenerateResponse(token=g.TokenOutput(tokens=[g.TokenInfo(token_id=7)])),
                g.GenerateResponse(prompt=g.PromptOutput()),
                g.GenerateResponse(finished=g.GenerationFinished(reason=g.FINISH_REASON_LENGTH))]
    data_frame(connection, stream, framed(messages[0].SerializeToString()))
    assert not stream._items
    for message in messages[1:]:
        data_frame(connection, stream, framed(message.SerializeToString()))
    batch = await GenerateStream(stream).next_batch()
    assert batch == [ev.Tokens((7,)), ev.Finished(reason=g.FINISH_REASON_LENGTH)]


async def test_the_messages_of_one_read_reach_a_waiting_reader_together_through_its_direct_handler():
    """transport/inbox.py: while the reader waits, what one read brought for its stream is handed to its direct
    handler in the connection's task; the reader wakes only for what the handler leaves it."""
    connection, stream = bare_connection(), H2Stream("Generate", g.GenerateResponse.FromString, b"")
    one, two, three = (g.GenerateResponse(token=g.TokenOutput(tokens=[g.TokenInfo(token_id=i)])) for i in (1, 2, 3))
    handed: list[list] = []
    leave: list = []  # what the handler leaves for the reader

    def handler(batch):
        handed.append(batch)
        return leave

    stream.direct = handler
    woken: list[list] = []
    async with trio.open_nursery() as nursery:
        async def reader():
            while batch := await stream.get_batch():
                woken.append(batch)

        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        data_frame(connection, stream, framed(one.SerializeToString()) + framed(two.SerializeToString()))
        await trio.testing.wait_all_tasks_blocked()
        assert handed == [[one, two]] and woken == []  # dealt with in place: the reader never woke
        leave.append("what the reader must see")
        data_frame(connection, stream, framed(three.SerializeToString()))
        await trio.testing.wait_all_tasks_blocked()
        assert handed == [[one, two], [three]] and woken == [["what the reader must see"]]
        stream._close(None)
    stream.direct = None  # without a handler, a read's messages wake the reader once, together
    plain = H2Stream("Generate", g.GenerateResponse.FromString, b"")
    data_frame(connection, plain, framed(one.SerializeToString()) + framed(two.SerializeToString()))
    assert await plain.get_batch() == [one, two]


async def test_a_direct_handler_that_fails_fails_its_own_call_and_not_the_connection():
    connection = bare_connection()
    broken, healthy = (H2Stream("Generate", g.GenerateResponse.FromString, b"") for _ in range(2))
    message = framed(g.GenerateResponse(token=g.TokenOutput(tokens=[g.TokenInfo(token_id=1)])).SerializeToString())
    bug = RuntimeError("a bug in the handler")
    handed: list = []

    def fails(batch):
        raise bug

    broken.direct, healthy.direct = fails, handed.append
    outcome: dict = {}
    async with trio.open_nursery() as nursery:
        async def read(name, stream):
            try:
                outcome[name] = await stream.get_batch()
            except RuntimeError as exc:
                outcome[name] = exc

        nursery.start_soon(read, "broken", broken)
        nursery.start_soon(read, "healthy", healthy)
        await trio.testing.wait_all_tasks_blocked()
        connection._act([(http2.DATA_RECEIVED, broken, message), (http2.DATA_RECEIVED, healthy, message)])
        await trio.testing.wait_all_tasks_blocked()
        assert outcome == {"broken": bug} and broken.closed and len(handed) == 1 and not healthy.closed
        healthy._close(None)
    assert outcome["healthy"] == []


def test_a_compressed_or_undecodable_message_fails_the_call_with_a_clear_error():
    connection = bare_connection()
    compressed = H2Stream("Generate", g.GenerateResponse.FromString, b"")
    data_frame(connection, compressed, b"\x01" + (3).to_bytes(4, "big") + b"abc")
    assert compressed.closed and "compressed" in str(compressed._error)
    garbage = H2Stream("Generate", g.GenerateResponse.FromString, b"")
    data_frame(connection, garbage, framed(b"\xff\xff\xff"))
    assert garbage.closed and "does not decode" in str(garbage._error)


def test_a_message_is_refused_from_its_prefix_above_64_mib_and_not_at_it():
    connection = bare_connection()
    at_limit, above = (H2Stream("Generate", g.GenerateResponse.FromString, b"") for _ in range(2))
    data_frame(connection, at_limit, b"\x00" + grpc_framing.MAX_MESSAGE_BYTES.to_bytes(4, "big") + b"part of it")
    data_frame(connection, above, b"\x00" + (grpc_framing.MAX_MESSAGE_BYTES + 1).to_bytes(4, "big") + b"part of it")
    assert not at_limit.closed and len(at_limit.response.pending) == 15  # waiting for the rest
    assert isinstance(above._error, EngineError) and above._error.grpc_status is not None
    assert above.closed and above._error.grpc_status.name == "RESOURCE_EXHAUSTED" and not above.response.pending


def test_only_the_ack_of_our_own_ping_answers_it():
    connection = bare_connection()
    connection._ping_payload = (7).to_bytes(8, "big")
    connection._on_ping_ack((6).to_bytes(8, "big"))  # an ACK of some other PING (or a stray one)
    assert not connection._ping_answered.is_set()
    connection._on_ping_ack((7).to_bytes(8, "big"))
    assert connection._ping_answered.is_set()


@pytest.mark.parametrize("headers, status, kind", [
    ([(b":status", b"200"), (b"grpc-status", b"3"), (b"grpc-message", b"bad%20request")], "INVALID_ARGUMENT",
     EngineError),
    ([(b":status", b"503")], "UNAVAILABLE", WorkerUnavailable),
    ([(b":status", b"200"), (b"grpc-status", b"14")], "UNAVAILABLE", WorkerUnavailable),
])
def test_grpc_status_and_http_status_map_like_grpcio(headers, status, kind):
    connection, stream = bare_connection(), H2Stream("Generate", g.GenerateResponse.FromString, b"")
    connection._on_headers(stream, headers)
    connection._on_end(stream)
    assert isinstance(stream._error, kind) and stream._error.grpc_status.name == status
    if status == "INVALID_ARGUMENT":
        assert stream._error.message == "bad request"  # percent-decoded, as gRPC sends it


def test_a_stream_that_ends_without_status_or_inside_a_message_is_an_error():
    connection = bare_connection()
    no_status = H2Stream("Generate", g.GenerateResponse.FromString, b"")
    connection._on_end(no_status)
    assert "without a grpc-status" in str(no_status._error)
    cut = H2Stream("Generate", g.GenerateResponse.FromString, b"")
    connection._on_headers(cut, [(b"grpc-status", b"0")])
    data_frame(connection, cut, framed(b"\x08\x01")[:4])
    connection._on_end(cut)
    assert "inside a message" in str(cut._error)


async def test_many_streams_share_one_connection_and_match_grpcio(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", "--time-scale", "0")

    async def tokens_of(client, rid):
        async with client.generate(request(rid, max_tokens=24, ignore_eos=True)) as stream:
            events = [e async for e in stream]
        assert isinstance(events[-1], Finished)
        return [t for e in events if isinstance(e, Tokens) for t in e.token_ids]

    async with engine_client(worker.address, stream_transport="h2") as h2_client, \
            engine_client(worker.address) as grpc_client:
        results: dict[str, list[int]] = {}

        async def one(i):
            results[f"s{i}"] = await tokens_of(h2_client, f"same-{i % 4}-{i}")

        async with trio.open_nursery() as nursery:
            for i in range(64):
                nursery.start_soon(one, i)
        assert len(results) == 64 and all(len(t) == 24 for t in results.values())
        assert await tokens_of(h2_client, "x-seeded") == await tokens_of(grpc_client, "x-seeded")
        assert h2_client._channel._connection is not None and len(h2_client._channel._connection.streams) == 0


async def test_a_request_larger_than_the_flow_control_window_is_sent_whole(sim_workers, engine_client):
    """300,000 prompt token ids (about 1 MB) cross the peer's 64 KB initial window in WINDOW_UPDATE steps;
    the worker answers about the prompt (its context window), not about a broken transport."""
    worker = sim_workers.start("aggregated", "--time-scale", "0")
    async with engine_client(worker.address, stream_transport="h2") as client, \
            engine_client(worker.address) as reference:
        outcomes: list[object] = []  # the events' names, or the error's code and status
        for c in (client, reference):
            async with c.generate(request("big", ids=[7] * 300_000, max_tokens=2)) as stream:
                try:
                    outcomes.append([type(e).__name__ for e in [e async for e in stream]])
                except EngineError as exc:
                    outcomes.append((exc.code, exc.grpc_status))
        assert outcomes[0] == outcomes[1]


async def test_leaving_a_stream_early_cancels_it_on_the_worker(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", "--time-scale", "1")
    async with engine_client(worker.address, stream_transport="h2") as client:
        with trio.move_on_after(0.3):
            async with client.generate(request("left", max_tokens=5000)) as stream:
                async for _ in stream:
                    pass
        load = await wait_for_load(client, lambda load: load.running_requests == 0)
        assert load.running_requests == 0
        async with client.generate(request("after", max_tokens=3)) as stream:  # the connection still serves
            assert isinstance([e async for e in stream][-1], Finished)


async def test_a_worker_that_dies_mid_stream_is_a_retryable_unavailable_error(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", "--time-scale", "1")
    async with engine_client(worker.address, stream_transport="h2") as client:
        with pytest.raises(WorkerUnavailable) as info:
            async with client.generate(request("doomed", max_tokens=5000)) as stream:
                await stream.__anext__()
                worker.process.process.send_signal(signal.SIGKILL)  # our own child
                async for _ in stream:
                    pass
        assert info.value.retryable and info.value.rpc == "Generate" and worker.address.removeprefix("grpc://") \
            in str(info.value)
        with pytest.raises(WorkerUnavailable):  # a new connection is tried, and refused
            async with client.generate(request("next")) as stream:
                [e async for e in stream]


async def _freeze_mid_stream(client, worker, *, before_freeze=None, while_frozen=None) -> WorkerUnavailable:
    """Read a long stream, SIGSTOP its worker (our own child) after the first event and read on: the
    WorkerUnavailable the stream fails with. The hooks run just before and just after the freeze."""
    try:
        with trio.fail_after(10), pytest.raises(WorkerUnavailable) as info:
            async with client.generate(request("frozen", max_tokens=5000)) as stream:
                await stream.__anext__()
                if before_freeze is not None:
                    await before_freeze()
                worker.process.process.send_signal(signal.SIGSTOP)
                if while_frozen is not None:
                    await while_frozen()
                async for _ in stream:
                    pass
    finally:
        worker.process.process.send_signal(signal.SIGCONT)
    return info.value


async def test_a_worker_that_stops_answering_fails_its_streams_after_the_keepalive_timeout(
        sim_workers, engine_client):
    """No FIN, no RST (a frozen host): the PING goes unanswered and the stream fails as unavailable."""
    worker = sim_workers.start("aggregated", "--time-scale", "1")
    async with engine_client(worker.address, stream_transport="h2", keepalive_interval_s=0.2,
                             keepalive_timeout_s=0.5) as client:
        error = await _freeze_mid_stream(client, worker)
    assert "keepalive ping" in str(error.__cause__) and error.retryable


async def test_fail_if_silent_fails_the_calls_of_a_frozen_worker_and_spares_a_streaming_one(sim_workers,
                                                                                              engine_client):
    """What the pool does when a health check goes unanswered: fail the calls at once, but only on a
    connection on which nothing arrived for as long (a worker still streaming tokens is only slow)."""
    worker = sim_workers.start("aggregated", "--time-scale", "1")
    failed = []

    async def check(wait: float) -> None:
        await trio.sleep(wait)
        failed.append(client.fail_calls_if_silent(0.5, "no health answer"))

    async with engine_client(worker.address, stream_transport="h2") as client:
        error = await _freeze_mid_stream(client, worker, before_freeze=lambda: check(0.3),
                                         while_frozen=lambda: check(0.7))
    assert failed == [0, 1]  # none while tokens kept coming; the one call once nothing had come for 0.5 s
    assert error.retryable and "no health answer" in str(error)


async def test_a_worker_that_shuts_down_gracefully_ends_the_stream_cleanly_or_retryably(sim_workers, engine_client):
    """SIGTERM: the worker drains (GOAWAY, then closes); the stream either finishes or fails retryably,
    never hangs; a new stream afterwards goes to a new connection, which is refused."""
    worker = sim_workers.start("aggregated", "--time-scale", "1", "--drain-grace", "1")
    async with engine_client(worker.address, stream_transport="h2") as client:
        with trio.fail_after(15):
            async with client.generate(request("draining", max_tokens=5000)) as stream:
                await stream.__anext__()
                worker.process.process.send_signal(signal.SIGTERM)  # our own child
                try:
                    events = [e async for e in stream]
                    assert isinstance(events[-1], Finished)
                except EngineError as exc:
                    assert exc.retryable or exc.code == 10, exc  # unavailable, or cancelled by the drain
            worker.process.process.wait(10)
            with pytest.raises(WorkerUnavailable):
                async with client.generate(request("after")) as stream:
                    [e async for e in stream]


async def test_a_stream_left_to_end_by_itself_is_reset_if_its_status_never_comes(
        sim_workers, engine_client, monkeypatch):
    """After Finished the caller leaves without a reset (the status is due at once); a worker whose status
    then never comes (here 30 s late) cannot keep the stream open: it is reset a grace period later."""
    from orchestrator.transport import calls

    monkeypatch.setattr(calls, "STATUS_GRACE_S", 0.2)
    worker = sim_workers.start("aggregated", "--time-scale", "0", "--status-delay", "30")
    async with engine_client(worker.address, stream_transport="h2") as client:
        stream, events = await read_to_finished(client, request("late-status", max_tokens=3))
        assert isinstance(events[-1], Finished) and stream.ended
        connection = client._channel._connection
        assert len(connection.streams) == 1  # left open, waiting for its trailers
        with trio.fail_after(5):
            while connection.streams:
                await trio.sleep(0.05)
        load = await wait_for_load(client, lambda load: load.attributes.fields["cancelled_after_terminal"]
                                   .number_value == 1)
        assert load.running_requests == 0
        _, events = await read_to_finished(client, request("after", max_tokens=3))  # the connection still serves
        assert isinstance(events[-1], Finished)
