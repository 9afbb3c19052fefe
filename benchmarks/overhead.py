"""What the orchestrator costs: the same streams read directly over gRPC and through the orchestrator.

    python benchmarks/overhead.py [--requests-per-slot 8] [--max-tokens 64]

Simulated workers at zero GPU cost (--time-scale 0), so every millisecond measured is software.
For aggregated (1 worker) and disaggregated (1 prefill + 1 decode), at concurrency 1 and 64:
  (a) direct: our engine client drives the legs itself (disagg: context-only leg, then the
      generation leg with the KV session; after the first tokens it counts them in the connection's
      task, as serve writes them: transport/inbox.py's direct delivery), and
  (b) through `orchestrator serve` over HTTP/SSE (a lean keep-alive client, TCP_NODELAY),
measured in the same run against the same worker processes (at concurrency 1 request by request in
turn, so that both see the machine in the same state; at 64 one after the other). Prints streamed
tokens/s of both, the ratio b/a, and the TTFT the orchestrator adds (p50/p99, ms).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from orchestrator.bench.metrics import percentile
from orchestrator.bench.sse_client import Connection
from orchestrator.engine import EngineClient, LoopThread, PrefillReady, Tokens
from orchestrator.kv import generation_leg
from orchestrator.models import TINY_CHAT
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.prefill import context_only_leg
from orchestrator.testkit.plugin import write_config
from orchestrator.testkit.processes import OrchestratorServers, SimWorkers
from orchestrator.tokenizer import ModelTokenizer

PROMPT = "Describe the river, the bridge and the mountains in the picture."


async def run_slots(concurrency: int, per_slot: int, one) -> tuple[float, list[float], int]:
    """Run `concurrency` slots each doing `per_slot` requests; returns (seconds, ttfts, tokens)."""
    ttfts: list[float] = []
    tokens = 0

    async def slot(i: int) -> None:
        nonlocal tokens
        state = await one.open_slot() if hasattr(one, "open_slot") else None
        for j in range(per_slot):
            ttft, n = await one(i, j, state)
            ttfts.append(ttft)
            tokens += n
        if state is not None:
            await one.close_slot(state)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(concurrency):
            nursery.start_soon(slot, i)
    return time.perf_counter() - start, ttfts, tokens


async def run_alternating(requests: int, first, second) -> tuple[tuple[float, list[float], int], ...]:
    """One request of `first`, one of `second`, and so on, one at a time; for each: (seconds spent in its
    requests, ttfts, tokens), as run_slots returns them."""
    results: list[list] = []  # [seconds, ttfts, tokens] of each
    states = []
    for one in (first, second):
        states.append(await one.open_slot() if hasattr(one, "open_slot") else None)
        results.append([0.0, [], 0])
    for j in range(requests):
        for index, one in enumerate((first, second)):
            start = time.perf_counter()
            ttft, tokens = await one(0, j, states[index])
            results[index][0] += time.perf_counter() - start
            results[index][1].append(ttft)
            results[index][2] += tokens
    for one, state in zip((first, second), states):
        if state is not None:
            await one.close_slot(state)
    return tuple(tuple(r) for r in results)


class Direct:
    def __init__(self, clients: dict[str, EngineClient], prompt_ids: list[int], max_tokens: int, mode: str):
        self.clients, self.prompt_ids, self.max_tokens, self.mode = clients, prompt_ids, max_tokens, mode

    async def __call__(self, i: int, j: int, state) -> tuple[float, int]:
        full = g.GenerateRequest(request_id=f"d{self.mode}-{i}-{j}-{time.monotonic_ns()}", model="tiny-chat",
                                 token_ids=g.TokenIds(ids=self.prompt_ids),
                                 stopping=g.StoppingOptions(max_tokens=self.max_tokens, ignore_eos=True))
        start = time.perf_counter()
        if self.mode == "disaggregated":
            async with self.clients["prefill"].generate(context_only_leg(full)) as stream:
                ready = [e async for e in stream][-1]
            if not isinstance(ready, PrefillReady):
                raise RuntimeError(f"the context-only leg ended with {ready!r}, not prefill_ready")
            leg, client = generation_leg(full, ready.kv_session), self.clients["decode"]
        else:
            leg, client = full, self.clients["aggregated"]
        first, count = None, 0

        def count_in_place(batch: list) -> list | None:
            """Token events counted in the connection's task, as serve writes them (transport/inbox.py)."""
            nonlocal count
            if any(type(event) is not Tokens for event in batch):
                return batch
            count += sum(len(event.token_ids) for event in batch)
            return None

        async with client.generate(leg) as stream:
            while batch := await stream.next_batch():
                for event in batch:
                    if isinstance(event, Tokens):
                        if first is None:
                            first = time.perf_counter()
                            stream.deliver_directly(count_in_place)
                        count += len(event.token_ids)
            stream.deliver_directly(None)
        if first is None:
            raise RuntimeError("the generation leg ended without tokens")
        return first - start, count


