"""Which workers one planned request goes to (docs/kv-routing.md).

A role routed `round_robin` or `least_loaded` is the pool's `pick`. A role routed `kv_aware` is the pool's
`route` with the prompt's KV block keys, which are cut here at most once per block size (a role's workers'
own) and only for such a role: other policies pay nothing for them. In conditional mode a longer prompt may
still run whole on the decode worker that holds its prefix (`find_holder`).

A request routed for a prefix that an earlier request is still computing on that worker (KvIndex in-flight
entries) waits for it (`settled`): sent at once, the engine would compute the prefix again alongside instead of
reusing it (docs/kv-routing.md, "Bursts").
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from orchestrator.roles import Role
from orchestrator.workers.pool import Worker, WorkerPool

SETTLE_POLL_S = 0.005  # how often a request waiting behind a prefix being computed looks again
# The longest a request waits behind a prefix being computed (docs/kv-routing.md, Bursts): past it the earlier
# request is likely queued in the engine rather than computing, and this one queues there too instead.
SETTLE_MAX_S = 0.1


class WorkerChoice:
    def __init__(self, pool: WorkerPool, kv_roles: tuple[str, ...], cut_keys: Callable[[int], list[int]], *,
                 adapter: str | None = None):
        self.pool, self.kv_roles, self._cut_keys = pool, kv_roles, cut_keys
        self.adapter = adapter  # the request's LoRA adapter: only workers holding it (None: any)
        self._keys_by_size: dict[int, list[int]] = {}
        self.holder: Worker | None = None  # conditional mode: the decode worker chosen for holding the prefix
        self.target_ranks: dict[Worker, int] = {}  # the attention-DP rank that holds the prefix, per worker
        # (worker, rank, keys, leading blocks) chosen for a prefix still being computed there
        self._behind: list[tuple[Worker, int, list[int], int]] = []

    def keys(self, role: Role) -> tuple[list[int], int]:
        """The prompt's keys cut in `role`'s KV block size, and that size (none before the size is known)."""
        block_size = self.pool.kv_block_size(role)
        if block_size is None:
            return [], 0
        if block_size not in self._keys_by_size:
            self._keys_by_size[block_size] = self._cut_keys(block_size)
        return self._keys_by_size[block_size], block_size

    def find_holder(self, prompt_tokens: int, max_uncached: int) -> Worker | None:
        """A decode worker whose cached prefix leaves at most `max_uncached` tokens to compute, if any."""
        self.holder = self.pool.holding(Role.DECODE, *self.keys(Role.DECODE), prompt_tokens, max_uncached)
        return self.holder

    def pick(self, role: Role) -> Worker:
        accepts = self._accepts(role)
        keys = self.keys(role)[0] if role in self.kv_roles else []
        if not keys:  # (route() would count a decision that was not kv_aware)
            return self.pool.pick(role, accepts=accepts)
        decision = self.pool.route(role, prompt=keys, accepts=accepts)
        if decision.rank is not None:
            self.target_ranks[decision.worker] = decision.rank
        index = self.pool.kv_index
        if decision.cached_blocks and index is not None and index.computing(
                (decision.worker.address, decision.rank or 0), keys, decision.cached_blocks, trio.current_time()):
            self._behind.append((decision.worker, decision.rank or 0, keys, decision.cached_blocks))
        return decision.worker

    def _accepts(self, role: Role) -> Callable[[Worker], bool] | None:
        holder, adapter = (self.holder if role is Role.DECODE else None), self.adapter
        if adapter is None:
            return None if holder is None else (lambda w: w is holder)
        if holder is None:
            return lambda w: w.adapters.holds(adapter)
        return lambda w: w is holder and w.adapters.holds(adapter)

    async def settled(self) -> None:
        """Wait until the prefixes the picks chose still being computed are computed: the workers' KV events
        show them stored, or they lapse (KvIndex.computing_ttl_s: the earlier request failed, say), or the
        worker is no longer routable; at most SETTLE_MAX_S."""
        if not self._behind:  # (the usual case: nothing to wait for)
            return
        index = self.pool.kv_index
        with trio.move_on_after(SETTLE_MAX_S):
            for worker, rank, keys, depth in self._behind:
                while (index is not None and worker.routable
                       and index.computing((worker.address, rank), keys, depth, trio.current_time())):
                    await trio.sleep(SETTLE_POLL_S)
        self._behind.clear()
