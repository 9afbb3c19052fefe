"""One small hierarchy for everything a worker can do wrong.

The base, EngineError, and the gRPC status mapping are transport/errors.py's (both transports raise them);
re-exported here with the errors only the engine client raises, so callers import every worker error from
one place. Every error says which worker, which RPC, and why; `code` is always an OpenEngine `ErrorCode`.
"""

from __future__ import annotations

from orchestrator.openengine.v1 import error_pb2
from orchestrator.transport.errors import (
    ERROR_CODE_DRAINING,
    EngineError,
    ErrorCode,
    WorkerUnavailable,
    code_name,
    from_grpc_status,
    from_rpc_error,
    grpc_status_from_number,
)

__all__ = [
    "ERROR_CODE_DRAINING", "ClientClosed", "DiscoveryFailed", "EngineCancelled", "EngineError", "ErrorCode",
    "IncompatibleWorker", "NoLoraSurface", "StreamStalled", "WorkerNotReady", "WorkerUnavailable", "code_name",
    "from_engine_error", "from_grpc_status",
    "from_rpc_error", "grpc_status_from_number",
]


class StreamStalled(EngineError):
    """TensorRT-LLM ended the stream because we did not read it: its servicer's watchdog aborts a request whose
    response waited RESPONSE_STALL_TIMEOUT_SECONDS (30 s) to be read, then sends ERROR_CODE_OVERLOADED
    (retryable=True). The worker is not overloaded and another worker would not help (our reader, or the
    client behind it, was too slow), so it is neither retried elsewhere nor migrated."""


class EngineCancelled(EngineError):
    """The engine ended a request we did not cancel with FINISH_REASON_CANCELLED: both TensorRT-LLM servers map
    the engine's `cancelled` (a server-side abort) and `timeout` to it, revision 1 adding the message "generation
    timed out" (formatting.py `_finish_event`). No OpenAI client knows a "cancelled" finish: it is a failure.
    An abort may be moved to another worker (retryable); a timeout is not, as it would only run out again."""

    def __init__(self, message: str, *, worker: str, timed_out: bool):
        super().__init__(f"the engine cancelled the request: {message}", worker=worker, rpc="Generate",
                         code=ErrorCode.ERROR_CODE_CANCELLED, retryable=not timed_out)
        self.timed_out = timed_out


def engine_cancelled(message: str, *, worker: str) -> EngineCancelled:
    """The failure a Finished(CANCELLED) of a request we did not cancel stands for; `message` its own."""
    timed_out = "timed out" in message or "timeout" in message
    return EngineCancelled(message or "cancelled by the engine (a server-side abort)", worker=worker,
                           timed_out=timed_out)


class IncompatibleWorker(EngineError):
    """The worker speaks a schema revision we cannot use."""


class NoLoraSurface(EngineError):
    """The worker does not serve the LoRA RPCs: revision-1 TensorRT-LLM answers them UNIMPLEMENTED (it has no
    runtime adapter load), the sibling server FAILED_PRECONDITION when it was started without a LoRA config.
    A fact about the worker, not a fault: it stays routable for requests without an adapter."""


class WorkerNotReady(EngineError):
    """The worker did not become ready before the start-up deadline."""


class DiscoveryFailed(EngineError):
    """Capability discovery (ServerInfo + ModelInfo) failed; every waiter on that attempt gets one."""


class ClientClosed(EngineError):
    """The engine client was closed (shutdown) while the caller was waiting."""


def from_engine_error(proto: error_pb2.EngineError, *, worker: str, rpc: str) -> EngineError:
    """A terminal GenerateResponse.error as our error."""
    message = proto.message or code_name(proto.code)
    if proto.code == ErrorCode.ERROR_CODE_OVERLOADED:
        return StreamStalled(message, worker=worker, rpc=rpc, code=proto.code, retryable=False)
    return EngineError(message, worker=worker, rpc=rpc, code=proto.code, retryable=proto.retryable)
