"""A pool worker's life as a pure state machine: states, events, and one transition table.

The pool's monitor (orchestrator.workers.pool) turns health checks, capability checks, failed requests and
registry changes into events; this table alone decides the next state. Only READY workers get
requests. REMOVING is final: the worker finishes its in-flight requests and is then closed.
"""

from __future__ import annotations

import enum


class WorkerState(enum.StrEnum):
    CONNECTING = "connecting"  # just added; its first health check has not answered yet
    READY = "ready"  # healthy, and its capabilities match its registration (or could not be read yet)
    # A health check failed or said NOT_READY/STARTING, or a request could not reach it. A TensorRT-LLM worker
    # that drains or shuts down says NOT_READY: openengine v0.1.0, which it serves, has no DRAINING state.
    UNHEALTHY = "unhealthy"
    MISCONFIGURED = "misconfigured"  # healthy, but its declared role or its models contradict the registration
    REMOVING = "removing"  # gone from the registry


class WorkerEvent(enum.Enum):
    HEALTHY = "healthy"  # health READY/DEGRADED and identity fine
    IDENTITY_MISMATCH = "identity_mismatch"  # health fine, identity contradicts the registration
    UNHEALTHY = "unhealthy"  # a health check failed or reported a not-ready state
    UNREACHABLE = "unreachable"  # a request could not reach the worker
    REMOVED = "removed"  # the registry no longer lists it


_TARGET = {WorkerEvent.HEALTHY: WorkerState.READY, WorkerEvent.IDENTITY_MISMATCH: WorkerState.MISCONFIGURED,
           WorkerEvent.UNHEALTHY: WorkerState.UNHEALTHY,
           WorkerEvent.UNREACHABLE: WorkerState.UNHEALTHY, WorkerEvent.REMOVED: WorkerState.REMOVING}
TRANSITIONS: dict[tuple[WorkerState, WorkerEvent], WorkerState] = {
    (state, event): (WorkerState.REMOVING if state is WorkerState.REMOVING else target)
    for state in WorkerState for event, target in _TARGET.items()
}


def next_state(state: WorkerState, event: WorkerEvent) -> WorkerState:
    return TRANSITIONS[(state, event)]


def rereads_capabilities(previous: WorkerState, event: WorkerEvent) -> bool:
    """Coming back healthy from a state a restart may hide behind: its build, role or window may differ."""
    return event is WorkerEvent.HEALTHY and previous in (WorkerState.UNHEALTHY, WorkerState.MISCONFIGURED)
