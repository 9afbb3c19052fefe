"""Engine failures -> client-facing ApiErrors (status, type, code, Retry-After). Pure."""

from __future__ import annotations

from orchestrator.convert.errors import ApiError
from orchestrator.engine import EngineError, WorkerUnavailable
from orchestrator.engine.errors import ErrorCode

_STATUS = {
    ErrorCode.ERROR_CODE_INVALID_ARGUMENT: 400,
    ErrorCode.ERROR_CODE_UNSUPPORTED_FEATURE: 400,
    ErrorCode.ERROR_CODE_MODEL_NOT_FOUND: 404,
    ErrorCode.ERROR_CODE_OVERLOADED: 429,
    ErrorCode.ERROR_CODE_DRAINING: 503,
    ErrorCode.ERROR_CODE_DUPLICATE_REQUEST: 409,
    ErrorCode.ERROR_CODE_INTERNAL: 502,
    ErrorCode.ERROR_CODE_ROLE_MISMATCH: 502,
    ErrorCode.ERROR_CODE_KV_SESSION_NOT_FOUND: 502,
    ErrorCode.ERROR_CODE_KV_TRANSFER_FAILED: 502,
    ErrorCode.ERROR_CODE_REQUEST_NOT_FOUND: 502,
    ErrorCode.ERROR_CODE_CANCELLED: 502,
}


def from_engine_error(error: EngineError) -> ApiError:
    if isinstance(error, WorkerUnavailable):
        return ApiError(503, f"worker unavailable: {error}", code="worker_unavailable", retry_after=1)
    status = _STATUS.get(error.code, 500)
    code = error.code_name.removeprefix("ERROR_CODE_").lower()
    message = error.message if status < 500 else str(error)
    retry_after = 1 if status in (429, 503) else None
    return ApiError(status, message, code=code, retry_after=retry_after)
