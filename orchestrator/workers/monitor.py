"""The monitor of each worker: health checks, identity checks and load polling, which move its state.

One `run` task per connected worker (the pool starts it, and cancels it on the worker's removal) checks its
health every interval and, while healthy, that it still serves the role and model it registered for (a restart
shows as a new ServerInfo.instance_id); `poll_load` reads its load for the load-aware policies. Every state
change goes through `transition`, the table of workers/states.py.

A worker whose health check gets no answer (timeout or unreachable) while nothing at all arrived on its
connection for as long is unresponsive (a frozen process keeps its connection open): its open calls are
failed at once as WorkerUnavailable, so that they retry or migrate to another worker (the decode stage,
orchestrator/flow/request_flow.py) instead of waiting for the connection's keepalive (40 s). The monitor does not
reach into requests: the engine client fails the calls, and their readers see a lost connection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
import trio

from orchestrator.engine import EngineClient, EngineError, NoLoraSurface, WorkerUnavailable
from orchestrator.engine.numbering import Health
from orchestrator.log import cause_chain
from orchestrator.metrics import KV_INDEX_MODES, Metrics
from orchestrator.workers.adapters import WorkerAdapters, listed
from orchestrator.workers.kv_index import KvIndex
from orchestrator.workers.routing import LoadSample
from orchestrator.workers.states import WorkerEvent, WorkerState, next_state, rereads_capabilities
from orchestrator.workers.worker import Worker, log

# Health checks in a row that time out, with nothing arriving from the worker meanwhile, before it is unhealthy.
HEALTH_MISSES = 2


class WorkerMonitor:
    def __init__(self, *, metrics: Metrics, model: str, health_interval: float, staleness_s: float,
                 kv_index: KvIndex | None, polls_load: Callable[[Worker], bool], notify: Callable[[], None]):
        self._metrics = metrics
        self._model = model
        self._health_interval = health_interval
        self.identity_interval = max(5.0, health_interval * 10)
        self._staleness_s = staleness_s
        self._kv_index = kv_index
        self.polls_load = polls_load  # whether the worker's role is routed by a policy that reads load
        self._notify = notify  # the pool's: a worker's state changed

    async def run(self, worker: Worker, client: EngineClient) -> None:
        """Check the worker's health every interval until cancelled (its removal), moving its state."""
        polls_load = self.polls_load(worker)
        while True:
            previous = worker.state
            recheck_now = False
            # Unanswered for one interval is a miss (at least 1 s: a busy box is not a dead one)
            timeout = max(1.0, self._health_interval)
            try:
                if polls_load and self._idle_load(worker):  # poll_load is waiting: read the load here too
                    asked = (worker.sent_since_load, worker.finished_since_load)
                    state, load = await client.health_and_load(timeout=timeout)
                    if not isinstance(load, EngineError):
                        self.on_load(worker, load, asked)
                else:
                    state = await client.health(timeout=timeout)
            except EngineError as exc:
                recheck_now = self._on_health_error(worker, client, timeout, exc)
            else:
                worker.unresponsive = False
                worker.health_misses = 0
                if state.serving:
                    if rereads_capabilities(previous, WorkerEvent.HEALTHY):
                        client.forget_capabilities()
                    await self._check_identity(worker, client)
                else:
                    # NOT_READY, STARTING, the sibling server's DRAINING (it finishes what it runs, takes nothing
                    # new), or a state its numbering does not define: no new requests until it says READY.
                    self.transition(worker, WorkerEvent.UNHEALTHY, _health_detail(state, client))
            if worker.state != previous:
                self._notify()
            if self._kv_index is not None and worker.state is not WorkerState.REMOVING:
                self._index_metrics(worker, self._kv_index)
            if recheck_now:
                continue  # a silent worker's second chance comes at once: a frozen one is found one timeout later
            worker.wake_monitor = trio.Event()
            with trio.move_on_after(self._health_interval):
                await worker.wake_monitor.wait()

    def _on_health_error(self, worker: Worker, client: EngineClient, timeout: float, exc: EngineError) -> bool:
        """A health check that failed. A timed-out check is a miss, not a verdict: under a full load (1,024
        streams) or on a starved host the answer comes late while the worker works. A worker whose streams
        brought us messages within the check's own timeout is alive, whatever its health check says; one that
        missed HEALTH_MISSES checks in a row with nothing arriving is unhealthy (and its calls are failed: a
        frozen process keeps its connection open). A refused connection or an error answer counts at once.
        Returns whether to check again at once (a tolerated miss with nothing arriving)."""
        timed_out = isinstance(exc, WorkerUnavailable) and exc.grpc_status is grpc.StatusCode.DEADLINE_EXCEEDED
        if timed_out and client.heard_within(timeout):
            worker.health_misses = 0
            self._count_late(worker)
            worker.log("worker %s %s: health check unanswered in %g s while its streams flow: kept in the pool",
                       worker.role, worker.address, timeout)
            return False
        worker.health_misses += 1
        if timed_out and worker.health_misses < HEALTH_MISSES:
            self._count_late(worker)
            worker.log("worker %s %s: health check unanswered in %g s (%d in a row): kept in the pool until %d",
                       worker.role, worker.address, timeout, worker.health_misses, HEALTH_MISSES)
            return True
        self.transition(worker, WorkerEvent.UNHEALTHY, cause_chain(exc))
        if isinstance(exc, WorkerUnavailable):
            self._fail_calls_if_silent(worker, client, timeout * HEALTH_MISSES, exc)
        return False

    def _count_late(self, worker: Worker) -> None:
        self._metrics.health_checks_late.labels(worker.address).inc()

    @staticmethod
    def _fail_calls_if_silent(worker: Worker, client: EngineClient, quiet_s: float, error: EngineError) -> None:
        failed = client.fail_calls_if_silent(quiet_s, f"the worker is unresponsive: {error.message}")
        if failed:
            worker.unresponsive = True
            log.warning("worker %s %s is unresponsive (no health answer, nothing received for %g s): failed its %d "
                        "open calls so that they retry or migrate", worker.role, worker.address, quiet_s, failed)

    async def _check_identity(self, worker: Worker, client: EngineClient) -> None:
        # A restart faster than one health interval shows only as a new ServerInfo.instance_id: read it now and
        # then (the watch forgets the old instance's capabilities).
        cached = client.cached_capabilities
        now = trio.current_time()
        if cached is not None and cached.instance_id and now >= worker.identity_checked_at + self.identity_interval:
            worker.identity_checked_at = now
            await worker.instance.check(client, timeout=max(1.0, self._health_interval * 2))
        try:
            caps = await client.capabilities()
        except EngineError as exc:
            # Health is fine, discovery is not: keep the worker routable so that requests see the shared
            # discovery failure (a 503) instead of "no worker"; the next request retries discovery.
            self.transition(worker, WorkerEvent.HEALTHY, f"capability discovery failing: {exc}")
            return
        worker.instance.saw(caps.instance_id)
        if worker.adapters_read and caps.instance_id != worker.adapters_instance:
            # Restarted: the new process holds none of the old one's adapters until its ListLoras says so
            worker.adapters, worker.adapters_read = WorkerAdapters(), False
        if not caps.serves_role(worker.role):
            self.transition(worker, WorkerEvent.IDENTITY_MISMATCH,
                     f"registered as {worker.role} but ServerInfo.engine_role is {caps.role}")
        elif self._model and self._model not in caps.models and caps.model_id != self._model:
            self.transition(worker, WorkerEvent.IDENTITY_MISMATCH, f"serves {caps.models}, not {self._model!r}")
        else:
            self.transition(worker, WorkerEvent.HEALTHY, "")

    def transition(self, worker: Worker, event: WorkerEvent, detail: str) -> None:
        """Apply `event` by the table (workers/states.py), logging a change once."""
        state = next_state(worker.state, event)
        if worker.state is WorkerState.REMOVING:
            return
        if state != worker.state or detail != worker.detail:
            level = logging.INFO if state in (WorkerState.READY, WorkerState.REMOVING) else logging.WARNING
            if state != worker.state:
                log.log(level, "worker %s %s: %s -> %s %s", worker.role, worker.address, worker.state, state, detail)
            elif detail:
                worker.log("worker %s %s still %s: %s", worker.role, worker.address, state, detail)
        worker.state, worker.detail = state, detail

    async def watch_adapters(self, worker: Worker, client: EngineClient) -> None:
        """Keep `worker.adapters` as the worker's ListLoras says: once it is ready, then at the identity checks'
        pace (never faster than its health checks; the pool's own LoadLora updates it at once). A worker without
        the LoRA surface is asked again only at that pace too: it may be restarted with a LoRA config."""
        while True:
            while not worker.routable:
                await trio.sleep(self._health_interval)
            await self.read_adapters(worker, client)
            await trio.sleep(self.identity_interval)

    async def read_adapters(self, worker: Worker, client: EngineClient) -> None:
        caps = client.cached_capabilities
        try:
            answer = await client.list_loras(timeout=self._health_interval + 1.0)
            worker.adapters = listed([adapter.lora_name for adapter in answer])
        except NoLoraSurface:
            worker.adapters = WorkerAdapters()
        except EngineError as exc:
            # A failed read: what it last said stands (the health monitor judges the worker itself)
            worker.log("worker %s: ListLoras failed: %s", worker.address, cause_chain(exc))
            return
        worker.adapters_read, worker.adapters_instance = True, caps.instance_id if caps is not None else ""

    def _index_metrics(self, worker: Worker, index: KvIndex) -> None:
        metrics = self._metrics
        mode = index.mode(worker.address)
        metrics.kv_index_blocks.labels(worker.address).set(index.blocks(worker.address))
        for each in KV_INDEX_MODES:
            metrics.kv_index_mode.labels(worker.address, each).set(1 if each == mode else 0)
        metrics.kv_index_routed.set(index.routed_entries())

    @staticmethod
    def _idle_load(worker: Worker) -> bool:
        """Nothing running there (last sample) and nothing of ours in flight."""
        return worker.inflight == 0 and worker.load_sample is not None and worker.load_sample.requests == 0

    @staticmethod
    def on_load(worker: Worker, load, asked: tuple[int, int] | None = None) -> None:
        """A GetLoad answer; `asked`: our (sent, finished) counts since the previous sample when it was asked
        (None: as it arrived). What was sent or finished during the round trip still counts after it: a sample
        asked while our request ran may arrive after it finished, and must not count it running again."""
        kv = load.HasField("used_kv_blocks") and load.HasField("total_kv_blocks") and load.total_kv_blocks > 0
        # Revision-1 TensorRT-LLM counts its queued requests in running_requests and leaves queued_requests unset
        # (UPSTREAM load-kv). The sibling server (revision 3) sets queued_requests, but its running_requests is the
        # larger of the executor's active count and its own request tracker's, which counts the queue as well
        # (UPSTREAM r3-load): where the batch sizes say what runs, the requests are at least those plus the queue
        # and no more than what running_requests already counts.
        queued = load.queued_requests if load.HasField("queued_requests") else None
        requests = load.running_requests + (queued or 0)
        if queued is not None and (load.HasField("prefill_batch_size") or load.HasField("decode_batch_size")):
            requests = max(load.running_requests, load.prefill_batch_size + load.decode_batch_size + queued)
        worker.load_sample = LoadSample(trio.current_time(), requests, load.used_kv_blocks if kv else None,
                                        load.total_kv_blocks if kv else None, queued=queued)
        sent, finished = asked if asked is not None else (worker.sent_since_load, worker.finished_since_load)
        worker.sent_since_load -= sent
        worker.finished_since_load -= finished
        if worker.load_sample.requests:
            worker.load_poll_due.set()  # busy (someone else's traffic): the poll runs at its own pace again

    async def poll_load(self, worker: Worker, client: EngineClient) -> None:
        """Read the worker's load while requests may go there (least_loaded and kv_aware routing read it)."""
        interval = max(0.02, self._staleness_s / 2)
        while True:
            if worker.state is WorkerState.READY:
                try:
                    asked = (worker.sent_since_load, worker.finished_since_load)
                    self.on_load(worker, await client.load(timeout=max(1.0, interval * 4)), asked)
                except EngineError:
                    pass
            if self._idle_load(worker):
                # Idle: the health monitor reads the load with each health check (same round trip) until a
                # request goes out, which wakes this poll at once, so the picker has fresh samples while there
                # is traffic; and a busy sample from the monitor (another orchestrator's traffic) wakes it too.
                worker.load_poll_due = trio.Event()
                await worker.load_poll_due.wait()
            else:
                await trio.sleep(interval)


def _health_detail(state: Health, client: EngineClient) -> str:
    if state is Health.UNKNOWN:
        return (f"health state {client.last_health_value}, which its numbering ({client.numbering.value}) does "
                "not define")
    return f"health {state.wire_name}"
