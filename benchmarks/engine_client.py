"""Engine client speed: our trio client against plain grpc.aio on uvloop, side by side, one run.

    python benchmarks/engine_client.py [--streams 400] [--tokens 64] [--unary 2000]

Against one local OpenEngine test server (a separate process that answers Health at once and
streams pre-built tokens as fast as gRPC takes them), it measures
  - sequential unary latency (Control.Health), and
  - streaming messages/s (N concurrent Generate streams of M tokens)
for (a) orchestrator.engine.EngineClient from trio, with its Generate streams on our HTTP/2 client
(h2, the default) and on grpcio, (b) plain grpc.aio on uvloop, and, for the record of why (a) is
built as it is, (c) grpc.aio called through trio-asyncio on trio's thread. Prints the figures
(stream messages/s, and this process's CPU per streamed message) and the ratios a/b.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time

import grpc

from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.openengine.v1 import lifecycle_pb2, openengine_pb2_grpc


# ---- the test server (its own process) ------------------------------------------------------------
class FastServer(openengine_pb2_grpc.InferenceServicer, openengine_pb2_grpc.ControlServicer):
    def __init__(self, tokens: int):
        self.responses = [g.GenerateResponse(request_id="x", token=g.TokenOutput(tokens=[g.TokenInfo(token_id=i)]))
                          for i in range(tokens)]
        self.responses.append(g.GenerateResponse(request_id="x", finished=g.GenerationFinished(
            reason=g.FINISH_REASON_LENGTH)))

    async def Generate(self, request, context):
        for response in self.responses:
            yield response

    async def Health(self, request, context):
        return lifecycle_pb2.HealthResponse(state=lifecycle_pb2.HEALTH_STATE_READY)


def _serve(port_queue, tokens: int) -> None:
    import uvloop

    async def main():
        server = grpc.aio.server()
        servicer = FastServer(tokens)
        openengine_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
        openengine_pb2_grpc.add_ControlServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_queue.put(port)
        await server.wait_for_termination()

    uvloop.run(main())


def _request(i: int) -> g.GenerateRequest:
    return g.GenerateRequest(request_id=f"r{i}", model="tiny-chat", token_ids=g.TokenIds(ids=[1, 2, 3]))


# ---- (b) plain grpc.aio on uvloop ------------------------------------------------------------------
def bench_plain(address: str, streams: int, unary: int) -> tuple[float, float, float]:
    import uvloop

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            control, inference = openengine_pb2_grpc.ControlStub(channel), openengine_pb2_grpc.InferenceStub(channel)
            await control.Health(lifecycle_pb2.HealthRequest())
            start = time.perf_counter()
            for _ in range(unary):
                await control.Health(lifecycle_pb2.HealthRequest())
            unary_ms = (time.perf_counter() - start) / unary * 1000

            async def one(i):
                n = 0
                async for _ in inference.Generate(_request(i)):
                    n += 1
                return n

            start, cpu = time.perf_counter(), time.process_time()
            counts = await asyncio.gather(*(one(i) for i in range(streams)))
            return unary_ms, sum(counts) / (time.perf_counter() - start), (time.process_time() - cpu) / sum(counts)

    return uvloop.run(main())


# ---- (a) our trio client ---------------------------------------------------------------------------
def bench_ours(address: str, streams: int, unary: int, stream_transport: str) -> tuple[float, float, float]:
    import trio

    from orchestrator.engine import EngineClient, LoopThread

    async def main():
        async with LoopThread.open() as loop_thread, \
                EngineClient.open(address, loop_thread, stream_transport=stream_transport) as client:
            await client.health()
            start = time.perf_counter()
            for _ in range(unary):
                await client.health()
            unary_ms = (time.perf_counter() - start) / unary * 1000
            total = 0

            async def one(i):
                nonlocal total
                async with client.generate(_request(i)) as stream:
                    while batch := await stream.next_batch():
                        total += len(batch)

            start, cpu = time.perf_counter(), time.process_time()
            async with trio.open_nursery() as nursery:
                for i in range(streams):
                    nursery.start_soon(one, i)
            return unary_ms, total / (time.perf_counter() - start), (time.process_time() - cpu) / total

    return trio.run(main)


# ---- (c) grpc.aio through trio-asyncio on trio's own thread ----------------------------------------
def bench_trio_asyncio(address: str, streams: int, unary: int) -> tuple[float, float, float]:
    import trio
    import trio_asyncio

    async def main():
        async with trio_asyncio.open_loop():
            channel = await trio_asyncio.aio_as_trio(_make_channel)(address)
            control, inference = openengine_pb2_grpc.ControlStub(channel), openengine_pb2_grpc.InferenceStub(channel)
            health = trio_asyncio.aio_as_trio(lambda: control.Health(lifecycle_pb2.HealthRequest()))
            await health()
            start = time.perf_counter()
            for _ in range(unary):
                await health()
            unary_ms = (time.perf_counter() - start) / unary * 1000
            total = 0

            async def one(i):
                nonlocal total
                async for _ in trio_asyncio.aio_as_trio(inference.Generate(_request(i))):
                    total += 1

            start, cpu = time.perf_counter(), time.process_time()
            async with trio.open_nursery() as nursery:
                for i in range(streams):
                    nursery.start_soon(one, i)
            rate, cpu = total / (time.perf_counter() - start), (time.process_time() - cpu) / total
            await trio_asyncio.aio_as_trio(channel.close)()
            return unary_ms, rate, cpu

    return trio.run(main)


async def _make_channel(address):
    return grpc.aio.insecure_channel(address)


def _in_process(fn, *args):
    """Each client in a fresh process, so one cannot warm or pollute the other's gRPC state."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--unary", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3, help="best of N rounds per client")
    parser.add_argument("--skip-trio-asyncio", action="store_true")
    args = parser.parse_args(argv)

    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_serve, args=(ports, args.tokens), daemon=True)
    server.start()
    address = f"127.0.0.1:{ports.get(timeout=30)}"
    try:
        clients = {"ours, h2 streams on trio": (bench_ours, "h2"),
                   "ours, grpcio streams (uvloop)": (bench_ours, "grpcio"),
                   "plain grpc.aio on uvloop": (bench_plain,)}
        if not args.skip_trio_asyncio:
            clients["grpc.aio via trio-asyncio"] = (bench_trio_asyncio,)
        results = {}
        for name, (fn, *extra) in clients.items():
            rounds = [_in_process(fn, address, args.streams, args.unary, *extra) for _ in range(args.rounds)]
            results[name] = (statistics.median(r[0] for r in rounds), max(r[1] for r in rounds),
                             min(r[2] for r in rounds))
        print(f"server: {address}, {args.streams} concurrent streams x {args.tokens} tokens, "
              f"{args.unary} sequential Health calls, best of {args.rounds}")
        print(f"{'client':32} {'Health latency ms':>18} {'stream msgs/s':>14} {'CPU us/msg':>11}")
        for name, (unary_ms, rate, cpu) in results.items():
            print(f"{name:32} {unary_ms:18.3f} {rate:14.0f} {cpu * 1e6:11.1f}")
        plain = results["plain grpc.aio on uvloop"]
        for name in ("ours, h2 streams on trio", "ours, grpcio streams (uvloop)"):
            ours = results[name]
            print(f"ratio {name}/plain: streaming {ours[1] / plain[1]:.2f} (target >= 0.8), CPU per message "
                  f"{ours[2] / plain[2]:.2f}x, unary latency {ours[0] / plain[0]:.2f}x")
        if "grpc.aio via trio-asyncio" in results:
            ta = results["grpc.aio via trio-asyncio"]
            print(f"ratio trio-asyncio/plain: streaming {ta[1] / plain[1]:.2f}, unary latency {ta[0] / plain[0]:.2f}x")
    finally:
        server.terminate()
        server.join(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
