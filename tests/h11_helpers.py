"""Reading HTTP/1.1 responses back with h11, an independent parser, in the native server's tests."""

from __future__ import annotations

import h11


def read_back_responses(data: bytes, requests: int = 1,
                        methods: tuple[str, ...] = ()) -> list[tuple[h11.Response, bytes]]:
    """The responses (head, whole body) in `data`, for `requests` requests sent on one connection: GETs, or
    `methods` (a HEAD's response has no body, whatever its head says).

    Raises AssertionError when a response is incomplete (cut short, or its framing is wrong)."""
    client = h11.Connection(h11.CLIENT)
    out: list[tuple[h11.Response, bytes]] = []
    for method in methods or ("GET",) * requests:
        client.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
        client.send(h11.EndOfMessage())
        client.receive_data(data)
        data = b""
        response: h11.Response | None = None
        body = b""
        while True:
            event = client.next_event()
            if isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                raise AssertionError(f"incomplete response: {event}")
        if response is None:  # h11 gives the head first: only a message without one ends here
            raise AssertionError("a response ended before its head")
        out.append((response, body))
        if client.our_state is h11.DONE and client.their_state is h11.DONE:
            client.start_next_cycle()
    return out
