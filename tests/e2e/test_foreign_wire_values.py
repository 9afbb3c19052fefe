"""A worker's wire values we do not know degrade that worker, never the process; each server's values are read by
its own numbering (orchestrator/engine/numbering.py; upstream facts in tests/e2e/test_trtllm_conformance.py)."""

import trio

from orchestrator.config import RoutingConfig
from orchestrator.discovery.snapshots import Snapshot, WorkerSpec
from orchestrator.engine import EngineError, LoopThread
from orchestrator.engine.capabilities import WorkerCapabilities
from orchestrator.engine.errors import ERROR_CODE_DRAINING, ErrorCode
from orchestrator.engine.events import Failed, Finished, decode_bytes
from orchestrator.engine.numbering import (
    Health,
    Numbering,
    error_code_of,
    health_of,
    numbering_of,
)
from orchestrator.frontend.errors import from_engine_error
from orchestrator.metrics import Metrics
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.openengine.v1 import kv_pb2, model_pb2, server_pb2
from orchestrator.workers.pool import WorkerPool
from orchestrator.workers.states import WorkerState
from pool_helpers import ScriptedRegistry
from sim_helpers import collect, full_request, terminal

SIBLING = ("--schema-revision", "3")


def _revision_1_info() -> server_pb2.ServerInfo:
    # tensorrt_llm/grpc/openengine control.py: schema_revision = bindings' SCHEMA_REVISION (1), and
    # KvConnectorInfo.schema_version (v0.1.0 field 8) = 1
    return server_pb2.ServerInfo(schema_revision=1, schema_release="768a93c7b44e40f28c692ad0b471a8f2",
                                 kv_connector=kv_pb2.KvConnectorInfo(enabled=True, schema_version=1))


def _sibling_info(schema_revision: int) -> server_pb2.ServerInfo:
    # tensorrt_llm/openengine servicer.py _kv_connector_info: supports_drain (its field 8) and schema_version 1
    # (its field 9) always set
    info = server_pb2.ServerInfo(schema_revision=schema_revision, schema_release="a66ff6f" + "0" * 33)
    info.kv_connector.MergeFromString(bytes([1 << 3, 1, 8 << 3, 1, 9 << 3, 1]))
    return server_pb2.ServerInfo.FromString(info.SerializeToString())


def test_the_server_says_which_numbering_it_speaks():
    assert numbering_of(_revision_1_info()) is Numbering.V0_1_0
    assert numbering_of(server_pb2.ServerInfo(schema_revision=1)) is Numbering.V0_1_0  # an engine that says nothing
    assert numbering_of(_sibling_info(3)) is Numbering.DRAIN
    # openengine relabelled those fields revision 1 (8ce850d): the KvConnectorInfo still tells them apart
    assert numbering_of(_sibling_info(1)) is Numbering.DRAIN


def test_health_states_are_read_by_the_workers_own_numbering():
    assert [health_of(Numbering.V0_1_0, n) for n in range(6)] == [
        Health.UNSPECIFIED, Health.STARTING, Health.READY, Health.DEGRADED, Health.NOT_READY, Health.UNKNOWN]
    assert [health_of(Numbering.DRAIN, n) for n in range(7)] == [
        Health.UNSPECIFIED, Health.STARTING, Health.READY, Health.DEGRADED, Health.DRAINING, Health.NOT_READY,
        Health.UNKNOWN]
    assert not any(h.serving for h in (Health.DRAINING, Health.NOT_READY, Health.UNKNOWN, Health.STARTING))


def test_error_codes_are_read_by_the_workers_own_numbering():
    assert error_code_of(Numbering.V0_1_0, 11) == ErrorCode.ERROR_CODE_INTERNAL
    assert error_code_of(Numbering.DRAIN, 12) == ErrorCode.ERROR_CODE_INTERNAL
    assert error_code_of(Numbering.DRAIN, 11) == ERROR_CODE_DRAINING
    assert error_code_of(Numbering.DRAIN, 5) == ErrorCode.ERROR_CODE_OVERLOADED
    assert error_code_of(Numbering.DRAIN, 40) == 40


def test_an_engine_failure_with_a_code_we_do_not_know_is_a_502_naming_it():
    for code in (12, 99):
        error = from_engine_error(EngineError("boom", worker="w", rpc="Generate", code=code))
        assert error.status == 502 and f"ERROR_CODE_{code}" in error.message
    internal = from_engine_error(EngineError("boom", worker="w", rpc="Generate",
                                             code=error_code_of(Numbering.DRAIN, 12)))
    assert internal.status == 502 and "ERROR_CODE_INTERNAL" in internal.message
    draining = from_engine_error(EngineError("stopping", worker="w", rpc="Generate", code=ERROR_CODE_DRAINING))
    assert draining.status == 503 and draining.code == "draining" and draining.retry_after == 1


