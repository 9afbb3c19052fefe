"""The orchestrator's own CPU per request and per streamed token, counted in instructions: a repeatable A/B.

    python benchmarks/instruction_cost.py [--against DIR ...] [--modes aggregated disaggregated]
                                          [--requests 96] [--max-tokens 1 64] [--rounds 2]

benchmarks/cpu_cost.py times `orchestrator serve` in CPU seconds, which on a shared 2-core VM swing by
+-25% from run to run: telling a 3% change from noise takes many paired runs. Here the same streamed
requests go through `orchestrator serve` run under valgrind's callgrind, and what is read is the number of
instructions serve executed for them (`callgrind_control -e Ir`): the same code on the same inputs gives
nearly the same count whatever else the machine is doing, so one run compares trees to well under 1%.

Each tree (this checkout, and every `--against DIR`, e.g. a `git worktree` of an older commit) serves the
same zero-cost simulated workers (started from this checkout) in turn, with PYTHONHASHSEED fixed. Serve
starts with instrumentation off (start-up is not counted), takes warm-up requests, then counts
instructions over `--requests` streams per max_tokens value, in `--rounds` rounds where the trees take
turns. Per request: a + b * tokens fitted through the max_tokens values; the medians over rounds are
printed with each tree's ratio to the first. Idle: instructions per second with no request, health checks
every second (the shipped default), counted once per tree.

What it does not show: time spent waiting in the kernel, and any effect of serve running ~50x slower
under valgrind than the workers (more tokens arrive per read than in real time). It answers "did the
Python path get longer?", not "how many requests per second?": cpu_cost.py stays the figure users see.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from orchestrator.processes import ManagedProcess
from orchestrator.testkit.plugin import write_config
from orchestrator.testkit.processes import SimWorkers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_cost import fit_line
from overhead import ThroughOrchestrator, run_slots

HERE = Path(__file__).resolve().parent.parent


def instructions(pid: int) -> int:
    """Instructions (Ir) serve has executed since its counters were last zeroed, read while it runs."""
    out = subprocess.run(["callgrind_control", "-e", "Ir", str(pid)], capture_output=True, text=True,
                         check=True).stdout
    _, found, totals = out.partition("Totals:")
    threads = re.findall(r"Th\s+\d+\s+([\d,]+)", totals)  # one line per thread: serve's loop, gRPC's
    if not found or not threads:
        raise RuntimeError(f"callgrind_control printed no totals for pid {pid}:\n{out}")
    return sum(int(count.replace(",", "")) for count in threads)


def callgrind(pid: int, *flags: str) -> None:
    subprocess.run(["callgrind_control", *flags, str(pid)], capture_output=True, check=True)


class CountedServe:
    """`orchestrator serve` from one tree, under callgrind with instrumentation off until warmed up."""

    def __init__(self, tree: Path, config: Path, log_dir: Path, label: str):
        env = {"PYTHONPATH": str(tree), "PYTHONHASHSEED": "0", "ORCH_LOG_LEVEL": "WARNING"}
        # -P: `python -m` would put the working directory first on sys.path, ahead of PYTHONPATH, and so
        # import this checkout whatever the tree.
        argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={log_dir}/cg.%p",
                sys.executable, "-P", "-m", "orchestrator", "serve", "-c", str(config), "--port", "0"]
        self.process = ManagedProcess(f"serve-{label}", argv, log_dir=log_dir, env=env)
        self.url = self.process.wait_ready(300.0)

    def close(self) -> None:
        self.process.stop()


async def count(serve: CountedServe, max_tokens: list[int], requests: int, concurrency: int
                ) -> list[tuple[float, float]]:
    """(tokens per request, instructions per request) for each max_tokens value."""
    points = []
    for tokens in max_tokens:
        streams = ThroughOrchestrator(serve.url, tokens)
        callgrind(serve.process.pid, "-z")
        before = instructions(serve.process.pid)
        await run_slots(concurrency, requests // concurrency, streams)
        spent = instructions(serve.process.pid) - before
        points.append((streams.tokens / requests, spent / requests))
    return points


def idle_instructions(serve: CountedServe, seconds: float) -> float:
    """Instructions per second serve spends with no request at all (health polls, timers); stops serve."""
    try:
        time.sleep(2.0)  # past start-up and the first polls
        callgrind(serve.process.pid, "-i", "on")
        time.sleep(2.0)
        callgrind(serve.process.pid, "-z")
        before, start = instructions(serve.process.pid), time.monotonic()
        time.sleep(seconds)
        return (instructions(serve.process.pid) - before) / (time.monotonic() - start)
    finally:
        serve.close()


async def warm_up(serve: CountedServe, max_tokens: list[int], concurrency: int) -> None:
    for tokens in max_tokens:
        await run_slots(concurrency, 2, ThroughOrchestrator(serve.url, tokens))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, nargs="*", default=[],
                        help="other source trees (e.g. `git worktree add /tmp/base COMMIT`) to compare with")
    parser.add_argument("--modes", nargs="+", default=["aggregated", "disaggregated"])
    parser.add_argument("--requests", type=int, default=96, help="streams per max_tokens value per round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=2, help="rounds in which the trees take turns")
    parser.add_argument("--reasoning-parser", default=None,
                        help="model.reasoning_parser for serve (e.g. qwen3): every chat answer then goes through the "
                             "output parser, so a run with and one without show what parsing costs per token")
    parser.add_argument("--idle-seconds", type=float, default=10.0,
                        help="how long idle instructions are counted, health checks every second (0: not)")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.error("valgrind is not installed (Debian: apt-get install valgrind)")
    trees = [HERE, *(tree.resolve() for tree in args.against)]
    for tree in trees:
        if not (tree / "orchestrator" / "__main__.py").exists():
            parser.error(f"--against {tree}: not a source tree of the orchestrator (no orchestrator/__main__.py)")
    tmp = Path(tempfile.mkdtemp(prefix="orch-instructions-"))
    workers = SimWorkers(tmp)
    results: dict[tuple[str, Path], list[list[tuple[float, float]]]] = {}
    idle: dict[tuple[str, Path], float] = {}
    try:
        for mode in args.modes:
            roles = ("aggregated",) if mode == "aggregated" else ("prefill", "decode")
            addresses = {role: workers.start(role, "--time-scale", "0").address for role in roles}
            # Health polls run on a timer, so slow serve would count more of them: one poll a minute.
            model = {"reasoning_parser": args.reasoning_parser} if args.reasoning_parser else {}
            config = write_config(tmp / f"{mode}.yaml", mode, {r: [a] for r, a in addresses.items()},
                                  limits={"health_interval_s": 60.0}, model=model)
            if args.idle_seconds > 0:
                idle_config = write_config(tmp / f"{mode}-idle.yaml", mode, {r: [a] for r, a in addresses.items()},
                                           limits={"health_interval_s": 1.0})  # the shipped default
                for index, tree in enumerate(trees):
                    idle[(mode, tree)] = idle_instructions(CountedServe(tree, idle_config, tmp, f"{mode}-{index}-idle"),
                                                           args.idle_seconds)
            for round_ in range(args.rounds):
                for index, tree in enumerate(trees):
                    serve = CountedServe(tree, config, tmp, f"{mode}-{index}-{round_}")
                    try:
                        trio.run(warm_up, serve, args.max_tokens, args.concurrency)
                        callgrind(serve.process.pid, "-i", "on")
                        trio.run(warm_up, serve, args.max_tokens, args.concurrency)  # paths seen instrumented
                        points = trio.run(count, serve, args.max_tokens, args.requests, args.concurrency)
                    finally:
                        serve.close()
                    results.setdefault((mode, tree), []).append(points)
            workers.close()
    finally:
        workers.close()
        shutil.rmtree(tmp, ignore_errors=True)
    report(results, idle, trees, args)
    return 0


def report(results, idle: dict[tuple[str, Path], float], trees: list[Path], args) -> None:
    print(f"instructions executed by `orchestrator serve` (callgrind Ir), {args.requests} streams per point, "
          f"c={args.concurrency}, {args.rounds} rounds, medians; ratio = tree / {trees[0]}")
    header = f"{'mode':<14} {'tree':<28} {'a: Ir/request':>14} {'b: Ir/token':>12}"
    header += "".join(f" {f'{t} tok: Ir/req':>17}" for t in args.max_tokens)
    header += f" {'idle Ir/s':>12}" if idle else ""
    header += "   ratios a / b" + (" / idle" if idle else "")
    print(header)
    for mode in args.modes:
        first = None
        for tree in trees:
            rounds = results[(mode, tree)]
            fits = [fit_line(points) for points in rounds]
            a, b = statistics.median(f[0] for f in fits), statistics.median(f[1] for f in fits)
            per_point = [statistics.median(r[i][1] for r in rounds) for i in range(len(args.max_tokens))]
            idle_rate = idle.get((mode, tree), 0.0)
            first = first or (a, b, idle_rate)
            name = str(tree) if len(str(tree)) <= 28 else "..." + str(tree)[-25:]
            line = f"{mode:<14} {name:<28} {a:>14,.0f} {b:>12,.0f}" + "".join(f" {p:>17,.0f}" for p in per_point)
            line += f" {idle_rate:>12,.0f}" if idle else ""
            line += f"   {a / first[0]:.3f} / {b / first[1]:.3f}"
            print(line + (f" / {idle_rate / first[2]:.3f}" if idle and first[2] else ""))


if __name__ == "__main__":
    os.environ.setdefault("ORCH_LOG_LEVEL", "WARNING")
    sys.exit(main())
