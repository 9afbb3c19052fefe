"""A planned request, pure: the way it runs and the workers its legs go to.

One value per way a request runs:
- `WholePlan`: one leg runs the whole request, on an aggregated worker (`PlanPath.AGGREGATED`) or, in
  conditional mode, on a decode worker (`PlanPath.LOCAL`);
- `SplitPlan`: a context-only leg on a prefill worker, then a generation leg on a decode worker that pulls
  its KV session (`PlanPath.DISAGGREGATED`).

`Coordinator.plan()` (flow/coordinator.py) makes one with `planned()`; `RequestFlow` (flow/request_flow.py)
runs it. Both are frozen: the API request is a frozen value, the workers are the pool's (held by identity),
the KV-aware ranks a tuple. The engine request `full` is a protobuf message, which cannot be frozen: nothing
writes to it after planning (every leg is a copy, orchestrator/kv/legs.py and decode/legs.py).
"""

from __future__ import annotations

import enum
from typing import ClassVar

import attrs

from orchestrator.convert import ApiRequest
from orchestrator.engine import WorkerCapabilities
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.roles import Role
from orchestrator.workers.pool import Worker


class PlanPath(enum.StrEnum):
    """How a request is served; also the `path` label of its metrics (orchestrator/metrics.py)."""

    AGGREGATED = "aggregated"
    DISAGGREGATED = "disaggregated"
    LOCAL = "local"

    @property
    def roles(self) -> tuple[Role, ...]:
        """The roles of the workers its legs run on, in the order the legs run."""
        return _ROLES[self]


# Every `PlanPath.X` is a slow attribute lookup on Python 3.11 (about 0.2 us: EnumType.__getattr__, gone in
# 3.12); the code a request runs compares with these names instead.
AGGREGATED, DISAGGREGATED, LOCAL = PlanPath.AGGREGATED, PlanPath.DISAGGREGATED, PlanPath.LOCAL
_ROLES = {AGGREGATED: (Role.AGGREGATED,), DISAGGREGATED: (Role.PREFILL, Role.DECODE), LOCAL: (Role.DECODE,)}
WHOLE_PATHS = (AGGREGATED, LOCAL)


@attrs.frozen(kw_only=True)
class _Planned:
    request_id: str
    api: ApiRequest
    full: g.GenerateRequest  # the whole request as the engine takes it; the legs are built from it
    prompt_tokens: int  # text tokens; images add more engine-side
    # KV-aware routing: the attention-DP rank to ask of a worker that holds the prompt's prefix there (prefill
    # or whole legs), as (worker, rank) pairs
    target_ranks: tuple[tuple[Worker, int], ...] = ()
    # what its workers advertised, in the order of `workers`: the frontend reads the output parsers from them
    caps: tuple[WorkerCapabilities, ...] = ()

    def target_rank(self, worker: Worker) -> int | None:
        """The rank to ask of `worker`: the planner's, if it routed there by the prefix (a retry or a migration
        to another worker asks for none)."""
        for held, rank in self.target_ranks:
            if held is worker:
                return rank
        return None


@attrs.frozen(kw_only=True)
class WholePlan(_Planned):
    path: PlanPath = attrs.field(validator=attrs.validators.in_(WHOLE_PATHS))
    worker: Worker

    @property
    def workers(self) -> tuple[Worker, ...]:
        return (self.worker,)


@attrs.frozen(kw_only=True)
class SplitPlan(_Planned):
    path: ClassVar[PlanPath] = PlanPath.DISAGGREGATED
    prefill: Worker
    decode: Worker

    @property
    def workers(self) -> tuple[Worker, ...]:
        return (self.prefill, self.decode)


Plan = WholePlan | SplitPlan


def planned(path: PlanPath, workers: tuple[Worker, ...], *, request_id: str, api: ApiRequest, full: g.GenerateRequest,
            prompt_tokens: int, target_ranks: tuple[tuple[Worker, int], ...] = (),
            caps: tuple[WorkerCapabilities, ...] = ()) -> Plan:
    """The plan of `path` on `workers` (one per role of the path, in its order; else a ValueError)."""
    if path is DISAGGREGATED:
        prefill, decode = workers
        return SplitPlan(request_id=request_id, api=api, full=full, prompt_tokens=prompt_tokens,
                         target_ranks=target_ranks, caps=caps, prefill=prefill, decode=decode)
    (worker,) = workers
    return WholePlan(request_id=request_id, api=api, full=full, prompt_tokens=prompt_tokens, target_ranks=target_ranks,
                     caps=caps, path=path, worker=worker)
