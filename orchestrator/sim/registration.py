"""The simulated worker announces itself in etcd through the same LeaseKeeper as `orchestrator register`
(`orchestrator sim-worker --etcd URL`), on the simulator's own asyncio loop."""

from __future__ import annotations

import asyncio
import logging

from orchestrator.discovery import keys
from orchestrator.discovery.lease_keeper import LeaseKeeper
from orchestrator.discovery.snapshots import WorkerSpec
from orchestrator.openengine.v1 import lifecycle_pb2

log = logging.getLogger("orchestrator.sim")
HS = lifecycle_pb2.HealthState


def sim_self_registration(etcd_url: str, namespace: str, role: str, model: str, ttl: int = 10):
    """The sim worker's on_ready hook: register through the same LeaseKeeper (in the sim's loop)."""

    async def on_ready(worker, address: str) -> None:
        spec = WorkerSpec(address=address, role=role, model=model, instance_id=worker.instance_id)
        key = keys.worker_key(namespace, model, role, worker.instance_id)
        value = keys.worker_value(spec, schema_revision=worker.config.schema_revision)
        registration = LeaseKeeper(etcd_url, key, value, ttl=ttl,
                                   is_healthy=lambda: worker.health_state() == HS.HEALTH_STATE_READY)
        worker.background.append(asyncio.ensure_future(registration.run()))
        deadline = asyncio.get_running_loop().time() + 30
        while not registration.registered and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        if not registration.registered:
            log.warning("not yet registered in etcd %s; continuing, registration keeps retrying", etcd_url)

    return on_ready