class ThroughOrchestrator:
    """Streams through `orchestrator serve`; counts the SSE content events and streamed tokens it saw."""

    def __init__(self, url: str, max_tokens: int):
        self.url = url
        self.body = {"model": "tiny-chat", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                     "stream_options": {"include_usage": True},
                     "messages": [{"role": "user", "content": PROMPT}]}
        self.events = 0
        self.tokens = 0

    async def open_slot(self) -> Connection:
        return Connection(self.url)

    async def close_slot(self, connection: Connection) -> None:
        await connection.aclose()

    async def __call__(self, i: int, j: int, connection: Connection) -> tuple[float, int]:
        start = time.perf_counter()
        marks: dict[str, Any] = {"first": None, "tokens": 0}

        def on_data(payload: bytes, at: float) -> None:
            if payload.endswith(b"]}"):  # a chunk with choices (the usage chunk ends with its usage)
                if b'"content":' in payload:
                    self.events += 1
                    if marks["first"] is None:
                        marks["first"] = at
            elif b'"usage"' in payload:
                marks["tokens"] = json.loads(payload)["usage"]["completion_tokens"]

        await connection.post_stream("/v1/chat/completions", self.body, on_data)
        self.tokens += marks["tokens"]
        return marks["first"] - start, marks["tokens"]


async def measure(mode: str, addresses: dict[str, str], url: str, prompt_ids, args) -> list[dict]:
    rows = []
    async with LoopThread.open() as loop_thread, contextlib.AsyncExitStack() as stack:
        clients = {role: await stack.enter_async_context(EngineClient.open(address, loop_thread))
                   for role, address in addresses.items()}
        for concurrency in args.concurrency:
                per_slot = max(args.requests_per_slot, 1) if concurrency > 1 else args.sequential_requests
                direct = Direct(clients, prompt_ids, args.max_tokens, mode)
                through = ThroughOrchestrator(url, args.max_tokens)
                await run_slots(min(concurrency, 8), 1, direct)  # warm-up both paths
                await run_slots(min(concurrency, 8), 1, through)
                if concurrency == 1:  # alternate: each pair of requests sees the machine in the same state
                    a, b = await run_alternating(per_slot, direct, through)
                else:
                    a = await run_slots(concurrency, per_slot, direct)
                    b = await run_slots(concurrency, per_slot, through)
                rows.append({"mode": mode, "concurrency": concurrency, "direct": a, "orchestrator": b})
    return rows


def report(rows: list[dict]) -> None:
    print(f"{'mode':14} {'conc':>4} {'direct tok/s':>13} {'orch tok/s':>11} {'ratio b/a':>9} "
          f"{'TTFT a p50':>10} {'TTFT b p50':>10} {'added p50':>9} {'added p99':>9}  (ms)")
    for row in rows:
        (ta, ttft_a, tok_a), (tb, ttft_b, tok_b) = row["direct"], row["orchestrator"]
        rate_a, rate_b = tok_a / ta, tok_b / tb
        a50, b50 = statistics.median(ttft_a) * 1e3, statistics.median(ttft_b) * 1e3
        a99, b99 = percentile(ttft_a, 99) * 1e3, percentile(ttft_b, 99) * 1e3
        print(f"{row['mode']:14} {row['concurrency']:>4} {rate_a:13.0f} {rate_b:11.0f} {rate_b / rate_a:9.2f} "
              f"{a50:10.2f} {b50:10.2f} {b50 - a50:9.2f} {b99 - a99:9.2f}")


def chat_prompt_ids() -> list[int]:
    tokenizer = ModelTokenizer.from_dir(TINY_CHAT)
    return tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": PROMPT}]))


def start_deployment(workers: SimWorkers, servers: OrchestratorServers, tmp: Path, mode: str, **sections):
    """Zero-cost sim workers for `mode` and an `orchestrator serve` in front: (addresses by role, server)."""
    roles = ("aggregated",) if mode == "aggregated" else ("prefill", "decode")
    addresses = {role: workers.start(role, "--time-scale", "0").address for role in roles}
    config = write_config(tmp / f"{mode}.yaml", mode, {r: [a] for r, a in addresses.items()},
                          limits={"health_interval_s": 1.0}, **sections)  # the shipped default (tests poll faster)
    return addresses, servers.start(config, env={"ORCH_LOG_LEVEL": "WARNING"})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--requests-per-slot", type=int, default=8)
    parser.add_argument("--sequential-requests", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--modes", nargs="+", default=["aggregated", "disaggregated"])
    args = parser.parse_args(argv)
    prompt_ids = chat_prompt_ids()
    tmp = Path(tempfile.mkdtemp(prefix="orch-overhead-"))
    workers, servers = SimWorkers(tmp), OrchestratorServers(tmp)
    rows = []
    try:
        for mode in args.modes:
            addresses, server = start_deployment(workers, servers, tmp, mode)
            rows += trio.run(measure, mode, addresses, server.url, prompt_ids, args)
    finally:
        servers.close()
        workers.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.max_tokens} streamed tokens per request, sim workers at zero cost, 2-core machine")
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
