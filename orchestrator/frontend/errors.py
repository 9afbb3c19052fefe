"""Failures -> client-facing ApiErrors (status, type, code, Retry-After) in the OpenAI error format. Pure.

The only place that knows HTTP statuses: domain errors (orchestrator.errors) and engine errors
(orchestrator.engine.EngineError) are mapped here.
"""

from __future__ import annotations

import re

from orchestrator import errors
from orchestrator.engine import EngineError, WorkerUnavailable
from orchestrator.engine.errors import ERROR_CODE_DRAINING, EngineCancelled, ErrorCode, StreamStalled


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _default_type(status)
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _default_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if 400 <= status < 500:
        return "invalid_request_error"
    if status == 503:
        return "service_unavailable_error"
    return "server_error"


_DOMAIN_STATUS = {errors.InvalidRequest: 400, errors.ModelNotFound: 404, errors.NoWorkerAvailable: 503,
                  errors.WorkerDiscoveryFailed: 503, errors.RequestTimedOut: 504, errors.RateLimited: 429}
_ENGINE_STATUS: dict[int, int] = {
    ErrorCode.ERROR_CODE_INVALID_ARGUMENT: 400,
    ErrorCode.ERROR_CODE_UNSUPPORTED_FEATURE: 400,
    ErrorCode.ERROR_CODE_MODEL_NOT_FOUND: 404,
    ErrorCode.ERROR_CODE_OVERLOADED: 429,  # RESOURCE_EXHAUSTED statuses; an in-stream OVERLOADED is StreamStalled
    ErrorCode.ERROR_CODE_INTERNAL: 502,
    ErrorCode.ERROR_CODE_ROLE_MISMATCH: 502,
    ErrorCode.ERROR_CODE_KV_SESSION_NOT_FOUND: 502,
    ErrorCode.ERROR_CODE_KV_TRANSFER_FAILED: 502,
    ErrorCode.ERROR_CODE_REQUEST_NOT_FOUND: 502,
    ErrorCode.ERROR_CODE_CANCELLED: 502,
}


# Client error bodies never name internal addresses: worker and KV endpoints, gRPC targets. The full error,
# with its worker and cause chain, goes to the log (frontend/app.py) and the operator's /health view.
_ADDRESS = re.compile(r"(?<![\w.])(?:grpc://|ipv[46]:)?(?:\d{1,3}(?:\.\d{1,3}){3}|\[[0-9a-fA-F:]+\]|localhost)"
                      r"(?::\d+)?")


def scrub(message: str) -> str:
    return _ADDRESS.sub("<internal>", message)


def from_domain_error(error: errors.RequestError) -> ApiError:
    status = next((s for kind, s in _DOMAIN_STATUS.items() if isinstance(error, kind)), 500)
    message = scrub(error.message) if status >= 500 else error.message
    return ApiError(status, message, param=error.param, code=error.code, retry_after=error.retry_after)


def from_engine_error(error: EngineError) -> ApiError:
    if isinstance(error, WorkerUnavailable):
        return ApiError(503, f"a worker became unavailable during {error.rpc}", code="worker_unavailable",
                        retry_after=1)
    if isinstance(error, StreamStalled):
        return ApiError(502, "the worker ended the stream because it was not read in time (TensorRT-LLM's stall "
                        "watchdog); the client or the orchestrator read too slowly", code="stream_stalled")
    if isinstance(error, EngineCancelled):  # not ours, so the engine's: 504 when its time for it ran out
        return ApiError(504 if error.timed_out else 502, scrub(error.message),
                        code="engine_timeout" if error.timed_out else "engine_cancelled")
    if error.code == ErrorCode.ERROR_CODE_DUPLICATE_REQUEST:  # leg ids are ours: not the client's fault
        return ApiError(500, scrub(f"the worker already runs a request with this engine request id ({error.message})"
                                   "; engine request ids are the orchestrator's own, so this is an orchestrator bug "
                                   "or two orchestrators sharing an id prefix"), code="duplicate_engine_request")
    # DRAINING: the sibling server stopped taking requests (engine/numbering.py); a code no schema names: the
    # worker failed in a way we cannot read, a bad gateway naming its number (never a 500: we did not fail).
    status = _ENGINE_STATUS.get(error.code, 503 if error.code == ERROR_CODE_DRAINING else 502)
    code = error.code_name.removeprefix("ERROR_CODE_").lower()
    message = error.message if status < 500 else scrub(f"the engine failed ({error.code_name}): {error.message}")
    retry_after = 1 if status in (429, 503) else None
    return ApiError(status, message, code=code, retry_after=retry_after)


def to_api_error(error: Exception) -> ApiError:
    """Any failure of a request, as the client sees it."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, errors.RequestError):
        return from_domain_error(error)
    if isinstance(error, EngineError):
        return from_engine_error(error)
    raise TypeError(f"not a request failure: {error!r}")
