"""Has this worker restarted (a new ServerInfo.instance_id)? One watch per worker, read by whoever must start
over when it does.

A restart faster than one health interval shows only as a new instance id. The pool (pool.py) is the one
reader of a worker's identity: it reads ServerInfo on its own schedule, rediscovers the capabilities of a
new instance, and reports each instance id it sees here (`saw`). The KV event feed (kv_events.py), which
must clear and subscribe again after a restart (the engine's cache is empty), waits on the watch
(`changed_from`) instead of polling ServerInfo itself. A feed run without a pool (tests, tools) drives its
own watch with `poll`, which reads ServerInfo as the pool would.
"""

from __future__ import annotations

import logging

import trio

from orchestrator.engine import EngineError

log = logging.getLogger(__name__)


class InstanceWatch:
    def __init__(self) -> None:
        self.instance_id: str | None = None  # the latest one seen; None before any
        self._changed = trio.Event()  # set when instance_id changes, then replaced

    def saw(self, instance_id: str) -> None:
        """The worker was seen running `instance_id` (empty: a worker without instance ids, ignored)."""
        if instance_id and instance_id != self.instance_id:
            self.instance_id = instance_id
            self._changed.set()
            self._changed = trio.Event()

    async def changed_from(self, instance_id: str) -> None:
        """Returns once the worker has been seen running an instance other than `instance_id`."""
        while self.instance_id is None or self.instance_id == instance_id:
            await self._changed.wait()

    async def check(self, client, timeout: float) -> None:
        """Read `client`'s ServerInfo once: a new instance's capabilities are discovered again (the cached
        ones are the old instance's), and the instance is seen here."""
        try:
            info = await client.server_info(timeout=timeout)
        except EngineError:
            return  # a dead worker is the health check's to judge; a lost stream shows itself
        cached = client.cached_capabilities
        if cached is not None and cached.instance_id and info.instance_id != cached.instance_id:
            log.info("worker %s restarted: instance %s -> %s; reading its capabilities again", client.name,
                     cached.instance_id, info.instance_id)
            client.forget_capabilities()
        self.saw(info.instance_id)

    async def poll(self, client, interval: float) -> None:
        """check() every `interval` seconds, until cancelled (a feed without the pool)."""
        while True:
            await trio.sleep(interval)
            await self.check(client, timeout=max(1.0, interval))
