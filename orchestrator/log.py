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
    handler.setFormatter(BoundedFormatter(prefix + FORMAT))
    handler._orchestrator = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    # grpc's C core and hpack are chatty at DEBUG; they are not ours to debug.
    for noisy in ("hpack", "h2", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.INFO, logging.getLogger().level))


# What one cause may take in a log line or a /health body: an exception's text can carry whatever a worker sent
# (a decoder's repr of a 20 MB payload), and must not become a 60 MB log line.
MAX_CAUSE_CHARS = 1024


def bounded(text: str, limit: int = MAX_CAUSE_CHARS) -> str:
    """`text` cut to at most `limit` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    note = f"... ({len(text) - limit} more characters)"
    return text[:max(0, limit - len(note))] + note


def cause_chain(exc: BaseException, limit: int = MAX_CAUSE_CHARS) -> str:
    """`outer: msg <- inner: msg <- ...` following __cause__ / __context__, at most `limit` characters in all
    (each cause bounded on its own, so that a huge inner message does not hide the outer ones)."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(parts) < 16:
        seen.add(id(current))
        text = _text(current, limit)
        parts.append(f"{type(current).__name__}: {text}")
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return bounded(" <- ".join(parts), limit)


def _text(exc: BaseException, limit: int) -> str:
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a foreign exception whose __str__ fails is still named
        text = "(its message could not be read)"
    return bounded(text.strip() or "(no message)", limit)


# One log line's message, whatever its arguments carry (a cause is MAX_CAUSE_CHARS; a line names a few).
MAX_MESSAGE_CHARS = 4 * MAX_CAUSE_CHARS


class BoundedFormatter(logging.Formatter):
    """Every message at most MAX_MESSAGE_CHARS, whatever was interpolated into it (a worker's text included);
    a traceback, which is ours, is kept whole."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = bounded(record.message, MAX_MESSAGE_CHARS)
        return super().formatMessage(record)


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
