"""CPU of the client side of HTTP/2 for gRPC calls: our framing (transport/http2.py) against the h2 library.

    python benchmarks/http2_framing.py [--streams 3000] [--frames 80000]

Both talk to the same h2 server side in memory (no sockets), and only the client's work is timed:
(1) a call: request HEADERS + one DATA with END_STREAM out, response HEADERS and trailers in;
(2) a response DATA frame of a 31-byte gRPC message, four frames per received chunk (as they arrive
while a token stream is busy), flow-control credit included. Prints µs per call / per frame and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import time

import h2.config
import h2.connection
import h2.events

from orchestrator.transport import http2

HEADERS = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/openengine.v1.Engine/Generate"),
           (b":authority", b"127.0.0.1:50051"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
           (b"user-agent", b"orchestrator-h2")]
MESSAGE = b"\x00\x00\x00\x00\x1a" + b"y" * 26


def _server() -> h2.connection.H2Connection:
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    server.initiate_connection()
    return server


def _serve(server, data: bytes) -> None:
    for event in server.receive_data(data):
        if isinstance(event, h2.events.DataReceived):
            server.acknowledge_received_data(event.flow_controlled_length, event.stream_id)


class Ours:
    name = "ours (engine/http2.py)"  # the label tests/e2e/test_benchmark_scripts.py reads

    def __init__(self):
        self.client = http2.ClientConnection(receive_window=1024 * 1024,
                                             connection_window=16 * 1024 * 1024)  # as transport/h2_channel.py has them
        self.client.initiate()
        self.block = http2.encode_headers(HEADERS)

    def open(self, body: bytes) -> int:
        return self.client.open_stream(None, self.block, body)

    def out(self) -> bytes:
        return self.client.data_to_send()

    def receive(self, data: bytes) -> None:
        self.client.receive(data)

    def read(self, stream_id: int, count: int) -> None:
        """The stream's reader took `count` bytes: their credit goes back (transport/h2_channel.py, once a read)."""
        self.client.consumed(stream_id, count)


class H2:
    name = "h2 4.x"

    def __init__(self):
        self.client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.client.initiate_connection()
        self.client.increment_flow_control_window(16 * 1024 * 1024)

    def open(self, body: bytes) -> int:
        stream_id = self.client.get_next_available_stream_id()
        self.client.send_headers(stream_id, HEADERS)
        self.client.send_data(stream_id, body, end_stream=True)
        return stream_id

    def out(self) -> bytes:
        return self.client.data_to_send()

    def receive(self, data: bytes) -> None:
        for event in self.client.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                self.client.acknowledge_received_data(event.flow_controlled_length, event.stream_id)

    def read(self, stream_id: int, count: int) -> None:
        pass  # acknowledged as each frame arrives, in receive()


def measure(kind, streams: int, frames: int) -> tuple[float, float]:
    client, server = kind(), _server()
    _serve(server, client.out())
    client.receive(server.data_to_send())
    _serve(server, client.out())
    spent = 0.0
    for _ in range(streams):
        start = time.perf_counter()
        stream_id = client.open(b"x" * 100)
        request = client.out()
        spent += time.perf_counter() - start
        _serve(server, request)
        server.send_headers(stream_id, [(b":status", b"200"), (b"content-type", b"application/grpc")])
        server.send_headers(stream_id, [(b"grpc-status", b"0")], end_stream=True)
        answer = server.data_to_send()
        start = time.perf_counter()
        client.receive(answer)
        spent += time.perf_counter() - start
    per_call = spent / streams
    stream_id = client.open(b"")
    _serve(server, client.out())
    server.send_headers(stream_id, [(b":status", b"200")])
    client.receive(server.data_to_send())
    for _ in range(4):
        server.send_data(stream_id, MESSAGE)
    chunk = server.data_to_send()
    rounds = frames // 4
    start = time.perf_counter()
    for i in range(rounds):
        client.receive(chunk)
        client.read(stream_id, 4 * len(MESSAGE))
        credit = client.out()
        if i % 1024 == 0:
            _serve(server, credit)
    per_frame = (time.perf_counter() - start) / (rounds * 4)
    return per_call, per_frame


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=3000)
    parser.add_argument("--frames", type=int, default=80_000)
    args = parser.parse_args(argv)
    results = {kind.name: measure(kind, args.streams, args.frames) for kind in (Ours, H2)}
    print(f"{'client framing':24} {'us per call':>12} {'us per DATA frame':>18}")
    for name, (call, data) in results.items():
        print(f"{name:24} {call * 1e6:12.1f} {data * 1e6:18.2f}")
    (ours_call, ours_frame), (h2_call, h2_frame) = results.values()
    print(f"ours/h2: per call {ours_call / h2_call:.2f}x, per frame {ours_frame / h2_frame:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
