"""One completion request's cancellation, decided in one place, and the requests in flight.

The app (frontend/app.py) makes a `RequestScope` for each completion request. It owns the request's cancel
scope, is the one way anything outside the request cuts it short, and records why (`Ending`, the first
reason wins):

- `SHUTDOWN`: the shutdown grace is over (`InFlight.cut`, from serve.py): the request's whole scope is
  cancelled, parsing and planning included; the app then answers 503 (or a final SSE error event).
- `DISCONNECT`: the client went (`client_gone`, which our server's reader task calls: `on_disconnect` in
  frontend/server_extensions.py): the request's nursery is cancelled, which aborts its engine work; nobody
  is left to answer.
- `DEADLINE`: `limits.request_timeout_s` passed. That deadline is the request nursery's own, set by the
  coordinator (flow/coordinator.py), because a second timer per request costs CPU on every request; the
  scope is handed that nursery (`watch`) and reads it. The app answers 504.
- `LIMIT`: the request body did not arrive within `http.body_timeout_s` (`body_limit`): a 408.

Why two cancel scopes: the request's own (`cancel_scope`, which the app enters around everything) and the
request nursery's. An answer is written outside the scope that was cancelled: the 503 after the app's scope,
the 504 after the nursery's, while a disconnect needs no answer at all.

`InFlight` is the set of the requests being served, which serve.py's drain waits on: `wait_until_none` wakes
when the last one ends, without polling.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import trio


class Ending(enum.StrEnum):
    """Why a request was cut short."""

    SHUTDOWN = "shutdown"
    DISCONNECT = "disconnect"
    DEADLINE = "deadline"
    LIMIT = "limit"


# Every `Ending.X` is a slow attribute lookup on Python 3.11 (EnumType.__getattr__): the app compares with this.
DISCONNECT = Ending.DISCONNECT


class RequestScope:
    __slots__ = ("cancel_scope", "_ended", "_nursery_scope", "_on_disconnect")

    def __init__(self, on_disconnect: Callable[[Callable[[], None]], None]):
        self.cancel_scope = trio.CancelScope()  # the whole request: the app enters it
        self._ended: Ending | None = None
        self._nursery_scope: trio.CancelScope | None = None  # the request nursery's, once the flow runs
        self._on_disconnect = on_disconnect  # the server's: calls back once, when the client goes

    @property
    def ended(self) -> Ending | None:
        """Why the request was cut short; None while it was not."""
        if self._ended is None:
            nursery = self._nursery_scope
            if nursery is not None and nursery.cancelled_caught and trio.current_time() >= nursery.deadline:
                return Ending.DEADLINE
        return self._ended

    def watch(self, request: trio.Nursery) -> None:
        """Coordinator.execute's `watch`: the request's nursery is open. From here the client going cancels it
        (until then a client that went is found when the body is read or the answer is written)."""
        self._nursery_scope = request.cancel_scope
        self._on_disconnect(self.client_gone)

    def client_gone(self) -> None:
        """Called by the connection's reader task: it must not block, and does not."""
        self._end(Ending.DISCONNECT)
        if self._nursery_scope is not None:
            self._nursery_scope.cancel()

    def shut_down(self) -> None:
        self._end(Ending.SHUTDOWN)
        self.cancel_scope.cancel()

    @contextmanager
    def body_limit(self, seconds: float) -> Iterator[None]:
        """`trio.fail_after(seconds)` around reading a body that has not arrived yet."""
        try:
            with trio.fail_after(seconds):
                yield
        except trio.TooSlowError:
            self._end(Ending.LIMIT)
            raise

    def _end(self, why: Ending) -> None:
        if self._ended is None:
            self._ended = why


class InFlight:
    """The completion requests being served, for the drain at shutdown."""

    __slots__ = ("_scopes", "_none_left")

    def __init__(self) -> None:
        self._scopes: set[RequestScope] = set()
        self._none_left: trio.Event | None = None  # made only while someone waits: no cost per request

    def __len__(self) -> int:
        return len(self._scopes)

    def add(self, scope: RequestScope) -> None:
        self._scopes.add(scope)

    def discard(self, scope: RequestScope) -> None:
        self._scopes.discard(scope)
        if not self._scopes and self._none_left is not None:
            self._none_left.set()

    def cut(self) -> int:
        """End every request still running (SHUTDOWN); how many there were."""
        for scope in self._scopes:
            scope.shut_down()
        return len(self._scopes)

    async def wait_until_none(self) -> None:
        """Return when no request is in flight (at once if none is)."""
        while self._scopes:
            if self._none_left is None or self._none_left.is_set():
                self._none_left = trio.Event()
            await self._none_left.wait()
