"""The OpenEngine v1 client the orchestrator's stages call, on trio: one EngineClient per worker.

- client: EngineClient (generate, abort, health, server/model info, load, LoRA adapters, connect-until-ready) over one
  transport/ WorkerChannel, and GenerateStream, the events of one Generate call
- events: typed Generate events, decoded from GenerateResponse messages; token_message: the token ids of
  the common one-token message, read from its bytes without a protobuf parse
- capabilities: WorkerCapabilities and the single-flight discovery cache
- errors: one exception hierarchy for every worker failure, whichever transport carried the call (its base,
  EngineError, is transport/errors.py's: the transports raise it)
Below it, transport/ carries the calls: our HTTP/2 client on trio, or grpc.aio on the loop thread.
"""

from orchestrator.engine.capabilities import WorkerCapabilities
from orchestrator.engine.client import CLIENT_SCHEMA_REVISION, EngineClient, GenerateStream, check_revision
from orchestrator.engine.errors import (
    ClientClosed,
    DiscoveryFailed,
    EngineError,
    ErrorCode,
    IncompatibleWorker,
    NoLoraSurface,
    WorkerNotReady,
    WorkerUnavailable,
)
from orchestrator.engine.events import Failed, Finished, PrefillReady, Tokens, Usage
from orchestrator.transport.loop_thread import LoopThread

__all__ = [
    "CLIENT_SCHEMA_REVISION", "ClientClosed", "DiscoveryFailed", "EngineClient", "EngineError", "ErrorCode",
    "Failed", "Finished", "GenerateStream", "IncompatibleWorker", "LoopThread", "NoLoraSurface", "PrefillReady",
    "Tokens", "Usage", "WorkerCapabilities", "WorkerNotReady", "WorkerUnavailable", "check_revision",
]
