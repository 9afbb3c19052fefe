"""The registry interface: a task that publishes complete snapshots of the worker set.

Snapshots, not deltas, so a consumer can always resynchronise by diffing; `healthy` is False while
the registry cannot reach its source (the last snapshot stays in service, /health says degraded).
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import attrs


@attrs.frozen
class WorkerSpec:
    address: str  # grpc://host:port
    role: str  # aggregated | prefill | decode
    model: str = ""
    instance_id: str = ""


@attrs.frozen
class Snapshot:
    workers: frozenset[WorkerSpec]
    healthy: bool = True
    detail: str = ""


Publish = Callable[[Snapshot], None]


class WorkerRegistry(abc.ABC):
    @abc.abstractmethod
    async def run(self, publish: Publish) -> None:
        """Publish the current worker set, then every change, until cancelled."""
