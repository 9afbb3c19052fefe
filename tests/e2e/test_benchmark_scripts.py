"""The performance scripts in benchmarks/ still run and print what they promise (tiny sizes: the figures
themselves belong to benchmark runs, not to tests)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run(script: str, *args: str, scratch: Path | None = None) -> str:
    """The script's output; with `scratch`, its temporary directory (TMPDIR), which must be empty afterwards."""
    env = None if scratch is None else {**os.environ, "TMPDIR": str(scratch)}
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    if scratch is not None:
        assert list(scratch.iterdir()) == [], "left behind in the temporary directory"
    return done.stdout


def test_cpu_cost_prints_a_b_events_per_token_and_the_retained_fraction_for_each_variant():
    out = run("cpu_cost.py", "--requests", "16", "--concurrency", "4", "--max-tokens", "1", "8",
              "--modes", "aggregated", "--processes", "1", "--stream-transports", "h2",
              "grpcio", "--retained-max-tokens", "4", "--retained-per-slot", "1", "--retained-rounds", "1",
              "--idle-seconds", "0.5", "--fit-rounds", "2")
    rows = {m.group(1): m for m in re.finditer(
        r"^aggregated\s+(native x1(?: grpcio)?)\s+([\d.]+)\s+1\.0\s+(-?[\d.]+)\s+20\s+([\d.]+)\s+(\d+)\s+(\d+)"
        r"\s+([\d.]+)",
        out, re.M)}
    assert set(rows) == {"native x1", "native x1 grpcio"}, out
    for row in rows.values():
        assert float(row.group(2)) > 0 and float(row.group(4)) == 1.0  # CPU per request; one event per token
        assert int(row.group(5)) > 0 and int(row.group(6)) > 0
    assert "aggregated: native x1 grpcio/native x1" in out and "idle:" in out and "serve/floor" in out
    assert len(re.findall(r"over 2 rounds: a -?[\d.]+--?[\d.]+ ms, b -?[\d.]+--?[\d.]+ us/tok", out)) == 2, out


def test_cpu_cost_splits_the_c64_cpu_among_workers_serve_and_client_and_prints_what_0_9_leaves_serve(tmp_path):
    out = run("cpu_cost.py", "--requests", "8", "--concurrency", "4", "--max-tokens", "1", "4",
              "--modes", "aggregated", "--processes", "1", "--stream-transports", "h2",
              "--retained-max-tokens", "4", "--retained-per-slot", "1", "--retained-rounds", "1",
              "--idle-seconds", "0.2", "--fit-rounds", "1", scratch=tmp_path)
    direct = re.search(r"direct: workers (\d+) \+ our client (\d+) = (\d+) us, ([\d.]+) cores busy", out)
    through = re.search(r"via us: workers (\d+) \+ serve (\d+) \+ load generator (\d+) = (\d+) us, "
                        r"([\d.]+) cores busy", out)
    assert direct and through, out
    workers, client, total = (int(direct.group(i)) for i in (1, 2, 3))
    assert workers > 0 and client > 0 and abs(workers + client - total) <= 1
    workers, serve, generator, total = (int(through.group(i)) for i in (1, 2, 3, 4))
    assert workers > 0 and serve > 0 and generator > 0 and abs(workers + serve + generator - total) <= 2
    assert 0 < float(through.group(5)) <= 2.05 * 2  # at most every core (schedstat rounding aside)
    table = re.search(r"^aggregated\s+native x1\s+[\d.]+\s+1\.0\s+-?[\d.]+\s+20\s+[\d.]+\s+(\d+)", out, re.M)
    budget = re.search(r"0\.9 x (\d+) tok/s on (\d+) full cores leaves (\d+) us per token, serve's share (-?\d+) us "
                       r"after the workers and load generator as measured \(it spent (\d+)\)", out)
    assert table and budget, out
    rate, cores, left = int(budget.group(1)), int(budget.group(2)), int(budget.group(3))
    assert rate == int(table.group(1))  # the c=64 direct rate of the table
    # the rate is printed rounded to a whole token/s, so `left` is known only within that rounding
    assert cores / (0.9 * (rate + 0.5)) * 1e6 - 1 <= left <= cores / (0.9 * (rate - 0.5)) * 1e6 + 1
    assert abs(int(budget.group(4)) - (left - workers - generator)) <= 2 and int(budget.group(5)) == serve


def test_http2_framing_prints_ours_against_h2():
    out = run("http2_framing.py", "--streams", "50", "--frames", "400")
    assert re.search(r"^ours \(engine/http2.py\)\s+[\d.]+\s+[\d.]+$", out, re.M), out
    assert re.search(r"^ours/h2: per call [\d.]+x, per frame [\d.]+x$", out, re.M), out


def test_kv_event_flood_prints_the_bound_held_the_rss_and_the_loop_lateness():
    out = run("kv_event_flood.py", "--seconds", "1.5", "--quiet-seconds", "0.5")
    found = re.search(r"index peak ([\d,]+) blocks \(bound ([\d,]+)\)", out)
    assert found is not None, out
    peak, bound = (int(n.replace(",", "")) for n in found.groups())
    applied = re.search(r"applied (\d+)", out)
    # the flood reached the index, and no sample ever saw more than the bound (the sampler, every 50 ms, can miss
    # a fill that the bound's refusal cleared on a starved machine: the applied batches say the flood got in)
    assert applied is not None and int(applied.group(1)) > 0 and peak <= bound, out
    assert re.search(r"RSS fresh \d+ MB  peak during the flood \d+ MB", out), out
    assert "loop lateness quiet:" in out and "loop lateness flooded:" in out and "p99 flooded / quiet" in out


def test_kv_event_flood_over_http_prints_request_latency_quiet_and_flooded():
    out = run("kv_event_flood.py", "--http", "--seconds", "2", "--quiet-seconds", "1", "--clients", "2",
              "--time-scale", "0")
    found = re.search(r"index peak ([\d,]+) blocks \(bound ([\d,]+)\)", out)
    assert found is not None, out
    assert int(found.group(1).replace(",", "")) <= int(found.group(2).replace(",", "")), out
    assert "request latency quiet:" in out and "request latency flooded:" in out and "p99 flooded / quiet" in out


def test_time_scale_agreement_prints_ttft_and_tpot_at_both_time_scales_round_by_round(tmp_path):
    out = run("time_scale_agreement.py", "--rounds", "1", "--requests", "2", "--warmup", "0", "--input-len", "64",
              "--output-len", "12", scratch=tmp_path)
    assert re.search(r"^round 0 \(loadavg [\d. ]+\): time scale 1: TTFT p50 [\d.]+ ms, TPOT p50 [\d.]+ ms; 0\.1: wall "
                     r"TTFT [\d.]+ ms, without a baseline [\d.]+ ms; with the baseline \(its TTFT [\d.]+ ms\): TTFT "
                     r"[\d.]+ ms, TPOT [\d.]+ ms$", out, re.M), out
    for line in ("TTFT p50 ms, time scale 1:", "TTFT p50 ms, time scale 0.1, wall clock:",
                 "TTFT p50 ms, baseline at 0, wall clock:", "TTFT p50 ms, time scale 0.1 with the baseline:",
                 "TPOT p50 ms, time scale 1:", "TPOT p50 ms, time scale 0.1 with the baseline:"):
        assert line in out, out
