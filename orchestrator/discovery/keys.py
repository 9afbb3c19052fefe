"""The etcd key layout and value codec (pure).

    {namespace}/workers/{model}/{role}/{instance_id}  ->  JSON value:
    {"address": "grpc://10.0.0.5:50051", "role": "decode", "model": "llama-3-8b",
     "instance_id": "trtllm-decode-7f9c", "schema_revision": 1, "registered_at": "2026-12-02T16:00:00Z"}

Every key is attached to its worker's lease, so it vanishes when the worker (or its sidecar) stops
keeping the lease alive. The value is plain JSON so `etcdctl get --prefix NS/workers/` is readable.
"""

from __future__ import annotations

import json
import time

from orchestrator.discovery.snapshots import WorkerSpec
from orchestrator.roles import ROLES


def workers_prefix(namespace: str, model: str | None = None) -> str:
    base = f"{namespace.rstrip('/')}/workers/"
    return base + (f"{model}/" if model else "")


def worker_key(namespace: str, model: str, role: str, instance_id: str) -> str:
    for name, value in (("model", model), ("role", role), ("instance_id", instance_id)):
        if not value or "/" in value:
            raise ValueError(f"{name} must be non-empty and contain no '/', got {value!r}")
    return f"{workers_prefix(namespace, model)}{role}/{instance_id}"


def worker_value(spec: WorkerSpec, *, schema_revision: int, now: float | None = None) -> bytes:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if now is None else now))
    return json.dumps({"address": spec.address, "role": spec.role, "model": spec.model,
                       "instance_id": spec.instance_id, "schema_revision": schema_revision,
                       "registered_at": stamp}, sort_keys=True).encode()


class BadEntry(ValueError):
    pass


def parse_entry(key: str, value: bytes) -> WorkerSpec:
    """A registry entry -> WorkerSpec; BadEntry says why an entry is unusable."""
    try:
        data = json.loads(value)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadEntry(f"{key}: value is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadEntry(f"{key}: value is not a JSON object")
    address, role = data.get("address"), data.get("role")
    if not isinstance(address, str) or not address.startswith("grpc://"):
        raise BadEntry(f"{key}: address must be grpc://HOST:PORT, got {address!r}")
    if role not in ROLES:
        raise BadEntry(f"{key}: role must be one of {', '.join(ROLES)}, got {role!r}")
    return WorkerSpec(address=address, role=role, model=str(data.get("model", "")),
                      instance_id=str(data.get("instance_id", "")))
