"""What NVIDIA aiperf reports against us: token counts, time to second token, ITL against inter-chunk latency.

    python benchmarks/aiperf_check.py [--install] [--modes aggregated disaggregated]

aiperf lives in its own virtualenv (.venv-aiperf; `--install` creates it from PyPI), since its
dependencies are not ours. For each mode, sim workers at `--time-scale` (so tokens are milliseconds
apart, as on a GPU) and an `orchestrator serve` in front, first with one SSE event per token (the
default), then with `http.coalesce_tokens: true`; aiperf streams chat completions with ignore_eos
and a fixed output length. Printed side by side: TTFT, time to second token and ITL p50, inter-chunk
latency p50 (equal to ITL when every event carries one token), aiperf's output sequence length
against the usage the server reported, and whether the run looks sane (OSL = usage = max tokens,
time to second token p50 > 0). Keep the time scale at 0.1 or above: at 0.05 tokens are 0.35 ms
apart and aiperf's own client reads several events per receive (inter-chunk latency 0), whatever
the server sends.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from orchestrator.models import TINY_CHAT
from orchestrator.testkit.plugin import write_config
from orchestrator.testkit.processes import OrchestratorServers, SimWorkers

ROOT = Path(__file__).resolve().parent.parent
AIPERF_VENV = ROOT / ".venv-aiperf"
AIPERF_REQUIREMENT = "aiperf>=0.13,<0.14"


def aiperf_binary(install: bool) -> str:
    binary = AIPERF_VENV / "bin" / "aiperf"
    if not binary.exists() and install:
        subprocess.run([sys.executable, "-m", "venv", str(AIPERF_VENV)], check=True)
        subprocess.run([str(AIPERF_VENV / "bin" / "pip"), "install", "-q", AIPERF_REQUIREMENT], check=True)
    if binary.exists():
        return str(binary)
    found = shutil.which("aiperf")
    if found is None:
        raise SystemExit("aiperf not found: run with --install (creates .venv-aiperf from PyPI)")
    return found


def run_aiperf(binary: str, url: str, out: Path, args) -> dict:
    command = [binary, "profile", "--model", "tiny-chat", "--url", url, "--endpoint-type", "chat", "--streaming",
               "--tokenizer", str(TINY_CHAT), "--concurrency", str(args.concurrency),
               "--request-count", str(args.requests), "--synthetic-input-tokens-mean", "200",
               "--output-tokens-mean", str(args.max_tokens), "--extra-inputs", "ignore_eos:true",
               "--ui-type", "none", "--artifact-dir", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"aiperf failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads((out / "profile_export_aiperf.json").read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--install", action="store_true", help=f"create .venv-aiperf with {AIPERF_REQUIREMENT}")
    parser.add_argument("--modes", nargs="+", default=["aggregated", "disaggregated"])
    parser.add_argument("--time-scale", type=float, default=0.5, help="the sim workers' (default 0.5)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    binary = aiperf_binary(args.install)
    rows = []
    with tempfile.TemporaryDirectory(prefix="orch-aiperf-") as scratch:
        tmp = Path(scratch)
        for mode in args.modes:
            for coalesce in (False, True):
                workers, servers = SimWorkers(tmp), OrchestratorServers(tmp)
                try:
                    roles = ("aggregated",) if mode == "aggregated" else ("prefill", "decode")
                    addresses = {role: workers.start(role, "--time-scale", str(args.time_scale)).address
                                 for role in roles}
                    label = f"{mode}-{'coalesced' if coalesce else 'per-token'}"
                    config = write_config(tmp / f"{label}.yaml", mode, {r: [a] for r, a in addresses.items()},
                                          http={"coalesce_tokens": coalesce})
                    server = servers.start(config, env={"ORCH_LOG_LEVEL": "WARNING"})
                    rows.append((mode, coalesce, run_aiperf(binary, server.url, tmp / label, args)))
                finally:
                    servers.close()
                    workers.close()
    report(rows, args)
    return 0


def report(rows, args) -> None:
    print(f"aiperf {rows[0][2].get('aiperf_version', '?')}: c={args.concurrency}, {args.requests} requests, "
          f"{args.max_tokens} output tokens, sim time scale {args.time_scale}; p50 in ms")
    print(f"{'mode':14} {'events':10} {'TTFT':>7} {'TTST':>7} {'ITL':>7} {'inter-chunk':>11} {'chunk/ITL':>9} "
          f"{'OSL':>6} {'usage':>6} {'sane':>5}")
    for mode, coalesce, doc in rows:
        p50 = {key: doc[key]["p50"] for key in ("time_to_first_token", "time_to_second_token", "inter_token_latency",
                                                  "inter_chunk_latency")}
        osl, usage = doc["output_sequence_length"]["avg"], doc["usage_completion_tokens"]["avg"]
        sane = osl == usage == args.max_tokens and p50["time_to_second_token"] > 0
        print(f"{mode:14} {'coalesced' if coalesce else 'per token':10} {p50['time_to_first_token']:7.2f} "
              f"{p50['time_to_second_token']:7.2f} {p50['inter_token_latency']:7.2f} "
              f"{p50['inter_chunk_latency']:11.2f} {p50['inter_chunk_latency'] / p50['inter_token_latency']:9.2f} "
              f"{osl:6.1f} {usage:6.1f} {'yes' if sane else 'NO':>5}")


if __name__ == "__main__":
    sys.exit(main())
