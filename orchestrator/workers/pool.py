"""The live worker pool: the registry's workers, each with its engine client, monitor and leases.

The pool keeps membership: snapshots from the registry are diffed; new workers are connected (one engine client
each) and monitored (workers/monitor.py: health, identity, load); removed ones stop getting requests at once and
are closed when their in-flight requests are done (or a grace period passes). Which worker a leg goes to is the
picker's (workers/picker.py), over the same workers; a lease counts a request on its worker while it runs. A
transport failure during a request marks the worker unhealthy until its next good health check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import trio

from orchestrator.discovery.snapshots import Snapshot, WorkerRegistry, WorkerSpec
from orchestrator.engine import EngineClient, EngineError, LoopThread, NoLoraSurface
from orchestrator.errors import NoWorkerAvailable
from orchestrator.log import cause_chain
from orchestrator.metrics import Metrics
from orchestrator.roles import ROLES
from orchestrator.workers.adapters import AdapterSpec, WorkerAdapters, no_worker_message, room
from orchestrator.workers.kv_index import KvIndex
from orchestrator.workers.kv_routing import KvRouting
from orchestrator.workers.monitor import WorkerMonitor
from orchestrator.workers.picker import WorkerPicker
from orchestrator.workers.routing import Decision
from orchestrator.workers.states import WorkerEvent, WorkerState
from orchestrator.workers.worker import Worker, describe

__all__ = ["Worker", "WorkerPool"]

log = logging.getLogger(__name__)


class WorkerPool:
    def __init__(self, *, loop_thread: LoopThread, metrics: Metrics, routing, model: str,
                 health_interval: float = 1.0, discovery_timeout: float = 10.0, removal_grace: float = 30.0,
                 tls=None, stream_transport: str = "h2", keepalive=None, kv: KvRouting | None = None):
        self._loop_thread = loop_thread
        self._metrics = metrics
        self.model = model
        self.health_interval = health_interval
        self.discovery_timeout = discovery_timeout
        self.removal_grace = removal_grace
        self.tls = tls  # orchestrator.tls.TlsMaterial for every worker, or None
        self.stream_transport = stream_transport  # how Generate streams travel (EngineClient.open)
        self.keepalive = keepalive  # config.KeepaliveConfig for every worker connection, or None: the defaults
        # KV-aware routing's index and event feed (kv_routing.py), for the roles it names.
        self.kv = kv
        self.workers: dict[WorkerSpec, Worker] = {}
        # Removed workers still finishing their requests. Kept apart, so that a worker that registers again
        # meanwhile (etcd came back, its lease was renewed) is added anew instead of being forgotten.
        self.retiring: set[Worker] = set()
        self.registry_healthy = True
        self.registry_detail = ""
        self.changed = trio.Event()  # set on every pool change; replaced after
        # An adapter being loaded for a role (place_adapter): later requests for it wait for that load
        self._placing: dict[tuple[str, str], trio.Event] = {}
        staleness_s = routing.load_staleness_ms / 1000.0
        self.picker = WorkerPicker(self.workers, model=model, metrics=metrics, routing=routing, staleness_s=staleness_s,
                                   kv_index=self.kv_index, kv_roles=kv.roles if kv is not None else ())
        self.monitor = WorkerMonitor(metrics=metrics, model=model, health_interval=health_interval,
                                     staleness_s=staleness_s, kv_index=self.kv_index,
                                     polls_load=self.picker.reads_load, notify=self._notify)

    # ---- running ---------------------------------------------------------------------------------
    async def run(self, registry: WorkerRegistry, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            first = trio.Event()

            def publish(snapshot: Snapshot) -> None:
                self._apply(snapshot, nursery)
                first.set()

            nursery.start_soon(registry.run, publish)
            await first.wait()
            task_status.started()

    def _apply(self, snapshot: Snapshot, nursery: trio.Nursery) -> None:
        self.registry_healthy = snapshot.healthy
        self.registry_detail = snapshot.detail
        if not snapshot.healthy:
            self._notify()
            return  # keep the last known pool in service
        current = set(self.workers)
        for spec in snapshot.workers - current:
            worker = self.workers[spec] = Worker(spec)
            worker.idle_staleness = self.health_interval + max(1.0, self.health_interval)  # (+ its answer's time)
            log.info("worker added: %s %s", spec.role, spec.address)
            nursery.start_soon(self._run_worker, worker)
        for spec in current - snapshot.workers:
            worker = self.workers.pop(spec)
            log.info("worker removed: %s %s (%d in flight)", spec.role, spec.address, worker.inflight)
            self.monitor.transition(worker, WorkerEvent.REMOVED, "")
            if self.kv_index is not None and not any(s.address == spec.address for s in snapshot.workers):
                # out of the KV index and its series out of /metrics at once, not when its requests are done:
                # it gets no more of them (its monitor, running until then, writes none: _index_metrics)
                self.kv_index.forget(spec.address)
                if self.kv is not None and self.kv.feed is not None:
                    self.kv.feed.forget(spec.address)
                self._metrics.forget_worker(spec.address)
            self.retiring.add(worker)
            nursery.start_soon(self._retire, worker)
        self._notify()

    async def _retire(self, worker: Worker) -> None:
        with trio.move_on_after(self.removal_grace):
            await worker.idle.wait()
        worker.scope.cancel()

    async def _run_worker(self, worker: Worker) -> None:
        try:
            with worker.scope:
                keepalive = {} if self.keepalive is None else {
                    "keepalive_interval_s": self.keepalive.interval_s, "keepalive_timeout_s": self.keepalive.timeout_s}
                async with EngineClient.open(worker.address, self._loop_thread, tls=self.tls,
                                             stream_transport=self.stream_transport, **keepalive,
                                             discovery_timeout=self.discovery_timeout,
                                             name=worker.address.removeprefix("grpc://")) as client:
                    worker.client = client
                    async with trio.open_nursery() as nursery:
                        if self.monitor.polls_load(worker):
                            nursery.start_soon(self.monitor.poll_load, worker, client)
                        kv = self.kv
                        if kv is not None and kv.feed is not None and worker.role in kv.follow_roles:
                            nursery.start_soon(kv.feed.follow, worker.address, client, worker.instance)
                        nursery.start_soon(self.monitor.watch_adapters, worker, client)
                        await self.monitor.run(worker, client)
        finally:
            self.retiring.discard(worker)
            worker.client = None
            self._notify()

    def _notify(self) -> None:
        for role in ROLES:
            for state in WorkerState:
                self._metrics.workers.labels(role, state).set(
                    sum(1 for w in self._every_worker() if w.role == role and w.state == state))
        self.changed.set()
        self.changed = trio.Event()

    # ---- using workers -----------------------------------------------------------------------------
    def largest_window(self) -> int | None:
        """The largest context window a known worker reports (None before any capability discovery)."""
        windows = [w.client.cached_capabilities.max_context_length for w in self.workers.values()
                   if w.client is not None and w.client.cached_capabilities is not None]
        return max((window for window in windows if window), default=None)

    # ---- LoRA adapters (adapters.py) ------------------------------------------------------------------
    async def place_adapter(self, role: str, name: str, spec: AdapterSpec | None) -> None:
        """Make sure a routable worker of `role` holds the adapter `name`: one already does, or it is loaded
        (LoadLora of `spec`) on the one with the most room among those that support LoRA. Concurrent requests
        for an adapter being loaded wait for that load instead of loading it elsewhere too. NoWorkerAvailable
        names the adapter when no worker can have it (none supports LoRA, none has room, every load failed, or
        it is not configured: `spec` None)."""
        unread = [w for w in self.workers.values() if w.role == role and w.routable and not w.adapters_read]
        for worker in unread:  # (just connected: its watch has not read them yet)
            if worker.client is not None:
                await self.monitor.read_adapters(worker, worker.client)
        while True:
            if any(w.role == role and w.routable and w.adapters.holds(name) for w in self.workers.values()):
                return
            placing = self._placing.get((role, name))
            if placing is None:
                break
            await placing.wait()
        loaders = sorted((w for w in self.workers.values() if w.role == role and w.routable
                          and w.client is not None and self._room(w) > 0),
                         key=lambda w: (-self._room(w), w.inflight))
        if spec is None or not loaders:
            message = no_worker_message(name, role, loadable=len(loaders))
            if spec is None and loaders:
                message += " (it is not among the model's configured adapters, so it is not loaded anywhere)"
            raise NoWorkerAvailable(message, code="adapter_unavailable", retry_after=1)
        done = self._placing[(role, name)] = trio.Event()
        try:
            for worker in loaders:
                client = worker.client
                if client is None:
                    continue
                try:
                    await client.load_lora(spec.name, spec.source_path, spec.lora_id)
                except EngineError as exc:
                    if isinstance(exc, NoLoraSurface):
                        worker.adapters = WorkerAdapters()
                    log.warning("loading LoRA adapter %r on %s failed: %s", name, worker.address, cause_chain(exc))
                    continue
                worker.adapters = worker.adapters.with_loaded(name)
                log.info("loaded LoRA adapter %r on %s %s", name, worker.role, worker.address)
                self._notify()
                return
            raise NoWorkerAvailable(f"no {role} worker could load the LoRA adapter {name!r} (see the log)",
                                    code="adapter_unavailable", retry_after=1)
        finally:
            del self._placing[(role, name)]
            done.set()

    @staticmethod
    def _room(worker: Worker) -> int:
        caps = worker.client.cached_capabilities if worker.client is not None else None
        return 0 if caps is None else room(worker.adapters, caps.supports_lora, caps.max_loras)

    def ready_count(self, role: str) -> int:
        return sum(1 for w in self.workers.values() if w.role == role and w.routable)

    def pick(self, role: str, exclude: tuple[Worker, ...] = (), accepts: Callable[[Worker], bool] | None = None
             ) -> Worker:
        """A routable worker of `role` by its policy (WorkerPicker.pick)."""
        return self.picker.pick(role, exclude, accepts)

    def route(self, role: str, exclude: tuple[Worker, ...] = (), accepts: Callable[[Worker], bool] | None = None,
              prompt: Sequence[int] = ()) -> Decision[Worker]:
        """pick(), with why and the target DP rank, recorded where the role routes kv_aware (WorkerPicker.route)."""
        return self.picker.route(role, exclude, accepts, prompt)

    def holding(self, role: str, keys: Sequence[int], block_size: int, prompt_tokens: int, max_uncached: int
                ) -> Worker | None:
        """WorkerPicker.holding: the worker of `role` holding most of the prompt's prefix, if enough of it."""
        return self.picker.holding(role, keys, block_size, prompt_tokens, max_uncached)

    def kv_block_size(self, role: str) -> int | None:
        """WorkerPicker.kv_block_size: the KV block size prompt keys for `role` are cut in."""
        return self.picker.kv_block_size(role)

    @property
    def kv_index(self) -> KvIndex | None:
        """The KV index every kv_aware role's policy reads (None without KV routing)."""
        return self.kv.index if self.kv is not None else None

    @contextmanager
    def lease(self, worker: Worker) -> Iterator[Worker]:
        worker.inflight += 1
        worker.idle = trio.Event() if worker.inflight == 1 else worker.idle
        worker.load_poll_due.set()
        try:
            yield worker
        finally:
            worker.inflight -= 1
            worker.finished_since_load += 1
            if worker.inflight == 0:
                worker.idle.set()

    def report_unreachable(self, worker: Worker, error: EngineError) -> None:
        """A request could not reach this worker: stop routing to it until its health is good again."""
        self.monitor.transition(worker, WorkerEvent.UNREACHABLE, cause_chain(error))
        worker.wake_monitor.set()
        self._notify()

    def snapshot(self) -> list[dict]:
        """The operator's view of every worker (/health): state, and what its engine last reported."""
        feed = self.kv.feed if self.kv is not None else None
        return [describe(w, self.kv_index, feed) for w in self._every_worker()]

    def _every_worker(self) -> list[Worker]:
        return [*self.workers.values(), *self.retiring]
