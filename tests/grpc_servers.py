"""A stock grpc.aio server (what TensorRT-LLM and the simulator run) on its own asyncio loop thread, on
127.0.0.1 and a free port, with production-like options chosen per test; stopped when the block ends."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from orchestrator.openengine.v1 import openengine_pb2_grpc


class RunningServer:
    def __init__(self, port: int, loop: asyncio.AbstractEventLoop):
        self.port, self.loop = port, loop
        self.address = f"127.0.0.1:{port}"


@contextmanager
def grpc_aio_server(inference=None, control=None, *, options=(), compression=None) -> Iterator[RunningServer]:
    """Serve `inference` / `control` (servicers whose methods run on the server's loop) until the block ends."""
    ready = threading.Event()
    box: dict = {}

    def run() -> None:
        async def main() -> None:
            server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *options], compression=compression)
            if inference is not None:
                openengine_pb2_grpc.add_InferenceServicer_to_server(inference, server)
            if control is not None:
                openengine_pb2_grpc.add_ControlServicer_to_server(control, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            stop = asyncio.Event()
            box.update(port=port, loop=asyncio.get_running_loop(), stop=stop)
            ready.set()
            await stop.wait()
            await server.stop(grace=None)

        try:
            asyncio.run(main())
        finally:
            ready.set()  # a server that failed to start must not leave the test waiting

    thread = threading.Thread(target=run, name="grpc-aio-test-server", daemon=True)
    thread.start()
    ready.wait()
    if "port" not in box:
        raise RuntimeError("the grpc.aio test server did not start")
    try:
        yield RunningServer(box["port"], box["loop"])
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(10)
