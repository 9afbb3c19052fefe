"""KV-aware routing's parts, built once from the configuration (docs/kv-routing.md) and handed to the pool:
the one place that says which roles route kv_aware and which workers' KV events are followed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from orchestrator.workers.kv_index import KvIndex

if TYPE_CHECKING:
    from orchestrator.config import Config
    from orchestrator.workers.kv_events import KvEventFeed


@attrs.frozen
class KvRouting:
    index: KvIndex  # what every kv_aware role's policy reads
    feed: KvEventFeed | None  # the KV events into it (None: every worker approximate)
    roles: tuple[str, ...]  # the roles routed kv_aware (others get no index, no keys)
    follow_roles: tuple[str, ...]  # the roles whose workers' KV events the feed follows


def kv_routing(config: Config, metrics=None) -> KvRouting | None:
    """The index, the event feed and the roles, or None when no role the mode runs routes kv_aware: nothing
    runs for it. The feed follows the kv_aware roles' workers, and in conditional mode the decode workers too
    (a prompt may prefill on the decode worker holding its prefix). The caller closes the feed after the pool."""
    roles = config.kv_aware_roles
    if not roles:
        return None
    from orchestrator.workers.kv_events import KvEventFeed  # (pyzmq: only where KV events may be followed)

    index = KvIndex(ttl_s=config.routing.kv_aware.approximate_ttl_s)
    follow = (*roles, "decode") if config.mode == "conditional" and "prefill" in roles else roles
    return KvRouting(index, KvEventFeed(index, metrics=metrics), roles, follow)
