"""One worker as the pool knows it: its engine client, state, load and routing counters.

A `Worker` is the pool's mutable record of one registered worker. Who writes what:
- the pool (workers/pool.py): `client` (while connected), `scope`, and the lease counters (`inflight`, `idle`);
- the monitor (workers/monitor.py): `state` and `detail` (through the transition table, workers/states.py),
  `load_sample`, `health_misses`, `unresponsive`, `identity_checked_at`, `instance`, and `adapters` as its
  ListLoras says (the pool too, after its own LoadLora);
- the picker (workers/picker.py): `sent_since_load`, counted at the pick; the lease and the load sample take
  their share back (`finished_since_load`).
`describe()` is its view in /health.
"""

from __future__ import annotations

import json
import logging

import trio

from orchestrator.discovery.snapshots import WorkerSpec
from orchestrator.engine import EngineClient
from orchestrator.log import RateLimitedLog, bounded
from orchestrator.workers.adapters import WorkerAdapters
from orchestrator.workers.instance_watch import InstanceWatch
from orchestrator.workers.kv_index import KvIndex
from orchestrator.workers.routing import LoadSample
from orchestrator.workers.states import WorkerState

log = logging.getLogger("orchestrator.workers.pool")  # one logger for the pool's parts, as operators filter it


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
        self.adapters = WorkerAdapters()  # its LoRA adapters, as its last ListLoras (or our LoadLora) said
        self.adapters_read = False  # whether ListLoras answered since it connected (or since it restarted)
        self.adapters_instance = ""  # the ServerInfo.instance_id those adapters were read from

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
                # An idle worker's load is read with each health check only (WorkerMonitor.poll_load): its last
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


def describe(worker: Worker, kv_index: KvIndex | None = None, kv_feed=None) -> dict:
    """The operator's view of one worker (/health): its state, and what its engine last reported."""
    view: dict = {"address": worker.address, "role": worker.role, "state": worker.state,
                  "detail": bounded(worker.detail),
                  "inflight": worker.inflight}
    if worker.adapters.surface:  # its LoRA adapters (a worker without the LoRA RPCs shows none)
        view["lora_adapters"] = sorted(worker.adapters.names)
        if worker.adapters.detail:
            view["lora_detail"] = bounded(worker.adapters.detail)
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
                          "supports_lora": caps.supports_lora, "max_loras": caps.max_loras,
                          # e.g. trtllm_supports_dp_rank_targeting, trtllm_kv_event_hash_algo, trtllm_node
                          "extra": {key: json.loads(value) for key, value in caps.extra}}
    sample = worker.load_sample
    if sample is not None:
        view["load"] = {"requests": sample.requests, "used_kv_blocks": sample.used_kv_blocks,
                        "total_kv_blocks": sample.total_kv_blocks}
    return view
