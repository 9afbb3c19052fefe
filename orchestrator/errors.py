"""Why a request cannot be served, as domain errors. The HTTP status of each is the frontend's business
(orchestrator/frontend/errors.py); engine failures are orchestrator.engine.EngineError."""

from __future__ import annotations


class RequestError(Exception):
    """One request cannot be served. `param` names the offending field; `code` is a stable short name;
    `retry_after` (seconds) says the same request may work later."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after


class InvalidRequest(RequestError):
    """The request itself is wrong (a field, a limit, the context window, an unsupported feature)."""


class ModelNotFound(RequestError):
    """No model by that name is served here."""


class NoWorkerAvailable(RequestError):
    """No worker of a role the request needs can take it now (none registered, none healthy)."""


class WorkerDiscoveryFailed(RequestError):
    """The worker's capabilities (ServerInfo + ModelInfo) could not be read, or lack what is needed."""


class RateLimited(RequestError):
    """The API key is over one of its limits (requests/s, tokens/min, concurrency); `retry_after` says when."""


class RequestTimedOut(RequestError):
    """The request did not finish within limits.request_timeout_s."""


def invalid(message: str, param: str | None = None, code: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code)
