"""A fix for hypercorn's trio server: a connection the client closed is closed at once.

hypercorn 0.17-0.19 (`hypercorn/trio/tcp_server.py`, `TCPServer.run`): when the read loop sees the
client's FIN it returns, but the connection's task group still holds the keep-alive idle task, which
sleeps out `keep_alive_timeout` before the socket is closed. Until then the socket sits in CLOSE_WAIT
(after 1,000 cancelled streams: 27 of them, for up to `http.keep_alive_s`). Stopping the idle task
once reading has ended lets the task group finish and the server close the socket.

`install()` swaps hypercorn's TCPServer for this subclass in `hypercorn.trio.run`, the one module that
creates them; tests/test_serve_e2e.py checks that no socket is left in CLOSE_WAIT after cancelled streams.
"""

from __future__ import annotations

import hypercorn.trio.run as hypercorn_run
from hypercorn.trio.tcp_server import TCPServer


class ClosingTCPServer(TCPServer):
    async def _read_data(self) -> None:
        await super()._read_data()
        await self.idle_task.stop()  # the client is gone: no keep-alive wait before closing


def install() -> None:
    hypercorn_run.TCPServer = ClosingTCPServer  # type: ignore[misc]  # the patch: hypercorn has no hook for it
