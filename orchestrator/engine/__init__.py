"""The only package that touches grpc.aio and asyncio: a trio-facing OpenEngine v1 client.

- loop_thread: the asyncio (uvloop) thread that runs grpc.aio, and the batched handoff to trio
- client: EngineClient (generate, abort, health, server/model info, load, connect-until-ready)
- capabilities: WorkerCapabilities and the single-flight discovery cache
- events: typed Generate events
- errors: one exception hierarchy for every worker failure
"""

from orchestrator.engine.capabilities import WorkerCapabilities
from orchestrator.engine.client import CLIENT_SCHEMA_REVISION, EngineClient, GenerateStream, check_revision
from orchestrator.engine.errors import (
    ClientClosed,
    DiscoveryFailed,
    EngineError,
    ErrorCode,
    IncompatibleWorker,
    WorkerNotReady,
    WorkerUnavailable,
)
from orchestrator.engine.events import Failed, Finished, PrefillReady, Tokens, Usage
from orchestrator.transport.loop_thread import LoopThread

__all__ = [
    "CLIENT_SCHEMA_REVISION", "ClientClosed", "DiscoveryFailed", "EngineClient", "EngineError", "ErrorCode",
    "Failed", "Finished", "GenerateStream", "IncompatibleWorker", "LoopThread", "PrefillReady", "Tokens",
    "Usage", "WorkerCapabilities", "WorkerNotReady", "WorkerUnavailable", "check_revision",
]
