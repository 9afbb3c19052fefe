"""The errors a worker call fails with, whichever transport carried it: EngineError and the one mapping of a
gRPC status to it.

Every error says which worker, which RPC, and why; `code` is always an OpenEngine `ErrorCode` so
callers (the HTTP frontend) map one thing to statuses, whatever the failure came from. They live here, below
the engine client, because both transports raise them; engine/errors.py adds the errors only the engine
client raises (a stalled stream, an incompatible or unready worker, a failed discovery, a closed client) and
re-exports these, so `orchestrator.engine` stays the one place callers import them from.
"""

from __future__ import annotations

import grpc

from orchestrator.openengine.v1 import error_pb2

ErrorCode = error_pb2.ErrorCode
# Not an openengine v0.1.0 code: the sibling server's ERROR_CODE_DRAINING read into our numbering
# (engine/numbering.py), at a number no schema uses so that it never collides with a code a worker sends.
# The worker stopped taking requests: another one may.
ERROR_CODE_DRAINING = 1011

# gRPC status -> (ErrorCode, retryable). A transport failure before any response is retryable
# elsewhere; an engine that says INVALID_ARGUMENT will say it again.
_STATUS_MAP: dict[grpc.StatusCode, tuple[int, bool]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (ErrorCode.ERROR_CODE_INVALID_ARGUMENT, False),
    grpc.StatusCode.OUT_OF_RANGE: (ErrorCode.ERROR_CODE_INVALID_ARGUMENT, False),
    grpc.StatusCode.NOT_FOUND: (ErrorCode.ERROR_CODE_MODEL_NOT_FOUND, False),
    grpc.StatusCode.UNIMPLEMENTED: (ErrorCode.ERROR_CODE_UNSUPPORTED_FEATURE, False),
    # Not a role mismatch: TensorRT-LLM's sibling server says FAILED_PRECONDITION for an adapter it has not
    # loaded. The request cannot run as asked; Dynamo's sidecar reports it as invalid too.
    grpc.StatusCode.FAILED_PRECONDITION: (ErrorCode.ERROR_CODE_INVALID_ARGUMENT, False),
    grpc.StatusCode.ALREADY_EXISTS: (ErrorCode.ERROR_CODE_DUPLICATE_REQUEST, False),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (ErrorCode.ERROR_CODE_OVERLOADED, True),
    grpc.StatusCode.UNAVAILABLE: (ErrorCode.ERROR_CODE_INTERNAL, True),
    grpc.StatusCode.DEADLINE_EXCEEDED: (ErrorCode.ERROR_CODE_INTERNAL, True),
    grpc.StatusCode.CANCELLED: (ErrorCode.ERROR_CODE_CANCELLED, False),
}


def code_name(code: int) -> str:
    if code == ERROR_CODE_DRAINING:
        return "ERROR_CODE_DRAINING"
    try:
        return ErrorCode.Name(code)
    except ValueError:
        return f"ERROR_CODE_{code}"


class EngineError(Exception):
    """A worker RPC failed. `code` is an OpenEngine ErrorCode; `retryable` says another try may work."""

    def __init__(
        self,
        message: str,
        *,
        worker: str,
        rpc: str,
        code: int = ErrorCode.ERROR_CODE_INTERNAL,
        retryable: bool = False,
        grpc_status: grpc.StatusCode | None = None,
    ):
        self.message = message
        self.worker = worker
        self.rpc = rpc
        self.code = code
        self.retryable = retryable
        self.grpc_status = grpc_status
        super().__init__(message)

    def __str__(self) -> str:
        status = f" [{self.grpc_status.name}]" if self.grpc_status is not None else ""
        retry = " (retryable)" if self.retryable else ""
        return f"worker {self.worker} {self.rpc}: {code_name(self.code)}{status}{retry}: {self.message}"

    @property
    def code_name(self) -> str:
        return code_name(self.code)

    @property
    def known_code(self) -> bool:
        return self.code == ERROR_CODE_DRAINING or self.code in ErrorCode.values()


class WorkerUnavailable(EngineError):
    """The worker could not be reached, or the call timed out."""


def from_rpc_error(exc: grpc.aio.AioRpcError, *, worker: str, rpc: str) -> EngineError:
    error = from_grpc_status(exc.code(), exc.details(), worker=worker, rpc=rpc)
    error.__cause__ = exc
    return error


_STATUS_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}


def grpc_status_from_number(number: int) -> grpc.StatusCode:
    """The StatusCode a `grpc-status` trailer names (an unknown number is UNKNOWN, as gRPC says)."""
    return _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def from_grpc_status(status: grpc.StatusCode, details: str | None, *, worker: str, rpc: str) -> EngineError:
    """A failed call's gRPC status and message as our error: one mapping for every transport."""
    code, retryable = _STATUS_MAP.get(status, (ErrorCode.ERROR_CODE_INTERNAL, False))
    details = details or status.name
    if status == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        # The worker's gRPC message limit, not its load: the same request will never fit (big data: images).
        code, retryable = ErrorCode.ERROR_CODE_INVALID_ARGUMENT, False
        details = f"the request is larger than the worker's gRPC message limit ({details}); send smaller images"
    kind = (
        WorkerUnavailable
        if status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        else EngineError
    )
    return kind(details, worker=worker, rpc=rpc, code=code, retryable=retryable, grpc_status=status)
