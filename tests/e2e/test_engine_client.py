"""The trio engine client against real simulated-worker processes over real gRPC."""

import logging
from contextlib import contextmanager

import grpc
import pytest
import trio

from orchestrator.engine import (
    EngineError,
    ErrorCode,
    Failed,
    Finished,
    IncompatibleWorker,
    Tokens,
    WorkerCapabilities,
    WorkerNotReady,
    WorkerUnavailable,
)
from orchestrator.engine.errors import StreamStalled
from orchestrator.engine.numbering import Health
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.openengine.v1 import lifecycle_pb2
from orchestrator.testkit.plugin import free_port, wait_for_load
from sim_helpers import read_to_finished


@pytest.fixture(params=["grpcio", "h2"])
def engine_client(request, engine_client):
    """Every test here runs on both Generate transports: grpcio, and our HTTP/2 streams on trio."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def open_client(address, **kwargs):
        async with engine_client(address, stream_transport=request.param, **kwargs) as client:
            yield client

    return open_client


def request(rid, max_tokens=8, **extra):
    req = g.GenerateRequest(request_id=rid, model="tiny-chat", token_ids=g.TokenIds(ids=[5, 6, 7, 8, 9]),
                            stopping=g.StoppingOptions(max_tokens=max_tokens))
    for key, value in extra.items():
        req.extra[key] = value
    return req


def attr(load, name):
    return load.attributes.fields[name].number_value


@contextmanager
def control_server(servicer, *, threads: int = 4):
    """A bare gRPC server with only `servicer` as its Control service; yields its port."""
    from concurrent.futures import ThreadPoolExecutor

    from orchestrator.openengine.v1 import openengine_pb2_grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=threads))
    openengine_pb2_grpc.add_ControlServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(grace=None)


async def test_generate_streams_typed_events_and_usage(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", "--time-scale", "0")
    async with engine_client(worker.address) as client:
        async with client.generate(request("r1", max_tokens=6)) as stream:
            events = [e async for e in stream]
    tokens = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
    assert len(tokens) == 6
    assert isinstance(events[-1], Finished) and events[-1].reason_name == "length"
    assert events[-1].usage is not None
    assert events[-1].usage.prompt_tokens == 5 and events[-1].usage.completion_tokens == 6


async def test_cancelling_the_scope_cancels_the_rpc_and_the_worker_sees_it(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", "--time-scale", "1")  # real GPU-time steps: ~6 ms each
    async with engine_client(worker.address) as client:
        with trio.CancelScope() as scope:
            async with client.generate(request("long", max_tokens=2000)) as stream:
                seen = 0
                async for event in stream:
                    seen += isinstance(event, Tokens)
                    if seen == 3:
                        scope.cancel()
        assert scope.cancelled_caught
        load = await wait_for_load(client, lambda info: attr(info, "cancelled_by_client") == 1)
        assert load.running_requests == 0 and load.used_kv_blocks == 0


async def test_leaving_after_the_terminal_event_lets_the_call_end_without_a_cancel(sim_workers, engine_client):
    """The worker sends its status 0.3 s after Finished (its loop resumes late); the caller leaves the
    block as soon as Finished is read. A cancel would land inside those 0.3 s and be counted by the worker;
    leaving one event earlier is a cancel, and is counted (the control)."""
    worker = sim_workers.start("aggregated", "--time-scale", "1", "--status-delay", "0.3")
    async with engine_client(worker.address) as client:
        stream, events = await read_to_finished(client, request("done", max_tokens=3))
        assert isinstance(events[-1], Finished) and stream.ended
        async with client.generate(request("left", max_tokens=2000)) as stream:
            async for _event in stream:
                break
        assert not stream.ended
        await trio.sleep(0.5)  # past both statuses
        # The worker counts the control's cancel when it sees it: on a busy machine that can be after the sleep.
        load = await wait_for_load(client, lambda info: attr(info, "cancelled_by_client") == 1, timeout=5)
        assert attr(load, "cancelled_after_terminal") == 0
        assert attr(load, "cancelled_by_client") == 1 and load.running_requests == 0


async def test_a_call_left_after_its_terminal_event_is_cancelled_if_its_status_never_comes(
        sim_workers, engine_client, monkeypatch):
    """The status is 30 s late: the call is cancelled after the grace (grpcio: a timer; h2: a sweep of such
    streams every grace), so a worker that never ends its calls cannot pile them up."""
    from orchestrator.transport import calls

    monkeypatch.setattr(calls, "STATUS_GRACE_S", 0.3)
    worker = sim_workers.start("aggregated", "--time-scale", "0", "--status-delay", "30")
    async with engine_client(worker.address) as client:
        stream, events = await read_to_finished(client, request("silent", max_tokens=3))
        assert isinstance(events[-1], Finished) and stream.ended
        load = await wait_for_load(client, lambda info: attr(info, "cancelled_after_terminal") == 1, timeout=5)
        assert attr(load, "cancelled_by_client") == 0 and load.running_requests == 0


async def test_abort_by_request_id_finishes_the_stream_as_cancelled(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", "--time-scale", "1")
    async with engine_client(worker.address) as client:
        async with client.generate(request("victim", max_tokens=2000)) as stream:
            first = await stream.__anext__()
            assert isinstance(first, Tokens)
            response = await client.abort(request_id="victim")
            assert response.status == lifecycle_pb2.ABORT_STATUS_ABORTED
            rest = [e async for e in stream]
        assert isinstance(rest[-1], Finished) and rest[-1].reason == g.FinishReason.FINISH_REASON_CANCELLED
        again = await client.abort(request_id="victim")
        assert again.status == lifecycle_pb2.ABORT_STATUS_ALREADY_FINISHED
        assert (await client.load()).running_requests == 0


async def test_engine_errors_are_typed_events_with_code_and_retryable_flag(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", "--time-scale", "0", "--persona", "strict")
    async with engine_client(worker.address) as client:
        # A context-only leg on an aggregated worker is a protocol mistake the strict worker refuses in-stream.
        req = request("ctx", max_tokens=1, request_type="context_only")
        async with client.generate(req) as stream:
            events = [e async for e in stream]
    assert len(events) == 1 and isinstance(events[0], Failed)
    error = events[0].error
    assert error.code == ErrorCode.ERROR_CODE_ROLE_MISMATCH and not error.retryable
    assert worker.target in str(error) and "Generate" in str(error) and "ROLE_MISMATCH" in str(error)


async def test_refusals_as_grpc_statuses_are_typed_errors_with_code_status_and_worker(sim_workers, engine_client):
    """TensorRT-LLM refuses a request before accepting it with context.abort(INVALID_ARGUMENT, ...)."""
    worker = sim_workers.start("aggregated", "--time-scale", "0")
    async with engine_client(worker.address) as client:
        req = request("gen-only", max_tokens=1, request_type="generation_only")
        with pytest.raises(EngineError) as info:
            async with client.generate(req) as stream:
                [e async for e in stream]
    error = info.value
    assert error.code == ErrorCode.ERROR_CODE_INVALID_ARGUMENT and not error.retryable
    assert error.grpc_status == grpc.StatusCode.INVALID_ARGUMENT and "kv.session" in error.message
    assert worker.target in str(error) and "Generate" in str(error)


async def test_injected_retryable_error_keeps_its_flag(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", "--time-scale", "0", "--error-rate", "1",
                               "--error-code", "ERROR_CODE_KV_TRANSFER_FAILED", "--error-retryable")
    async with engine_client(worker.address) as client:
        async with client.generate(request("x")) as stream:
            (event,) = [e async for e in stream]
    assert event.error.code == ErrorCode.ERROR_CODE_KV_TRANSFER_FAILED and event.error.retryable


async def test_an_in_stream_overloaded_is_the_stall_watchdog_and_not_retryable(sim_workers, engine_client):
    """tests/e2e/test_trtllm_conformance.py UPSTREAM stall-watchdog: TensorRT-LLM sends ERROR_CODE_OVERLOADED with
    retryable=True only when its response stream was not read for 30 s; another worker would not help."""
    worker = sim_workers.start("aggregated", "--time-scale", "0", "--error-rate", "1",
                               "--error-code", "ERROR_CODE_OVERLOADED", "--error-retryable")
    async with engine_client(worker.address) as client:
        async with client.generate(request("x")) as stream:
            (event,) = [e async for e in stream]
    assert isinstance(event.error, StreamStalled) and not event.error.retryable
    assert event.error.code == ErrorCode.ERROR_CODE_OVERLOADED


async def test_unreachable_worker_is_a_typed_error_naming_the_address(engine_client):
    port = free_port()
    async with engine_client(f"grpc://127.0.0.1:{port}") as client:
        with pytest.raises(WorkerUnavailable) as info:
            await client.health(timeout=2)
        with pytest.raises(WorkerUnavailable):
            async with client.generate(request("nowhere")) as stream:
                [e async for e in stream]
    assert f"127.0.0.1:{port}" in str(info.value) and info.value.rpc == "Health"
    assert info.value.retryable


async def test_connect_until_ready_waits_for_a_late_server_and_logs_the_cause_from_attempt_one(
        sim_workers, engine_client, caplog):
    caplog.set_level(logging.WARNING, logger="orchestrator.engine")
    port = free_port()
    sim_workers.spawn("aggregated", "--port", str(port), "--slow-start", "1.5", "--warmup", "0.5",
                      "--time-scale", "0")
    async with engine_client(f"grpc://127.0.0.1:{port}") as client:
        caps = await client.wait_until_ready(deadline=30, attempt_timeout=1, retry_interval=0.1)
    assert caps.role == "unspecified" and caps.serves_role("aggregated")  # revision-1 TensorRT-LLM
    retries = [r.getMessage() for r in caplog.records if "waiting for worker" in r.getMessage()]
    assert retries and "(attempt 1)" in retries[0]
    assert "Connection refused" in retries[0] or "failed to connect" in retries[0].lower()
    assert f"127.0.0.1:{port}" in retries[0]
    # rate-limited: the attempts over ~2 s gave at most a couple of lines, and STARTING was seen
    assert len(retries) <= 3


async def test_a_worker_that_stays_not_ready_is_a_clear_startup_failure(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", "--not-ready")
    async with engine_client(worker.address) as client:
        with pytest.raises(WorkerNotReady, match="HEALTH_STATE_NOT_READY") as info:
            await client.wait_until_ready(deadline=1.0, retry_interval=0.2)
    assert "not ready after 1 s" in str(info.value)


@pytest.mark.parametrize("flags, words", [
    (("--report-schema-revision", "0"), ["schema_revision 0", "revision 3"]),
    (("--report-schema-revision", "5", "--minimum-client-revision", "4"), ["requires client revision >= 4",
                                                                          "revision 3"]),
])
async def test_revision_guard_refuses_incompatible_workers(sim_workers, engine_client, flags, words):
    worker = sim_workers.start("aggregated", *flags)
    async with engine_client(worker.address) as client:
        with pytest.raises(IncompatibleWorker) as info:
            await client.wait_until_ready(deadline=5)
    for word in words:
        assert word in str(info.value)


async def test_a_newer_worker_that_still_accepts_our_revision_is_compatible(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", "--report-schema-revision", "7", "--minimum-client-revision", "3")
    async with engine_client(worker.address) as client:
        caps = await client.wait_until_ready(deadline=5)
    assert caps.schema_revision == 7


async def test_capabilities_are_discovered_once_for_concurrent_callers(sim_workers, engine_client):
    worker = sim_workers.start("prefill", "--schema-revision", "3", "--image-paths", "aggregate")
    async with engine_client(worker.address) as client:
        results: list[WorkerCapabilities] = []
        async with trio.open_nursery() as nursery:
            for _ in range(16):
                nursery.start_soon(lambda: _append(results, client.capabilities()))
        assert client.discovery_attempts == 1
        caps = results[0]
        assert all(r is caps for r in results)
        assert caps.role == "prefill" and caps.supports_abort_cleanup and caps.schema_revision == 3
        assert caps.image_support(disaggregated=False)[0] and not caps.image_support(disaggregated=True)[0]
        assert caps.max_context_length == 8192 and caps.model_id == "tiny-chat"
        assert caps.handoff_profile == "tensorrt_llm.disaggregated_params.v1" and caps.tokenizer_source


async def _append(results, awaitable):
    results.append(await awaitable)


async def test_closed_client_refuses_calls(sim_workers, engine_client):
    from orchestrator.engine import ClientClosed

    worker = sim_workers.start("aggregated", "--time-scale", "0")
    async with engine_client(worker.address) as client:
        pass
    with pytest.raises(ClientClosed):
        await client.health()


async def test_health_and_load_share_one_round_trip_and_report_the_load(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", "--time-scale", "1")
    async with engine_client(worker.address) as client:
        state, load = await client.health_and_load(timeout=5)
        assert state is Health.READY and load.running_requests == 0
        async with client.generate(request("busy", max_tokens=2000)) as stream:
            await stream.__anext__()
            state, load = await client.health_and_load(timeout=5)
            assert state is Health.READY and load.running_requests == 1


async def test_health_and_load_returns_a_failed_get_load_and_raises_a_failed_health(engine_client):
    """A worker without GetLoad (UNIMPLEMENTED) is still healthy; an unreachable one is a Health error."""
    from orchestrator.openengine.v1 import openengine_pb2_grpc

    class HealthOnly(openengine_pb2_grpc.ControlServicer):
        def Health(self, request, context):
            return lifecycle_pb2.HealthResponse(state=lifecycle_pb2.HEALTH_STATE_READY)

    with control_server(HealthOnly(), threads=2) as port:
        async with engine_client(f"grpc://127.0.0.1:{port}") as client:
            state, load = await client.health_and_load(timeout=5)
        assert state is Health.READY
        assert isinstance(load, EngineError) and load.rpc == "GetLoad" and f"127.0.0.1:{port}" in str(load)
    async with engine_client(f"grpc://127.0.0.1:{free_port()}") as client:
        with pytest.raises(WorkerUnavailable) as info:
            await client.health_and_load(timeout=2)
    assert info.value.rpc == "Health"


async def test_a_unary_call_carries_its_deadline_to_the_server_and_fails_after_it(engine_client):
    """grpc-timeout reaches the servicer (context.time_remaining), and a worker slower than the timeout is a
    retryable DEADLINE_EXCEEDED on either transport."""
    import threading

    from orchestrator.openengine.v1 import openengine_pb2_grpc, server_pb2

    seen: list = []
    release = threading.Event()

    class Slow(openengine_pb2_grpc.ControlServicer):
        def Health(self, request, context):
            seen.append(context.time_remaining())
            return lifecycle_pb2.HealthResponse(state=lifecycle_pb2.HEALTH_STATE_READY)

        def GetLoad(self, request, context):
            release.wait(5)
            return server_pb2.LoadInfo()

    with control_server(Slow()) as port:
        try:
            async with engine_client(f"grpc://127.0.0.1:{port}") as client:
                assert await client.health(timeout=3) is Health.READY
                # grpcio sends its timeout rounded up to the next unit and the server measures from arrival:
                # 3.008 s was seen (under load), so 0.1 s of slack above the 3 s asked for
                assert seen[0] is not None and 0 < seen[0] <= 3.1
                with trio.fail_after(3), pytest.raises(WorkerUnavailable) as info:
                    await client.load(timeout=0.3)
                assert info.value.grpc_status == grpc.StatusCode.DEADLINE_EXCEEDED and info.value.retryable
                release.set()
                assert await client.health(timeout=3) is Health.READY  # still serves
        finally:
            release.set()  # before the server stops: its GetLoad thread is waiting on it


async def test_with_h2_streams_no_grpcio_channel_is_opened(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", "--time-scale", "0")
    async with engine_client(worker.address) as client:
        assert await client.health() is Health.READY
        assert (await client.capabilities()).model_id
        from orchestrator.transport.h2_channel import H2Channel

        assert (getattr(client._channel, "grpc_channel", None) is None) == isinstance(client._channel, H2Channel)
