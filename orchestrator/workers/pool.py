"""The live worker pool: one engine client per worker, its health, capabilities and load.

Each worker's state follows the pure table in orchestrator.workers.states; this module is its monitor
(health polling, identity checks, load polling) and the picks. A worker is routable when it is READY.
Snapshots from the registry are diffed: new workers are connected, removed ones stop
getting requests at once and are closed when their in-flight requests are done (or a grace
period passes). A transport failure during a request marks the worker unhealthy until the next
good health check.

A worker whose health check gets no answer (timeout or unreachable) while nothing at all arrived on its
connection for as long is unresponsive (a frozen process keeps its connection open): its open calls are
failed at once as WorkerUnavailable, so that they retry or migrate to another worker (the decode stage,
orchestrator/flow/request_flow.py) instead of waiting for the connection's keepalive (40 s). The pool does not reach
into requests: the engine client fails the calls, and their readers see a lost connection.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import grpc
import trio

from orchestrator.discovery.snapshots import Snapshot, WorkerRegistry, WorkerSpec
from orchestrator.engine import EngineClient, EngineError, LoopThread, WorkerUnavailable
from orchestrator.engine.numbering import Health
from orchestrator.errors import NoWorkerAvailable
from orchestrator.log import RateLimitedLog, bounded, cause_chain
from orchestrator.metrics import KV_INDEX_MODES, Metrics
from orchestrator.roles import ROLES
from orchestrator.workers.instance_watch import InstanceWatch
from orchestrator.workers.kv_index import KvIndex
from orchestrator.workers.kv_routing import KvRouting
from orchestrator.workers.routing import REASONS, Decision, KvAwareKnobs, LoadSample, make_policy
from orchestrator.workers.states import WorkerEvent, WorkerState, next_state, rereads_capabilities

log = logging.getLogger(__name__)

# Health checks in a row that time out, with nothing arriving from the worker meanwhile, before it is unhealthy.
HEALTH_MISSES = 2


class Worker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.address = spec.address
        self.role = spec.role
        self.client: EngineClient | None = None
        self.state = WorkerState.CONNECTING
        self.detail = ""
        self.inflight = 0
        self.sent_since_load = 0
        self.finished_since_load = 0  # leases ended since the sample: routing takes them off its requests
        self.load_sample: LoadSample | None = None
        self.idle_staleness = 0.0  # how long an idle sample holds (the pool sets it: about a health interval)
        self.scope = trio.CancelScope()
        self.idle = trio.Event()
        self.idle.set()
        # Wakes an idle load poll (while idle, the health monitor reads the load in its own round trip):
        # set when a request is leased to the worker, or when a sample shows it busy.
        self.load_poll_due = trio.Event()
        self.wake_monitor = trio.Event()
        self.log = RateLimitedLog(log, interval=10.0)
        self.identity_checked_at = float("-inf")
        # Which instance of the worker runs (ServerInfo.instance_id), as the monitor last saw it: the KV event
        # feed starts over when it changes, without reading ServerInfo itself.
        self.instance = InstanceWatch()
        # The pool failed this worker's calls because it stopped answering; until it answers a health check
        # again, an Abort to it would only wait out its timeout (its closed connection cancels the calls anyway).
        self.unresponsive = False
        self.health_misses = 0  # health checks in a row that timed out while nothing arrived from the worker
        self._dp_targeting: tuple[object, bool] = (None, False)  # (the capabilities it was read from, answer)

    @property
    def dp_size(self) -> int:
        caps = self.client.cached_capabilities if self.client is not None else None
        return caps.data_parallel_size or 1 if caps is not None else 1

    @property
    def targets_dp_rank(self) -> bool:
        """Whether a request may name the attention-DP rank to run on (gRPC metadata openengine-target-dp-rank):
        the worker has several ranks and says so (ServerInfo.extra trtllm_supports_dp_rank_targeting)."""
        caps = self.client.cached_capabilities if self.client is not None else None
        if caps is None:
            return False
        seen, answer = self._dp_targeting
        if seen is not caps:  # read once per capability discovery, not per routing decision
            extra = dict(caps.extra)
            answer = caps.data_parallel_size > 1 and json.loads(
                extra.get("trtllm_supports_dp_rank_targeting", "false")) is True
            self._dp_targeting = (caps, answer)
        return answer

    def fresh_load(self, now: float, staleness: float) -> LoadSample | None:
        sample = self.load_sample
        if sample is None:
            return None
        if now - sample.at > staleness and not (
                # An idle worker's load is read with each health check only (WorkerPool._poll_load): its last
                # sample holds until the next one is due, unless we sent it something since.
                sample.requests == 0 and self.inflight == 0 and self.sent_since_load == 0
                and now - sample.at <= self.idle_staleness):
            return None
        return sample

    @property
    def routable(self) -> bool:
        return self.state is WorkerState.READY and self.client is not None

    def __repr__(self) -> str:
        return f"<Worker {self.role} {self.address} {self.state}>"


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
        self.tls = tls  # orchestrator.engine.client.ChannelTls for every worker, or None
        self.stream_transport = stream_transport  # how Generate streams travel (EngineClient.open)
        self.keepalive = keepalive  # config.KeepaliveConfig for every worker connection, or None: the defaults
        self.identity_interval = max(5.0, health_interval * 10)
        self.staleness_s = routing.load_staleness_ms / 1000.0
        # KV-aware routing's index and event feed (kv_routing.py), for the roles it names: a role routed kv_aware
        # that the mode does not run (or with no KV routing given) is routed least loaded, and sets up nothing.
        self.kv = kv
        kv_roles = kv.roles if kv is not None else ()
        self._policy_names = {role: "least_loaded" if policy == "kv_aware" and role not in kv_roles else policy
                              for role in ROLES for policy in [getattr(routing, role)]}
        tuning = routing.kv_aware
        knobs = KvAwareKnobs(overlap_weight=tuning.overlap_weight, max_imbalance=tuning.max_imbalance,
                             max_kv_usage=tuning.max_kv_usage)
        self._policies = {role: make_policy(name, self.staleness_s, index=self.kv_index, knobs=knobs)
                          for role, name in self._policy_names.items()}
        self._decisions = {(role, reason): metrics.routing_decisions.labels(role, reason)
                           for role in ROLES for reason in REASONS}
        self.workers: dict[WorkerSpec, Worker] = {}
        # Removed workers still finishing their requests. Kept apart, so that a worker that registers again
        # meanwhile (etcd came back, its lease was renewed) is added anew instead of being forgotten.
        self.retiring: set[Worker] = set()
        self.registry_healthy = True
        self.registry_detail = ""
        self.changed = trio.Event()  # set on every pool change; replaced after

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
            self._on(worker, WorkerEvent.REMOVED, "")
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
                        if self._polls_load(worker):
                            nursery.start_soon(self._poll_load, worker, client)
                        kv = self.kv
                        if kv is not None and kv.feed is not None and worker.role in kv.follow_roles:
                            nursery.start_soon(kv.feed.follow, worker.address, client, worker.instance)
                        await self._monitor(worker, client)
        finally:
            self.retiring.discard(worker)
            worker.client = None
            self._notify()

    async def _monitor(self, worker: Worker, client: EngineClient) -> None:
        polls_load = self._polls_load(worker)
        while True:
            previous = worker.state
            recheck_now = False
            # Unanswered for one interval is a miss (at least 1 s: a busy box is not a dead one)
            timeout = max(1.0, self.health_interval)
            try:
                if polls_load and self._idle_load(worker):  # _poll_load is waiting: read the load here too
                    asked = (worker.sent_since_load, worker.finished_since_load)
                    state, load = await client.health_and_load(timeout=timeout)
                    if not isinstance(load, EngineError):
                        self._on_load(worker, load, asked)
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
                    self._on(worker, WorkerEvent.UNHEALTHY, _health_detail(state, client))
            if worker.state != previous:
                self._notify()
            if self.kv_index is not None and worker.state is not WorkerState.REMOVING:
                self._index_metrics(worker, self.kv_index)
            if recheck_now:
                continue  # a silent worker's second chance comes at once: a frozen one is found one timeout later
            worker.wake_monitor = trio.Event()
            with trio.move_on_after(self.health_interval):
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
        self._on(worker, WorkerEvent.UNHEALTHY, cause_chain(exc))
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
            await worker.instance.check(client, timeout=max(1.0, self.health_interval * 2))
        try:
            caps = await client.capabilities()
        except EngineError as exc:
            # Health is fine, discovery is not: keep the worker routable so that requests see the shared
            # discovery failure (a 503) instead of "no worker"; the next request retries discovery.
            self._on(worker, WorkerEvent.HEALTHY, f"capability discovery failing: {exc}")
            return
        worker.instance.saw(caps.instance_id)
        if not caps.serves_role(worker.role):
            self._on(worker, WorkerEvent.IDENTITY_MISMATCH,
                     f"registered as {worker.role} but ServerInfo.engine_role is {caps.role}")
        elif self.model and self.model not in caps.models and caps.model_id != self.model:
            self._on(worker, WorkerEvent.IDENTITY_MISMATCH, f"serves {caps.models}, not {self.model!r}")
        else:
            self._on(worker, WorkerEvent.HEALTHY, "")

    def _on(self, worker: Worker, event: WorkerEvent, detail: str) -> None:
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

    def _polls_load(self, worker: Worker) -> bool:
        return self._policy_names[worker.role] in ("least_loaded", "kv_aware")

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
    def _on_load(worker: Worker, load, asked: tuple[int, int] | None = None) -> None:
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

    async def _poll_load(self, worker: Worker, client: EngineClient) -> None:
        interval = max(0.02, self.staleness_s / 2)
        while True:
            if worker.state is WorkerState.READY:
                try:
                    asked = (worker.sent_since_load, worker.finished_since_load)
                    self._on_load(worker, await client.load(timeout=max(1.0, interval * 4)), asked)
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

    def ready_count(self, role: str) -> int:
        return sum(1 for w in self.workers.values() if w.role == role and w.routable)

    def pick(self, role: str, exclude: tuple[Worker, ...] = (), accepts: Callable[[Worker], bool] | None = None
             ) -> Worker:
        """A routable worker of `role`, not in `exclude`, that `accepts` (the request's needs) takes, by that
        role's policy. A kv_aware role's first pick for a request goes through `route` with the prompt's keys."""
        return self._decide(role, exclude, accepts, ()).worker

    def route(self, role: str, exclude: tuple[Worker, ...] = (), accepts: Callable[[Worker], bool] | None = None,
              prompt: Sequence[int] = ()) -> Decision[Worker]:
        """pick(), with why and, on an attention-DP worker that takes a target rank, which rank holds the
        prompt's prefix; the plan's picks where a role routes kv_aware (the decisions metric counts these)."""
        if self._policy_names[role] != "kv_aware":
            prompt = ()
        decision = self._decide(role, exclude, accepts, prompt)
        if prompt:
            address = decision.worker.address
            self._metrics.routing_prompt_blocks.labels(address).inc(decision.prompt_blocks)
            self._metrics.routing_cached_blocks.labels(address).inc(decision.cached_blocks)
        self._decisions[role, decision.reason].inc()
        return decision

    def _decide(self, role: str, exclude: tuple[Worker, ...], accepts: Callable[[Worker], bool] | None,
                prompt: Sequence[int]) -> Decision[Worker]:
        candidates = self._candidates(role, exclude, accepts)
        # One candidate is every policy's choice (the usual small deployment): no scoring for it, unless the
        # prompt's keys are to be recorded and its DP rank chosen (kv_aware).
        if len(candidates) == 1 and not prompt:
            decision = Decision(candidates[0], "single")
        else:
            decision = self._policies[role].decide(candidates, trio.current_time(), prompt)
        # Counted at the pick, not when the leg starts: a burst planned at once must see its own picks.
        decision.worker.sent_since_load += 1
        return decision

    @property
    def kv_index(self) -> KvIndex | None:
        """The KV index every kv_aware role's policy reads (None without KV routing)."""
        return self.kv.index if self.kv is not None else None

    def kv_block_size(self, role: str) -> int | None:
        """The KV block size prompt keys for `role` are cut in: the one its workers report (the first known;
        workers of one role serve one model); None without a KV index, or before any of them reported it."""
        if self.kv_index is None:
            return None
        for worker in self.workers.values():
            caps = worker.client.cached_capabilities if worker.role == role and worker.client is not None else None
            if caps is not None and caps.kv_block_size:
                return caps.kv_block_size
        return None

    def holding(self, role: str, keys: Sequence[int], block_size: int, prompt_tokens: int, max_uncached: int
                ) -> Worker | None:
        """The routable worker of `role` holding the most of the prompt's prefix (`keys`, cut in `block_size`:
        that role's, kv_block_size(role)), if it leaves at most `max_uncached` prompt tokens to compute
        (conditional mode: a short remainder prefills on the decode worker itself); None otherwise, or without
        a KV index."""
        if self.kv_index is None or not keys:
            return None
        held: dict[str, int] = {}
        for (address, _), blocks in self.kv_index.overlap(keys, trio.current_time()).items():
            held[address] = max(held.get(address, 0), blocks)
        best = max((w for w in self.workers.values() if w.role == role and w.routable and w.address in held),
                   key=lambda w: (held[w.address], -w.inflight), default=None)
        if best is None or prompt_tokens - held[best.address] * block_size > max_uncached:
            return None
        return best

    def _candidates(self, role: str, exclude: tuple[Worker, ...], accepts: Callable[[Worker], bool] | None
                    ) -> list[Worker]:
        candidates = [w for w in self.workers.values() if w.role == role and w.routable and w not in exclude
                      and (accepts is None or accepts(w))]
        if not candidates:
            states = collections.Counter(str(w.state) for w in self.workers.values() if w.role == role)
            known = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
            # Which workers and why: the log and /health (operators); the client learns only the counts.
            of_model = f" of {self.model}" if self.model else ""  # which model's pool (an orchestrator serves several)
            raise NoWorkerAvailable(f"no {role} worker{of_model} is available ({known or 'none registered'})",
                                    code="no_worker_available", retry_after=1)
        return candidates

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
        self._on(worker, WorkerEvent.UNREACHABLE, cause_chain(error))
        worker.wake_monitor.set()
        self._notify()

    def snapshot(self) -> list[dict]:
        """The operator's view of every worker (/health): state, and what its engine last reported."""
        feed = self.kv.feed if self.kv is not None else None
        return [_describe(w, self.kv_index, feed) for w in self._every_worker()]

    def _every_worker(self) -> list[Worker]:
        return [*self.workers.values(), *self.retiring]


def _health_detail(state: Health, client: EngineClient) -> str:
    if state is Health.UNKNOWN:
        return (f"health state {client.last_health_value}, which its numbering ({client.numbering.value}) does "
                "not define")
    return f"health {state.wire_name}"


def _describe(worker: Worker, kv_index: KvIndex | None = None, kv_feed=None) -> dict:
    view: dict = {"address": worker.address, "role": worker.role, "state": worker.state,
                  "detail": bounded(worker.detail),
                  "inflight": worker.inflight}
    if kv_index is not None:
        # How KV-aware routing knows this worker's cache: from its KV events, or approximately (what we sent it).
        view["kv_index"] = {"mode": kv_index.mode(worker.address), "image_keys": kv_index.image_keys(worker.address),
                            "blocks": kv_index.blocks(worker.address)}
        why = kv_feed.detail.get(worker.address) if kv_feed is not None else None
        if why:  # why its events are not used (no sources, invalid ones, a failing subscription, refused events)
            view["kv_index"]["detail"] = bounded(why)
    caps = worker.client.cached_capabilities if worker.client is not None else None
    if caps is not None:
        view["engine"] = {"name": caps.engine, "instance_id": caps.instance_id, "role": caps.role,
                          "schema_revision": caps.schema_revision, "data_parallel_size": caps.data_parallel_size,
                          "kv_block_size": caps.kv_block_size, "total_kv_blocks": caps.total_kv_blocks,
                          "guided_decoding": caps.guided_decoding.supported,
                          # advertised abort by session (never relied on: orchestrator/kv/lease.py)
                          "supports_abort_cleanup": caps.supports_abort_cleanup,
                          # e.g. trtllm_supports_dp_rank_targeting, trtllm_kv_event_hash_algo, trtllm_node
                          "extra": {key: json.loads(value) for key, value in caps.extra}}
    sample = worker.load_sample
    if sample is not None:
        view["load"] = {"requests": sample.requests, "used_kv_blocks": sample.used_kv_blocks,
                        "total_kv_blocks": sample.total_kv_blocks}
    return view
