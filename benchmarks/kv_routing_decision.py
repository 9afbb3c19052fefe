"""CPU of one kv_aware routing decision (orchestrator/workers/routing.py KvAware.decide), end to end.

    python benchmarks/kv_routing_decision.py [--workers 4] [--prompt-tokens 8192] [--block-size 32]

Printed, per decision for an `--prompt-tokens` prompt: computing its block keys (the plan's share,
prompt_block_keys), then decide(): the index's overlap (every worker holds a different part of the prefix, the
worst case walks every block), scoring the candidates by cost and load, and recording the decision
(KvIndex.routed). Target (issue 32): <= 100 us together. Process CPU time, best of a few rounds. The first
line times a fixed pure-Python loop (as benchmarks/kv_index.py does), so that figures from a loaded or slower
machine can be scaled.
"""

from __future__ import annotations

import argparse
import random
import time

from orchestrator.workers.kv_index import KvIndex, prompt_block_keys
from orchestrator.workers.routing import KvAware, LoadSample


class _Candidate:
    def __init__(self, address: str, requests: int):
        self.address, self.inflight, self.sent_since_load, self.finished_since_load = address, 0, 0, 0
        self.sample = LoadSample(0.0, requests, 100 * requests, 12000)
        self.targets_dp_rank, self.dp_size = False, 1

    def fresh_load(self, now: float, staleness: float) -> LoadSample:
        return self.sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    rng = random.Random(1)
    tokens = [rng.randrange(100, 30000) for _ in range(args.prompt_tokens)]
    keys = prompt_block_keys(tokens, args.block_size)
    index = KvIndex()
    candidates = [_Candidate(f"grpc://10.0.0.{i}:8000", i) for i in range(args.workers)]
    for i, worker in enumerate(candidates):
        index.set_mode(worker.address, "events")
        index.stored((worker.address, 0), keys[: len(keys) * (i + 1) // (args.workers + 1)])
    policy = KvAware(index, 1.0)

    def best(run) -> float:
        fastest = float("inf")
        for _ in range(5):
            start = time.process_time()
            for _ in range(args.rounds):
                run()
            fastest = min(fastest, (time.process_time() - start) / args.rounds)
        return fastest

    calibration = float("inf")
    for _ in range(20):
        start = time.process_time()
        sum(range(1_000_000))
        calibration = min(calibration, time.process_time() - start)
    print(f"calibration: sum(range(1_000_000)) takes {calibration * 1e3:.1f} ms of CPU here")
    keying = best(lambda: prompt_block_keys(tokens, args.block_size))
    deciding = best(lambda: policy.decide(candidates, 0.0, keys))
    print(f"{args.prompt_tokens}-token prompt ({len(keys)} blocks), {args.workers} workers: keys "
          f"{keying * 1e6:.0f} us + decide {deciding * 1e6:.0f} us = {(keying + deciding) * 1e6:.0f} us of CPU "
          f"(target <= 100 us)")


if __name__ == "__main__":
    main()
