"""Carrying out the KV rule: free a session no decode leg will pull.

Pull it with a one-token release leg on a decode worker: the request's own, else any other routable one.
Never by Control.Abort(kv_session): an answered abort is no proof that the engine freed the blocks
(orchestrator.kv.lease). Always shielded from the request's cancellation and bounded by
limits.kv_cleanup_timeout_s.
"""

from __future__ import annotations

import logging

import trio

from orchestrator import tracing
from orchestrator.engine import EngineError, Failed
from orchestrator.errors import NoWorkerAvailable
from orchestrator.kv.handoff import produced_by_context
from orchestrator.kv.lease import KvLease
from orchestrator.kv.legs import release_leg
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.roles import Role

log = logging.getLogger(__name__)


class KvReleaser:
    def __init__(self, pool, metrics, cleanup_timeout_s: float):
        self.pool = pool
        self.metrics = metrics
        self.cleanup_timeout_s = cleanup_timeout_s

    async def release_unpulled(self, lease: KvLease, full: g.GenerateRequest, decode_worker) -> None:
        """The session will not be read by any decode leg (cancelled, failed, retries exhausted, refused)."""
        if lease.settled:
            return
        if not produced_by_context(lease.session):
            # No context worker holds it (the sibling server's handoff of a cancelled context phase): a release
            # leg would only wait out the decode engine's KV receive timeout, stalling it.
            log.info("kv session %s on %s is not pulled: it names no session a context phase produced",
                     lease.session.session_id, lease.prefill_worker.address)
            lease.released = True
            return
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + self.cleanup_timeout_s
            candidates = [decode_worker] if decode_worker is not None and decode_worker.routable else []
            # a leg with a LoRA adapter only where it is loaded: elsewhere it is refused, and a base-model pull would
            # cache the adapter's KV as the base model's
            adapter = full.lora_name
            holds = (lambda w: w.adapters.holds(adapter)) if adapter else None
            try:
                candidates.append(self.pool.pick(Role.DECODE, exclude=tuple(candidates), accepts=holds))
            except NoWorkerAvailable:
                pass
            leg = release_leg(full, lease.session)
            for worker in candidates:
                if await self._pull(worker, leg, lease):
                    return
        log.warning("kv session %s on %s could not be released (%s): its blocks stay held until the worker's "
                    "transfer timeout or restart", lease.session.session_id, lease.prefill_worker.address,
                    "timed out" if scope.cancelled_caught else "no decode worker could pull it")

    async def _pull(self, worker, leg: g.GenerateRequest, lease: KvLease) -> bool:
        with self.pool.lease(worker), tracing.leg_span("kv_release", worker.address, leg.request_id) as span:
            span.set("orchestrator.kv_session", lease.session.session_id)
            try:
                async with worker.client.generate(leg, metadata=span.metadata) as stream:
                    while batch := await stream.next_batch():
                        failed = next((e for e in batch if isinstance(e, Failed)), None)
                        if failed is not None:
                            raise failed.error
            except EngineError as exc:
                log.warning("KV release of session %s via %s failed: %s", lease.session.session_id, worker.address,
                            exc)
                return False
        lease.released = True
        self.metrics.kv_cleanups.labels("decode_pull").inc()
        return True
