"""Connecting to etcd: one endpoint, plaintext or TLS (with a client certificate for mTLS).

Shared by the registry that watches the workers (discovery/etcd.py) and by the LeaseKeeper that keeps one
worker registered (discovery/lease_keeper.py).
"""

from __future__ import annotations

from urllib.parse import urlsplit

import aetcd

from orchestrator.tls import TlsMaterial


def parse_etcd_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if not parts.hostname:
        raise ValueError(f"etcd URL {url!r} has no host")
    return parts.hostname, parts.port or 2379


class _TlsEtcdClient(aetcd.Client):
    """aetcd opens plaintext channels only; this one opens a TLS channel and sets up the same stubs.

    Mirrors aetcd 1.x `Client.connect` (no etcd user auth: use client certificates instead); the TLS
    discovery test runs it against a real etcd that requires client certificates.
    """

    def __init__(self, *, tls: TlsMaterial, **kwargs):
        super().__init__(**kwargs)
        self._tls = tls

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        from aetcd import rpc, watcher

        options = [*self._options.items(), *self._tls.grpc_options()]
        self.channel = rpc.secure_channel(f"{self._host}:{self._port}", self._tls.grpc_credentials(), options=options)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
        self._connected.set()


def new_client(url: str, timeout: float = 3.0, tls: TlsMaterial | None = None) -> aetcd.Client:
    """A client for one etcd endpoint; TLS when `tls` is given or the URL is https://."""
    host, port = parse_etcd_url(url)
    if tls is None and url.startswith("https://"):
        tls = TlsMaterial()
    if tls is None:
        return aetcd.Client(host=host, port=port, timeout=timeout)
    return _TlsEtcdClient(host=host, port=port, timeout=timeout, tls=tls)
