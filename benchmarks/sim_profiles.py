"""The simulated worker's cost model, and what it says about agg vs disagg.

    python benchmarks/sim_profiles.py [--time-scale 0.5] [--streams 16] [--input-len 2000] [--output-len 100]

1. For every shipped profile: step time against decode batch size and against prefill length
   (the cost model's arithmetic, which the scheduler charges per step).
2. One load point measured side by side on real sim-worker processes, through the engine client:
   2 aggregated workers against 1 prefill + 1 decode worker (same GPU count), the same streams
   (staggered arrivals of long prompts), reporting TTFT and TPOT in GPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

from orchestrator.bench.metrics import percentile
from orchestrator.engine import EngineClient, LoopThread, PrefillReady, Tokens
from orchestrator.kv import generation_leg
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.prefill import context_only_leg
from orchestrator.sim.profiles import PROFILES
from orchestrator.testkit.processes import SimWorkers


def cost_tables() -> None:
    for profile in PROFILES.values():
        print(f"\nprofile {profile.name}  ({profile.source})")
        batches = sorted({1, 8, 32, 64, 128, profile.max_batch_size})
        print("  decode step (ms), context 1024 tokens per request, by batch size:")
        print("   " + "".join(f"{b:>9}" for b in batches))
        print("   " + "".join(f"{profile.decode_ms([1024] * b):9.2f}" for b in batches))
        lengths = sorted({128, 512, 1024, 2048, 4096, min(8192, profile.max_num_tokens)})
        print("  prefill step (ms) by prompt length (one request):")
        print("   " + "".join(f"{n:>9}" for n in lengths))
        print("   " + "".join(f"{profile.prefill_ms([n]):9.2f}" for n in lengths))
        mixed = profile.step_ms([2048], [1024] * 32)
        print(f"  aggregated step with a 2048-token prefill chunk and 32 decodes: {mixed:.2f} ms "
              f"(decode alone: {profile.decode_ms([1024] * 32):.2f} ms)")
        print(f"  KV transfer of a 2048-token prompt: {profile.kv_transfer_ms(2048):.2f} ms")


def prompt(i: int, length: int) -> list[int]:
    return [(i * 7919 + k * 31) % 700 + 50 for k in range(length)]


async def drive(mode: str, addresses: dict[str, list[str]], args) -> tuple[list[float], list[float]]:
    ttfts, tpots = [], []
    async with LoopThread.open() as loop_thread, contextlib.AsyncExitStack() as stack:
        clients = {role: [await stack.enter_async_context(EngineClient.open(a, loop_thread)) for a in addrs]
                   for role, addrs in addresses.items()}

        async def one(i: int) -> None:
            await trio.sleep(i * args.stagger * args.time_scale)
            full = g.GenerateRequest(request_id=f"{mode}-{i}", model="tiny-chat",
                                     token_ids=g.TokenIds(ids=prompt(i, args.input_len)),
                                     stopping=g.StoppingOptions(max_tokens=args.output_len, ignore_eos=True))
            start = time.perf_counter()
            if mode == "aggregated":
                client, leg = clients["aggregated"][i % len(clients["aggregated"])], full
            else:
                async with clients["prefill"][0].generate(context_only_leg(full)) as stream:
                    ready = [e async for e in stream][-1]
                if not isinstance(ready, PrefillReady):
                    raise RuntimeError(f"the context-only leg ended with {ready!r}, not prefill_ready")
                client, leg = clients["decode"][0], generation_leg(full, ready.kv_session)
            times = []
            async with client.generate(leg) as stream:
                async for event in stream:
                    if isinstance(event, Tokens):
                        times.extend([time.perf_counter()] * len(event.token_ids))
            ttfts.append((times[0] - start) / args.time_scale)
            tpots.append((times[-1] - times[0]) / (len(times) - 1) / args.time_scale)

        async with trio.open_nursery() as nursery:
            for i in range(args.streams):
                nursery.start_soon(one, i)
    return ttfts, tpots


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="llama3-8b-h100", choices=sorted(PROFILES))
    parser.add_argument("--time-scale", type=float, default=0.5)
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--input-len", type=int, default=2000)
    parser.add_argument("--output-len", type=int, default=100)
    parser.add_argument("--stagger", type=float, default=0.05, help="seconds (GPU time) between arrivals")
    args = parser.parse_args(argv)
    cost_tables()
    tmp = Path(tempfile.mkdtemp(prefix="orch-simbench-"))
    workers = SimWorkers(tmp)
    flags = ("--profile", args.profile, "--time-scale", repr(args.time_scale))
    try:
        agg = {"aggregated": [workers.start("aggregated", *flags).address for _ in range(2)]}
        dis = {"prefill": [workers.start("prefill", *flags).address],
               "decode": [workers.start("decode", *flags).address]}
        results = {mode: trio.run(drive, mode, addresses, args) for mode, addresses in
                   (("aggregated", agg), ("disaggregated", dis))}
    finally:
        workers.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nload point: {args.streams} streams, {args.input_len} prompt tokens, {args.output_len} output tokens, "
          f"one arrival every {args.stagger * 1e3:.0f} ms, profile {args.profile}, 2 GPUs each (GPU time)")
    print(f"{'topology':28} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}  (ms)")
    for mode, label in (("aggregated", "2 x aggregated"), ("disaggregated", "1 prefill + 1 decode")):
        ttfts, tpots = results[mode]
        print(f"{label:28} {statistics.median(ttfts) * 1e3:9.1f} {percentile(ttfts, 99) * 1e3:9.1f} "
              f"{statistics.median(tpots) * 1e3:9.2f} {percentile(tpots, 99) * 1e3:9.2f}")
    agg_tpot = statistics.median(results["aggregated"][1])
    dis_tpot = statistics.median(results["disaggregated"][1])
    print(f"TPOT p50 aggregated / disaggregated: {agg_tpot / dis_tpot:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
