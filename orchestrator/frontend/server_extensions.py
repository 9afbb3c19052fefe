"""The contract between our HTTP server (http_server.py) and the application (app.py) beyond ASGI 3.

ASGI gives an application `receive()` and `send()`, both awaited in the request's own task. Three things
the orchestrator needs cost a task, a timer or a task switch per request that way, so the server offers
them directly, as one `ServerExtensions` in every `http` scope (`ServerExtensions.of(scope)`):

- `body_arrived`: the whole request body was read before the application was called, so `receive()`
  returns it without waiting and the application needs no timer against a slow body (slowloris).
- `on_disconnect(callback)`: the connection's reader task calls `callback()` once, when the client goes
  while this request is answered (at once if it has gone already; never once the response is over). The
  callback runs in the reader task: it must not block; the app only cancels the request's nursery there.
  It replaces a watcher task per request waiting in `receive()` for `http.disconnect`.
- `bad_body()`: why the body ended before it was whole (its chunked framing is malformed), or None.
  `receive()` reports such an end as `http.disconnect`, as ASGI has no other word for it; the app asks
  here to answer 400 instead of treating it as a client that went.
- `send_now(body)` (plain TCP only, else None): `http.response.body` with more to come, written at once
  by whatever task calls it and without awaiting; False when the socket did not take all of it, and the
  rest then waits for the application's next `send` (an empty body will do), which it must await: that is
  the backpressure from a slow client. Only for a response that is started and not finished (else
  RuntimeError). It is how direct delivery (orchestrator/decode/progress.py) writes a token from the engine
  connection's reader task while the request's task waits.

The application runs only under our server (the hypercorn mode is gone), so every scope has them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

KEY = "orchestrator.server"  # scope["extensions"][KEY]


@attrs.frozen
class ServerExtensions:
    body_arrived: bool
    on_disconnect: Callable[[Callable[[], None]], None]
    bad_body: Callable[[], str | None]
    send_now: Callable[[bytes], bool] | None = None

    @staticmethod
    def of(scope: dict[str, Any]) -> ServerExtensions:
        """The extensions of an `http` scope our server made."""
        extensions = scope.get("extensions") or {}
        if KEY not in extensions:
            raise RuntimeError("the application runs under orchestrator.frontend.http_server only: this scope "
                               "has no ServerExtensions")
        return extensions[KEY]

    def put_in(self, scope: dict[str, Any]) -> None:
        scope.setdefault("extensions", {})[KEY] = self
