"""A scripted worker registry, for the pool tests of both layers."""

from collections.abc import Callable

import trio

from orchestrator.discovery.snapshots import Snapshot, WorkerRegistry


class ScriptedRegistry(WorkerRegistry):
    """Publishes what the test tells it to."""

    publish: Callable[[Snapshot], None]  # the pool's, once it runs this registry

    def __init__(self, first: Snapshot):
        self.first = first

    async def run(self, publish: Callable[[Snapshot], None]) -> None:
        self.publish = publish
        publish(self.first)
        await trio.sleep_forever()
