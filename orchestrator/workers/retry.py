"""One retry rule for both stages: a retryable failure moves the leg to another worker of the same role.

`attempt(worker)` runs the leg once and raises EngineError on failure. A failure counts in
`orchestrator_engine_errors`; an unreachable worker is taken out of routing at once; a retryable one
(and one `may_retry` allows: the decode stage refuses once a token was streamed) is tried again on a
worker not tried yet, up to `retries` more times. With no other worker left, the original error stands.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from orchestrator.engine import EngineError, WorkerUnavailable
from orchestrator.errors import NoWorkerAvailable

log = logging.getLogger(__name__)
T = TypeVar("T")


async def with_retries(pool, first, attempt: Callable[[object], Awaitable[T]], *, retries: int, metrics,
                       what: str, may_retry: Callable[[EngineError], bool] = lambda error: True,
                       accepts: Callable[[object], bool] | None = None) -> tuple[object, T]:
    """Returns (the worker that succeeded, its result). A retry goes only to a worker `accepts` takes (one that
    serves the request's features: the planner checked only the first workers)."""
    tried = [first]
    worker = first
    while True:
        try:
            return worker, await attempt(worker)
        except EngineError as error:
            # a code no schema names is counted as one label, never as many as a worker can invent
            metrics.engine_errors.labels(error.code_name if error.known_code else "ERROR_CODE_UNKNOWN").inc()
            if isinstance(error, WorkerUnavailable):
                pool.report_unreachable(worker, error)
            if not error.retryable or not may_retry(error) or len(tried) > retries:
                raise
            try:
                worker = pool.pick(worker.role, exclude=tuple(tried), accepts=accepts)
            except NoWorkerAvailable:
                raise error from None
            tried.append(worker)
            metrics.retries.labels(worker.role).inc()
            log.warning("%s failed on %s (%s); retrying on %s", what, tried[-2].address, error.code_name,
                        worker.address)
