"""Do `orchestrator bench run`'s figures at time scales 1 and 0.1 agree (issue 44)?

The demo deployment (configs/disagg.yaml, its Qwen3-like thinking persona included) is launched once at time scale 0
(the baseline) and, for each round, freshly at time scales 1 and 0.1; rounds interleave them, so that a change in
the host's load shows in all of them. Each point is what `bench run --concurrency 1 --baseline-url` computes, with
the same functions (run_concurrency, Overhead.measure, to_gpu_time, aggregate): at 0.1 the baseline runs just before
the measured requests, one request at a time. Prints one line per round with /proc/loadavg, then each figure over
the rounds, the wall-clock TTFTs too: a run's TTFT minus time scale x the request's GPU time to its first visible
token is the deployment's own time on that path at that pacing, which the conversion takes from the baseline.

    .venv/bin/python benchmarks/time_scale_agreement.py --rounds 3 --requests 24
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path

import trio
import yaml

from orchestrator.bench.loadgen import Range, Workload, load_tokenizer, run_concurrency
from orchestrator.bench.metrics import Overhead, aggregate, to_gpu_time
from orchestrator.processes import ManagedProcess, orchestrator_command

ROOT = Path(__file__).resolve().parent.parent


def launch_config(source: Path, time_scale: float) -> dict:
    """`source` with every simulated worker at `time_scale` and the HTTP port chosen by the system."""
    config = yaml.safe_load(source.read_text())
    config["http"]["port"] = 0
    for worker in config["launch"]["workers"]:
        worker["sim"]["time_scale"] = time_scale
    return config


def launch(source: Path, time_scale: float, workdir: Path, name: str) -> tuple[ManagedProcess, str]:
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(launch_config(source, time_scale), sort_keys=False))
    process = ManagedProcess(name, orchestrator_command("launch", str(path)), log_dir=workdir,
                             env={"ORCH_LOG_LEVEL": "WARNING"}, tied=True)
    return process, process.wait_ready(120)


def loadavg() -> str:
    return " ".join(f"{load:.2f}" for load in os.getloadavg())


def p50_ms(records, time_scale: float, overhead: Overhead | None) -> tuple[float, float]:
    """TTFT and TPOT p50 (ms) as bench run reports them."""
    point = aggregate(to_gpu_time(records, time_scale, overhead, closed_loop=True))
    return point["ttft_s"]["p50"] * 1e3, point["tpot_s"]["p50"] * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "disagg.yaml", help="the deployment")
    parser.add_argument("--time-scale", type=float, default=0.1, help="the compressed time scale")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--requests", type=int, default=24, help="recorded requests per run")
    parser.add_argument("--warmup", type=int, default=2, help="unrecorded requests before each run")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="max_tokens")
    args = parser.parse_args()
    workload = Workload(model="tiny-chat", input_len=Range(args.input_len, args.input_len),
                        output_len=Range(args.output_len, args.output_len), requests=args.requests,
                        warmup=args.warmup)
    tokenizer = load_tokenizer("builtin:tiny-chat")
    run = partial(run_concurrency, workload=workload, tokenizer=tokenizer, concurrency=1)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="time-scale-") as tmp:
        workdir = Path(tmp)
        baseline_process, baseline = launch(args.config, 0.0, workdir, "baseline")
        try:
            for index in range(args.rounds):
                row: dict = {"load": loadavg()}
                process, url = launch(args.config, 1.0, workdir, f"r{index}-ts1")
                try:
                    row["1"] = p50_ms(trio.run(partial(run, url, label="time scale 1")), 1.0, None)
                finally:
                    process.stop()
                process, url = launch(args.config, args.time_scale, workdir, f"r{index}-ts{args.time_scale:g}")
                try:
                    overhead = Overhead.measure(trio.run(partial(run, baseline, label="baseline")))
                    records = trio.run(partial(run, url, label=f"time scale {args.time_scale:g}"))
                finally:
                    process.stop()
                row["without"] = p50_ms(records, args.time_scale, None)
                row["wall"] = p50_ms(records, 1.0, None)  # unconverted: the wall clock's TTFT and TPOT
                row["base"] = (*p50_ms(records, args.time_scale, overhead), overhead.ttft_s * 1e3)
                rows.append(row)
                print(f"round {index} (loadavg {row['load']}): time scale 1: TTFT p50 {row['1'][0]:.1f} ms, TPOT p50 "
                      f"{row['1'][1]:.2f} ms; {args.time_scale:g}: wall TTFT {row['wall'][0]:.2f} ms, without a "
                      f"baseline {row['without'][0]:.1f} ms; "
                      f"with the baseline (its TTFT {row['base'][2]:.1f} ms): TTFT {row['base'][0]:.1f} ms, TPOT "
                      f"{row['base'][1]:.2f} ms", flush=True)
        finally:
            baseline_process.stop()
    print()

    def series(key: str, item: int) -> str:
        values = [row[key][item] for row in rows]
        return " / ".join(f"{v:.1f}" for v in values) + f" (median {statistics.median(values):.1f})"

    print(f"TTFT p50 ms, time scale 1: {series('1', 0)}")
    print(f"TTFT p50 ms, time scale {args.time_scale:g}, wall clock: {series('wall', 0)}")
    print(f"TTFT p50 ms, baseline at 0, wall clock: {series('base', 2)}")
    print(f"TTFT p50 ms, time scale {args.time_scale:g} with the baseline: {series('base', 0)}")
    print(f"TPOT p50 ms, time scale 1: {series('1', 1)}")
    print(f"TPOT p50 ms, time scale {args.time_scale:g} with the baseline: {series('base', 1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
