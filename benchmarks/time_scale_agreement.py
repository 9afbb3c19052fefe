"""Do `orchestrator bench run`'s figures at time scales 1 and 0.1 agree (issue 44)?

The demo deployment (configs/disagg.yaml, its Qwen3-like thinking persona included) is launched once per baseline
time scale (0, and a paced one, 0.02 by default) and, for each round, freshly at time scales 1 and 0.1; rounds
interleave them, so that a change in the host's load shows in all of them. Each point is what `bench run
--concurrency 1` computes (the same functions: run_concurrency, Overhead.measure, to_gpu_time, aggregate): at 0.1
the baselines run just before the measured requests, one request at a time, and the measured records are converted
with each baseline in turn, so the baselines are compared on the same records. Prints one line per round with
/proc/loadavg, then the medians over the rounds.

    .venv/bin/python benchmarks/time_scale_agreement.py --rounds 3 --requests 24
"""

from __future__ import annotations

import argparse
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
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def p50_ms(records, time_scale: float, overhead: Overhead | None) -> tuple[float, float]:
    """TTFT and TPOT p50 (ms) as bench run reports them."""
    point = aggregate(to_gpu_time(records, time_scale, overhead, closed_loop=True))
    return point["ttft_s"]["p50"] * 1e3, point["tpot_s"]["p50"] * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "disagg.yaml", help="the deployment")
    parser.add_argument("--time-scale", type=float, default=0.1, help="the compressed time scale")
    parser.add_argument("--baselines", type=float, nargs="+", default=[0.0, 0.02],
                        help="baseline time scales compared on the same records")
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
        baselines = {scale: launch(args.config, scale, workdir, f"baseline-{scale:g}") for scale in args.baselines}
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
                    overheads = {scale: Overhead.measure(trio.run(partial(run, base_url, label=f"baseline {scale:g}")),
                                                         scale) for scale, (_, base_url) in baselines.items()}
                    records = trio.run(partial(run, url, label=f"time scale {args.time_scale:g}"))
                finally:
                    process.stop()
                row["without"] = p50_ms(records, args.time_scale, None)
                for scale, overhead in overheads.items():
                    row[f"base {scale:g}"] = (*p50_ms(records, args.time_scale, overhead), overhead.ttft_s * 1e3)
                rows.append(row)
                print(f"round {index} (loadavg {row['load']}): time scale 1: TTFT p50 {row['1'][0]:.1f} ms, TPOT p50 "
                      f"{row['1'][1]:.2f} ms; {args.time_scale:g} without a baseline: TTFT {row['without'][0]:.1f}; "
                      + "; ".join(f"with baseline at {scale:g} (its TTFT {row[f'base {scale:g}'][2]:.1f} ms): TTFT "
                                  f"{row[f'base {scale:g}'][0]:.1f} ms, TPOT {row[f'base {scale:g}'][1]:.2f} ms"
                                  for scale in args.baselines), flush=True)
        finally:
            for process, _ in baselines.values():
                process.stop()
    print()

    def series(key: str, item: int) -> str:
        values = [row[key][item] for row in rows]
        return " / ".join(f"{v:.1f}" for v in values) + f" (median {statistics.median(values):.1f})"

    print(f"TTFT p50 ms, time scale 1: {series('1', 0)}")
    for scale in args.baselines:
        print(f"TTFT p50 ms, time scale {args.time_scale:g} with baseline {scale:g}: {series(f'base {scale:g}', 0)}")
    print(f"TPOT p50 ms, time scale 1: {series('1', 1)}")
    for scale in args.baselines:
        print(f"TPOT p50 ms, time scale {args.time_scale:g} with baseline {scale:g}: {series(f'base {scale:g}', 1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
