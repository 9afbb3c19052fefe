"""Which worker a leg goes to: each role's routing policy over the routable workers of that role.

The picker reads the pool's live membership (the same mapping the pool keeps) and each worker's state, load
and in-flight count; it performs no I/O. A kv_aware role's first pick for a request goes through `route` with
the prompt's block keys, so the decision is recorded in the KV index (workers/routing.py) and counted.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence

import trio

from orchestrator.discovery.snapshots import WorkerSpec
from orchestrator.errors import NoWorkerAvailable
from orchestrator.metrics import Metrics
from orchestrator.roles import ROLES
from orchestrator.workers.kv_index import KvIndex
from orchestrator.workers.routing import REASONS, Decision, KvAwareKnobs, make_policy
from orchestrator.workers.worker import Worker


class WorkerPicker:
    def __init__(self, workers: Mapping[WorkerSpec, Worker], *, model: str = "", metrics: Metrics, routing,
                 staleness_s: float, kv_index: KvIndex | None, kv_roles: tuple[str, ...]):
        self._workers = workers
        self._model = model  # named in a 503: an orchestrator may serve several models
        self._metrics = metrics
        self._kv_index = kv_index
        # A role routed kv_aware that the mode does not run (or with no KV routing given) is routed least loaded.
        self.policy_names = {role: "least_loaded" if policy == "kv_aware" and role not in kv_roles else policy
                             for role in ROLES for policy in [getattr(routing, role)]}
        tuning = routing.kv_aware
        knobs = KvAwareKnobs(overlap_weight=tuning.overlap_weight, max_imbalance=tuning.max_imbalance,
                             max_kv_usage=tuning.max_kv_usage)
        self._policies = {role: make_policy(name, staleness_s, index=kv_index, knobs=knobs)
                          for role, name in self.policy_names.items()}
        self._decisions = {(role, reason): metrics.routing_decisions.labels(role, reason)
                           for role in ROLES for reason in REASONS}

    def reads_load(self, worker: Worker) -> bool:
        """Whether the policy of the worker's role reads its load (so the monitor keeps it fresh)."""
        return self.policy_names[worker.role] in ("least_loaded", "kv_aware")

    def pick(self, role: str, exclude: tuple[Worker, ...] = (), accepts: Callable[[Worker], bool] | None = None
             ) -> Worker:
        """A routable worker of `role`, not in `exclude`, that `accepts` (the request's needs) takes, by that
        role's policy. A kv_aware role's first pick for a request goes through `route` with the prompt's keys."""
        return self._decide(role, exclude, accepts, ()).worker

    def route(self, role: str, exclude: tuple[Worker, ...] = (), accepts: Callable[[Worker], bool] | None = None,
              prompt: Sequence[int] = ()) -> Decision[Worker]:
        """pick(), with why and, on an attention-DP worker that takes a target rank, which rank holds the
        prompt's prefix; the plan's picks where a role routes kv_aware (the decisions metric counts these)."""
        if self.policy_names[role] != "kv_aware":
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

    def kv_block_size(self, role: str) -> int | None:
        """The KV block size prompt keys for `role` are cut in: the one its workers report (the first known;
        workers of one role serve one model); None without a KV index, or before any of them reported it."""
        if self._kv_index is None:
            return None
        for worker in self._workers.values():
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
        if self._kv_index is None or not keys:
            return None
        held: dict[str, int] = {}
        for (address, _), blocks in self._kv_index.overlap(keys, trio.current_time()).items():
            held[address] = max(held.get(address, 0), blocks)
        best = max((w for w in self._workers.values() if w.role == role and w.routable and w.address in held),
                   key=lambda w: (held[w.address], -w.inflight), default=None)
        if best is None or prompt_tokens - held[best.address] * block_size > max_uncached:
            return None
        return best

    def _candidates(self, role: str, exclude: tuple[Worker, ...], accepts: Callable[[Worker], bool] | None
                    ) -> list[Worker]:
        candidates = [w for w in self._workers.values() if w.role == role and w.routable and w not in exclude
                      and (accepts is None or accepts(w))]
        if not candidates:
            states = collections.Counter(str(w.state) for w in self._workers.values() if w.role == role)
            known = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
            # Which workers and why: the log and /health (operators); the client learns only the counts.
            of_model = f" of {self._model}" if self._model else ""
            raise NoWorkerAvailable(f"no {role} worker{of_model} is available ({known or 'none registered'})",
                                    code="no_worker_available", retry_after=1)
        return candidates
