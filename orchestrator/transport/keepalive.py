"""When the HTTP/2 connection to a worker sends a keepalive PING. Pure: times in, decisions out.

A PING that is not answered within `timeout_s` fails the connection's streams: a worker host that vanished
without a FIN or a RST (a frozen machine, a cut link) is found in seconds instead of at the request timeout.

Servers police PINGs, and a stock one kills every stream of a client that pings too often: grpc-core (what
TensorRT-LLM's and grpc.aio's servers run) counts a PING as a strike when it comes less than
`grpc.http2.min_ping_interval_without_data_ms` (5 minutes by default) after the previous one, unless the server
sent HEADERS or DATA in between, and after 2 strikes closes the connection with GOAWAY(ENHANCE_YOUR_CALM,
"too_many_pings"). A prefill queued behind long prompts, or a decode waiting for its KV transfer, is silent
for that long under load. So:
- a PING goes only after the connection received nothing for `interval_s` (a busy connection is never pinged);
- while the server sends no HEADERS or DATA, at most FREE_PINGS go `interval_s` apart (the first after data is
  never a strike, the second is one of the two allowed), and any more SERVER_MIN_PING_INTERVAL_S apart;
- a GOAWAY too_many_pings (a server stricter than grpc-core's default) doubles both for this worker, as
  grpc-core's own client does (logged once per worker by the connection).
"""

from __future__ import annotations

FREE_PINGS = 2
SERVER_MIN_PING_INTERVAL_S = 300.0  # grpc-core's default grpc.http2.min_ping_interval_without_data_ms


class KeepalivePolicy:
    """One worker's keepalive, kept across its connections (a GOAWAY too_many_pings outlives the connection)."""

    def __init__(self, interval_s: float = 30.0, timeout_s: float = 10.0):
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.quiet_interval_s = max(interval_s, SERVER_MIN_PING_INTERVAL_S)  # between pings beyond FREE_PINGS
        self.backoffs = 0

    def ping_due(self, *, quiet_since: float, last_ping: float, pings_since_data: int) -> float:
        """When the next PING may go: `quiet_since` is when the connection last received anything (or, idle,
        opened a stream), `pings_since_data` how many PINGs went since the server last sent HEADERS or DATA."""
        due = quiet_since + self.interval_s
        if pings_since_data >= FREE_PINGS:
            due = max(due, last_ping + self.quiet_interval_s)
        return due

    def too_many_pings(self) -> bool:
        """The worker closed a connection with GOAWAY too_many_pings: ping half as often from now on. True the
        first time (worth a log line; later ones are not news)."""
        self.interval_s *= 2
        self.quiet_interval_s *= 2
        self.backoffs += 1
        return self.backoffs == 1
