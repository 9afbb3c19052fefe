"""Keeping one worker registered in etcd under a lease (asyncio; aetcd is an asyncio library).

Used by the `orchestrator register` sidecar (on the orchestrator's asyncio loop thread) and by
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
from pathlib import Path
from urllib.parse import urlsplit

import aetcd
import attrs
import grpc

from orchestrator.log import RateLimitedLog, cause_chain

log = logging.getLogger(__name__)
POLL_S = 0.1


def parse_etcd_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if not parts.hostname:
        raise ValueError(f"etcd URL {url!r} has no host")
    return parts.hostname, parts.port or 2379


@attrs.frozen
class EtcdTls:
    """TLS to etcd (PEM bytes): the CA that signed etcd's certificate (None: the system's), ours for mTLS."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    @classmethod
    def from_files(cls, ca_file: str | None, cert_file: str | None, key_file: str | None) -> EtcdTls:
        def read(name: str | None) -> bytes | None:
            return None if name is None else Path(name).read_bytes()
        return cls(read(ca_file), read(cert_file), read(key_file))


class _TlsEtcdClient(aetcd.Client):
    """aetcd opens plaintext channels only; this one opens a TLS channel and sets up the same stubs.

    Mirrors aetcd 1.x `Client.connect` (no etcd user auth: use client certificates instead); the TLS
    discovery test runs it against a real etcd that requires client certificates.
    """

    def __init__(self, *, tls: EtcdTls, **kwargs):
        super().__init__(**kwargs)
        self._tls = tls

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        from aetcd import rpc, watcher

        credentials = grpc.ssl_channel_credentials(self._tls.ca, self._tls.key, self._tls.cert)
        self.channel = rpc.secure_channel(f"{self._host}:{self._port}", credentials, options=self._options.items())
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
        self._connected.set()


def new_client(url: str, timeout: float = 3.0, tls: EtcdTls | None = None) -> aetcd.Client:
    """A client for one etcd endpoint; TLS when `tls` is given or the URL is https://."""
    host, port = parse_etcd_url(url)
    if tls is None and url.startswith("https://"):
        tls = EtcdTls()
    if tls is None:
        return aetcd.Client(host=host, port=port, timeout=timeout)
    return _TlsEtcdClient(host=host, port=port, timeout=timeout, tls=tls)


class Registration:
    def __init__(self, etcd_url: str, key: str, value: bytes, *, ttl: int = 10,
                 is_healthy: Callable[[], bool] = lambda: True, tls: EtcdTls | None = None):
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
