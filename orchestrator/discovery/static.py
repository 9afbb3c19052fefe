"""The static registry: the worker list from the YAML, one snapshot, forever."""

from __future__ import annotations

import trio

from orchestrator.discovery.snapshots import Publish, Snapshot, WorkerRegistry, WorkerSpec


class StaticRegistry(WorkerRegistry):
    def __init__(self, workers: dict[str, tuple[str, ...]], model: str = ""):
        self.workers = frozenset(WorkerSpec(address=a, role=role, model=model)
                                 for role, addresses in workers.items() for a in addresses)

    async def run(self, publish: Publish) -> None:
        publish(Snapshot(self.workers))
        await trio.sleep_forever()