def test_a_finish_reason_we_do_not_know_is_a_502_naming_it_never_a_stop():
    # revision 1 sends FINISH_REASON_UNSPECIFIED for an engine finish_reason it does not map (formatting.py
    # _finish_event); a later schema may add reasons: neither says how the answer ended
    for reason, named in ((g.FINISH_REASON_UNSPECIFIED, "FINISH_REASON_UNSPECIFIED"), (9, "FinishReason 9")):
        response = g.GenerateResponse(request_id="r", finished=g.GenerationFinished(message="x" * 5000))
        response.finished.reason = reason  # type: ignore[assignment]  # (9: a number the enum does not define)
        event = decode_bytes(response.SerializeToString(), worker="w")
        assert isinstance(event, Failed), event
        assert not event.error.retryable  # the worker said the generation is over: not run again elsewhere
        error = from_engine_error(event.error)
        assert error.status == 502 and named in error.message and len(error.message) < 1000
    for reason in (g.FINISH_REASON_STOP, g.FINISH_REASON_LENGTH, g.FINISH_REASON_CANCELLED):  # the known ones
        finished = decode_bytes(g.GenerateResponse(finished=g.GenerationFinished(reason=reason)).SerializeToString(),
                                worker="w")
        assert isinstance(finished, Finished) and finished.reason == reason


def test_an_engine_role_we_do_not_know_serves_no_role():
    caps = WorkerCapabilities.from_protos(server_pb2.ServerInfo(schema_revision=1, engine_role=7),  # type: ignore
                                          model_pb2.ModelInfo())
    assert not any(caps.serves_role(role) for role in ("aggregated", "prefill", "decode"))
    assert "7" in caps.role


async def _pool_state(address: str, role: str, wanted: WorkerState, seconds: float = 20) -> dict:
    spec = WorkerSpec(address=address, role=role, model="tiny-chat", instance_id="w1")
    async with LoopThread.open() as loop_thread:
        pool = WorkerPool(loop_thread=loop_thread, metrics=Metrics(), routing=RoutingConfig(), model="tiny-chat",
                          health_interval=0.1)
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run, ScriptedRegistry(Snapshot(frozenset({spec}))))
            with trio.fail_after(seconds):
                while pool.workers[spec].state is not wanted:
                    await trio.sleep(0.05)
            await trio.sleep(0.5)  # a few more health rounds: the pool's nursery is still alive
            view = next(v for v in pool.snapshot() if v["address"] == address)
            nursery.cancel_scope.cancel()
    return view


async def test_a_sibling_worker_that_is_not_ready_is_unhealthy_and_the_pool_keeps_running(sim_workers):
    """The sibling server answers HEALTH_STATE_NOT_READY = 5; HealthState.Name(5) used to end the pool."""
    worker = sim_workers.start("prefill", *SIBLING, "--time-scale", "0", "--not-ready")
    view = await _pool_state(worker.address, "prefill", WorkerState.UNHEALTHY)
    assert view["state"] == "unhealthy" and view["detail"] == "health HEALTH_STATE_NOT_READY"


async def test_a_value_no_numbering_defines_degrades_the_worker_naming_it(sim_workers):
    """A revision-1 worker (v0.1.0 numbering) that answers health state 5: unhealthy, named, not a crash."""
    worker = sim_workers.start("aggregated", "--time-scale", "0", "--not-ready", "--persona", "trtllm",
                               "--report-health-state", "5")
    view = await _pool_state(worker.address, "aggregated", WorkerState.UNHEALTHY)
    assert "health state 5" in view["detail"] and "does not define" in view["detail"]


async def test_the_sibling_servers_engine_failure_reads_as_internal(sim_workers, engine_client):
    """ERROR_CODE_INTERNAL is 12 on the sibling server: read by its numbering, an engine failure (502)."""
    worker = sim_workers.start("aggregated", *SIBLING, "--time-scale", "0", "--error-rate", "1",
                               "--error-phase", "aggregated", "--error-code", "ERROR_CODE_INTERNAL")
    async with engine_client(worker.address) as client:
        await client.wait_until_ready(deadline=20)
        assert client.numbering is Numbering.DRAIN
        events = await collect(client, full_request("r1"))
    error = terminal(events).error
    assert error.code == ErrorCode.ERROR_CODE_INTERNAL and from_engine_error(error).status == 502
