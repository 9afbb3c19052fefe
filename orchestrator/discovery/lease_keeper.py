"""LeaseKeeper: keeping one worker registered in etcd under a lease (asyncio; aetcd is an asyncio library).

Used by the `orchestrator register` sidecar (discovery/sidecar.py, on its asyncio loop thread) and by
`orchestrator sim-worker --etcd` (in the simulator's own loop): one implementation of the rules.
- registered while `is_healthy()` is true: a lease of `ttl` seconds, kept alive every ttl/3;
- withdrawn (lease revoked, key gone) at once when the worker turns unhealthy (NOT_READY: also how a
  draining worker says it);
- kept through an etcd outage: the lease is not given up on a connection error. After a restart etcd
  restores it with a fresh TTL, so the first thing a reconnect does is refresh it; a new lease and key
  are written only when etcd says the old one is gone. Retries back off up to TTL/3 (so the restored
  lease is refreshed before it expires) and are logged with their cause chain, rate-limited;
- on cancellation (SIGTERM) the lease is revoked, so the key disappears immediately.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aetcd

from orchestrator.discovery.etcd_client import new_client
from orchestrator.log import RateLimitedLog, cause_chain
from orchestrator.tls import TlsMaterial

log = logging.getLogger(__name__)
POLL_S = 0.1


class LeaseKeeper:
    """Keeps `key` = `value` in etcd under a lease of `ttl` seconds while `is_healthy()`; `run()` until cancelled."""

    def __init__(self, etcd_url: str, key: str, value: bytes, *, ttl: int = 10,
                 is_healthy: Callable[[], bool] = lambda: True, tls: TlsMaterial | None = None):
        self.etcd_url = etcd_url
        self.tls = tls
        self.key = key.encode()
        self.value = value
        self.ttl = ttl
        self.is_healthy = is_healthy
        self.registered = False
        self.registrations = 0  # how many times the key was (re)written
        self._lease = None
        self._client: aetcd.Client | None = None
        self._retry_log = RateLimitedLog(log, interval=10.0)

    async def run(self) -> None:
        max_backoff = max(POLL_S, min(5.0, self.ttl / 3.0))
        backoff = POLL_S
        try:
            while True:
                try:
                    self._client = new_client(self.etcd_url, tls=self.tls)
                    await self._client.connect()
                    await self._serve(self._client)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - aetcd raises its own errors and grpc's; all mean "retry"
                    self.registered = False  # unknown until the lease is refreshed again (we keep it)
                    self._retry_log("etcd %s: keeping %s registered failed, retrying in %.1f s: %s", self.etcd_url,
                                    self.key.decode(), backoff, cause_chain(exc))
                    await _close(self._client)
                    self._client = None
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, max_backoff)
                else:  # pragma: no cover - _serve returns only by raising
                    backoff = POLL_S
        finally:
            await self._revoke_on_exit()

    async def _revoke_on_exit(self) -> None:
        lease, client = self._lease, self._client
        if lease is not None and client is not None:
            try:
                await asyncio.wait_for(client.revoke_lease(lease.id), 2.0)
                log.info("etcd: revoked lease of %s", self.key.decode())
            except Exception as exc:  # noqa: BLE001 - best effort on the way out; the TTL covers the rest
                log.warning("etcd: could not revoke lease of %s: %s", self.key.decode(), cause_chain(exc))
        self._lease = None
        self.registered = False
        await _close(client)
        self._client = None

    async def _serve(self, client: aetcd.Client) -> None:
        """Register / refresh / withdraw until an etcd error is raised."""
        refresh_every = max(self.ttl / 3.0, POLL_S)
        next_refresh = 0.0  # a lease carried over from before a reconnect is refreshed at once
        loop = asyncio.get_running_loop()
        while True:
            healthy = self.is_healthy()
            if healthy and self._lease is None:
                lease = await client.lease(self.ttl)
                await client.put(self.key, self.value, lease=lease)
                self._lease = lease
                self.registered = True
                self.registrations += 1
                next_refresh = loop.time() + refresh_every
                log.info("etcd: registered %s (lease %x, ttl %d s)", self.key.decode(), lease.id, self.ttl)
            elif not healthy and self._lease is not None:
                lease, self._lease = self._lease, None
                self.registered = False
                await client.revoke_lease(lease.id)
                log.info("etcd: withdrew %s (worker not healthy)", self.key.decode())
            elif self._lease is not None and loop.time() >= next_refresh:
                reply = await client.refresh_lease(self._lease.id)
                if not self.registered:
                    log.info("etcd: %s still registered after reconnecting (lease %x)", self.key.decode(),
                             self._lease.id)
                    self.registered = True
                if getattr(reply, "TTL", 1) <= 0:  # etcd no longer knows the lease
                    log.warning("etcd: lease of %s expired; registering again", self.key.decode())
                    self._lease = None
                    self.registered = False
                    continue
                next_refresh = loop.time() + refresh_every
            await asyncio.sleep(POLL_S)


async def _close(client) -> None:
    if client is not None:
        try:
            await client.close()
        except Exception:  # noqa: BLE001 - closing a broken channel
            pass
