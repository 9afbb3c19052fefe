"""Logging that works from the first line of start-up, and helpers for retry logs.

`configure()` is the first thing every command does; library users who never call it still see
warnings through Python's last-resort handler, so a retry loop is never silent.
"""

from __future__ import annotations

import logging
import sys
import time

FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def configure(level: str | int = "INFO", *, prefix: str = "") -> None:
    """Install one stderr handler on the root logger (idempotent)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_orchestrator", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(prefix + FORMAT))
    handler._orchestrator = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    # grpc's C core and hpack are chatty at DEBUG; they are not ours to debug.
    for noisy in ("hpack", "h2", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.INFO, logging.getLogger().level))


def cause_chain(exc: BaseException) -> str:
    """`outer: msg <- inner: msg <- ...` following __cause__ / __context__."""
    parts, seen = [], set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current).strip() or "(no message)"
        parts.append(f"{type(current).__name__}: {text}")
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return " <- ".join(parts)


class RateLimitedLog:
    """Logs the first event at once, then at most one line per `interval` with a count of the rest."""

    def __init__(self, logger: logging.Logger, interval: float = 5.0, level: int = logging.WARNING):
        self._logger = logger
        self._interval = interval
        self._level = level
        self._last = float("-inf")
        self._suppressed = 0

    def __call__(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self._interval:
            self._suppressed += 1
            return
        if self._suppressed:
            message += f" ({self._suppressed} similar messages suppressed)"
        self._logger.log(self._level, message, *args)
        self._last = now
        self._suppressed = 0
