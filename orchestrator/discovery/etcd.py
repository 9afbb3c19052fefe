"""EtcdRegistry: the worker pool from etcd, by lease + watch.

Initial `get_prefix`, then a watch from the next revision. When the watch breaks (etcd down, a
compaction, a network cut) it publishes the last known pool as unhealthy (the pool keeps serving
it, /health says degraded), reconnects with backoff, takes a fresh snapshot and publishes it whole:
the pool diffs it, so workers that left while etcd was unreachable are dropped, new ones added.

aetcd is asyncio: it runs on the orchestrator's asyncio loop thread, next to the engine clients
(grpc.aio wants one loop per process), and watch events reach trio through a StreamInbox.
"""

from __future__ import annotations

import asyncio
import logging

import trio

from orchestrator.discovery import keys
from orchestrator.discovery.etcd_client import new_client
from orchestrator.discovery.snapshots import Publish, Snapshot, WorkerRegistry, WorkerSpec
from orchestrator.log import RateLimitedLog, cause_chain
from orchestrator.tls import TlsMaterial
from orchestrator.transport.loop_thread import LoopThread

log = logging.getLogger(__name__)
_closing: set[asyncio.Future] = set()  # clients being closed on the loop thread


class WatchBroken(Exception):
    pass


class ForeignModels:
    """The models an orchestrator serves, shared by its registries (one per model), which all watch the whole
    namespace: a worker registered under a model none of them serves is ignored, with one log line per model
    name for the process's life (not one per event, nor per registry)."""

    def __init__(self, served: frozenset[str] | set[str]):
        self.served = frozenset(served)
        self.reported: set[str] = set()

    def ignored(self, model: str, key: str) -> None:
        if model in self.served or model in self.reported:
            return
        self.reported.add(model)
        log.warning("etcd: ignoring workers registered for model %r (first: %s): this orchestrator serves %s",
                    model, key, ", ".join(sorted(self.served)))


class EtcdRegistry(WorkerRegistry):
    def __init__(self, endpoints: tuple[str, ...], namespace: str, *, model: str, loop_thread: LoopThread,
                 max_backoff: float = 2.0, probe_interval_s: float = 2.0, tls: TlsMaterial | None = None,
                 foreign: ForeignModels | None = None):
        if not endpoints:
            raise ValueError("etcd discovery needs at least one endpoint")
        self.endpoints = endpoints
        self.tls = tls
        # The whole namespace is watched, its other models' workers skipped (and named once: `foreign`)
        self.prefix = keys.workers_prefix(namespace)
        self.model = model
        self.foreign = foreign or ForeignModels({model})
        self._loop_thread = loop_thread
        self._max_backoff = max_backoff
        self._entries: dict[str, WorkerSpec] = {}
        self._retry_log = RateLimitedLog(log, interval=10.0)
        self.probe_interval_s = probe_interval_s

    async def run(self, publish: Publish) -> None:
        backoff = 0.1
        attempt = 0
        while True:
            endpoint = self.endpoints[attempt % len(self.endpoints)]
            attempt += 1
            try:
                await self._session(endpoint, publish)
            except Exception as exc:  # noqa: BLE001 - etcd client errors of every kind: publish degraded, retry
                publish(Snapshot(frozenset(self._entries.values()), healthy=False,
                                 detail=f"etcd {endpoint} unreachable: {cause_chain(exc)}"))
                self._retry_log("etcd %s: watch of %s lost, resynchronising in %.1f s: %s", endpoint, self.prefix,
                                backoff, cause_chain(exc))
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self._max_backoff)
            else:  # pragma: no cover - _session only returns by raising
                backoff = 0.1

    async def _session(self, endpoint: str, publish: Publish) -> None:
        loop_thread = self._loop_thread
        client = new_client(endpoint, timeout=3.0, tls=self.tls)
        prefix = self.prefix.encode()
        inbox = loop_thread.new_inbox()
        holder: dict = {}
        try:
            async def snapshot():
                await client.connect()
                return await client.get_prefix(prefix)

            result = await loop_thread.run(snapshot)
            entries = {}
            for kv in result.kvs:
                key = kv.key.decode()
                if not self._ours(key):
                    continue
                try:
                    entries[key] = keys.parse_entry(key, kv.value)
                except keys.BadEntry as exc:
                    log.warning("etcd: ignoring %s", exc)
            self._entries = entries
            publish(Snapshot(frozenset(entries.values())))
            log.info("etcd %s: %d workers under %s at revision %d", endpoint, len(entries), self.prefix,
                     result.header.revision)

            async def pump():
                try:
                    watch = await client.watch_prefix(prefix, start_revision=result.header.revision + 1)
                    holder["watch"] = watch
                    async for event in watch:
                        inbox.put(event)
                    inbox.close(WatchBroken("the watch stream ended"))
                except asyncio.CancelledError:
                    inbox.close(WatchBroken("watch cancelled"))
                    raise
                except Exception as exc:  # noqa: BLE001 - delivered to the trio side
                    inbox.close(exc)

            loop_thread.call_soon(lambda: holder.setdefault("task", asyncio.ensure_future(pump())))
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._probe, client, endpoint)
                    await self._follow(inbox, publish)
            except BaseExceptionGroup as group:  # the probe's or the watch's news, not a group of them
                raise (group.exceptions[0] if len(group.exceptions) == 1 else group) from None
        finally:
            def stop():
                task = holder.get("task")
                if task is not None:
                    task.cancel()
                closing = asyncio.ensure_future(client.close())
                _closing.add(closing)  # the loop holds tasks weakly: keep this one until it is done
                closing.add_done_callback(_closing.discard)

            loop_thread.call_soon(stop)

    def _ours(self, key: str) -> bool:
        """Whether a key under the namespace is a worker of this registry's model (keys.py has the layout)."""
        rest = key[len(self.prefix):]
        if rest.startswith(self.model + "/"):
            return True
        self.foreign.ignored(rest.split("/", 1)[0], key)
        return False

    async def _probe(self, client, endpoint: str) -> None:
        """A frozen etcd (SIGSTOP, a hung disk) keeps its TCP connections open, so the watch never breaks:
        ask it something small every probe interval, and count no answer as a broken watch."""
        while True:
            await trio.sleep(self.probe_interval_s)
            with trio.move_on_after(self.probe_interval_s) as waited:
                try:
                    await self._loop_thread.run(client.status)
                except Exception as exc:  # any failure to answer is the same news
                    raise WatchBroken(f"etcd {endpoint} failed a status request: {cause_chain(exc)}") from exc
            if waited.cancelled_caught:
                raise WatchBroken(f"etcd {endpoint} did not answer a status request within "
                                  f"{self.probe_interval_s:g} s")

    async def _follow(self, inbox, publish: Publish) -> None:
        while True:
            events = await inbox.get_batch()
            if not events:
                raise WatchBroken("the watch stream ended")
            changed = False
            for event in events:
                key = event.kv.key.decode()
                if not self._ours(key):
                    continue
                if event.kind == "PUT":
                    try:
                        self._entries[key] = keys.parse_entry(key, event.kv.value)
                        changed = True
                    except keys.BadEntry as exc:
                        log.warning("etcd: ignoring %s", exc)
                elif self._entries.pop(key, None) is not None:
                    changed = True
            if changed:
                publish(Snapshot(frozenset(self._entries.values())))
