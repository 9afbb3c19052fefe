"""The worker pool's registry diffing, with a scripted registry and unreachable worker addresses."""

from typing import cast

import trio

from orchestrator.config import RoutingConfig
from orchestrator.discovery.snapshots import Snapshot, WorkerSpec
from orchestrator.engine import EngineClient, LoopThread
from orchestrator.metrics import Metrics
from orchestrator.openengine.v1 import server_pb2
from orchestrator.workers.monitor import WorkerMonitor
from orchestrator.workers.pool import Worker, WorkerPool
from orchestrator.workers.states import WorkerState
from pool_helpers import ScriptedRegistry


async def test_a_worker_that_registers_again_while_it_retires_is_added_anew():
    """etcd frozen longer than the lease: the worker's key expires while it serves, then it registers again.
    The retiring Worker finishes its requests; the new registration gets a Worker of its own."""
    spec = WorkerSpec(address="grpc://127.0.0.1:9", role="decode", model="m", instance_id="d1")
    registry = ScriptedRegistry(Snapshot(frozenset({spec})))
    async with LoopThread.open() as loop_thread:
        pool = WorkerPool(loop_thread=loop_thread, metrics=Metrics(), routing=RoutingConfig(), model="m",
                          health_interval=0.05, removal_grace=30)
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run, registry)
            first = pool.workers[spec]
            with pool.lease(first):  # a request in flight on it
                registry.publish(Snapshot(frozenset()))
                assert spec not in pool.workers and first in pool.retiring
                assert first.state is WorkerState.REMOVING
                registry.publish(Snapshot(frozenset({spec})))
                again = pool.workers[spec]
                assert again is not first and again.state is not WorkerState.REMOVING
                assert {w["state"] for w in pool.snapshot()} >= {"removing"}
            with trio.fail_after(5):  # the retiring one goes once its request is done; the new one stays
                while first in pool.retiring:
                    await trio.sleep(0.01)
            assert pool.workers[spec] is again
            nursery.cancel_scope.cancel()


async def test_the_configured_keepalive_reaches_every_worker_connection():
    from orchestrator.config import KeepaliveConfig

    spec = WorkerSpec(address="grpc://127.0.0.1:9", role="decode", model="m", instance_id="d1")
    async with LoopThread.open() as loop_thread:
        pool = WorkerPool(loop_thread=loop_thread, metrics=Metrics(), routing=RoutingConfig(), model="m",
                          health_interval=0.05, keepalive=KeepaliveConfig(interval_s=7.0, timeout_s=3.0))
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run, ScriptedRegistry(Snapshot(frozenset({spec}))))
            with trio.fail_after(5):
                while pool.workers[spec].client is None:
                    await trio.sleep(0.01)
            keepalive = cast(EngineClient, pool.workers[spec].client)._channel.keepalive
            assert (keepalive.interval_s, keepalive.timeout_s) == (7.0, 3.0)
            nursery.cancel_scope.cancel()


async def test_a_load_sample_keeps_the_queued_requests_apart():
    """Queued requests hold no KV blocks yet: routing charges them an average request's blocks (routing._loads),
    so the sample must say how many of its requests are queued."""
    worker = Worker(WorkerSpec(address="grpc://127.0.0.1:9", role="aggregated"))
    worker.sent_since_load = 3
    WorkerMonitor.on_load(worker, server_pb2.LoadInfo(running_requests=2, queued_requests=5, used_kv_blocks=80,
                                                    total_kv_blocks=1000))
    sample = worker.load_sample
    assert sample is not None and (sample.requests, sample.queued, sample.admitted) == (7, 5, 2)
    assert (sample.used_kv_blocks, sample.total_kv_blocks, worker.sent_since_load) == (80, 1000, 0)


async def test_a_load_sample_from_tensorrt_llm_counts_its_queued_requests_in_without_telling_them_apart():
    """UPSTREAM load-kv: TensorRT-LLM's running_requests is its active count and queued_requests stays unset, so
    routing must not take the requests for admitted ones holding the blocks in use (routing._loads)."""
    worker = Worker(WorkerSpec(address="grpc://127.0.0.1:9", role="aggregated"))
    WorkerMonitor.on_load(worker, server_pb2.LoadInfo(running_requests=7, used_kv_blocks=80, total_kv_blocks=1000))
    sample = worker.load_sample
    assert sample is not None and (sample.requests, sample.queued, sample.admitted) == (7, None, 7)


async def test_a_load_sample_from_the_sibling_server_counts_its_queue_once():
    """UPSTREAM r3-load: revision-3 TensorRT-LLM sets queued_requests, but its running_requests (a request
    tracker's count) already holds them: 4 in the batch and 5 queued are 9 requests, not 14. An engine whose
    running_requests are only those in the batch adds its queue."""
    worker = Worker(WorkerSpec(address="grpc://127.0.0.1:9", role="aggregated"))
    WorkerMonitor.on_load(worker, server_pb2.LoadInfo(running_requests=9, queued_requests=5, prefill_batch_size=1,
                                                    decode_batch_size=3, used_kv_blocks=80, total_kv_blocks=1000))
    sample = worker.load_sample
    assert sample is not None and (sample.requests, sample.queued, sample.admitted) == (9, 5, 4)
    WorkerMonitor.on_load(worker, server_pb2.LoadInfo(running_requests=4, queued_requests=5, prefill_batch_size=1,
                                                    decode_batch_size=3))
    assert worker.load_sample is not None and worker.load_sample.requests == 9
