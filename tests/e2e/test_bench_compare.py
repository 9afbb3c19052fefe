"""`orchestrator bench compare` end to end on a tiny workload; `bench run` against a live endpoint."""

import json
import subprocess

import pytest

from orchestrator.testkit.plugin import orchestrator_command

pytest.importorskip("matplotlib")
METRICS = ["ttft_s", "tpot_s", "itl_s", "e2e_s", "request_throughput", "output_tokens_per_s",
           "tokens_per_s_per_user", "tokens_per_s_per_gpu", "goodput", "errors"]


def test_a_tiny_compare_writes_results_markdown_and_plots(tmp_path):
    # time_scale 0.1 keeps decode steps ~1 ms apart in wall time: at 0.02 (0.2 ms) a loaded 2-core CI box
    # reads a whole 12-token stream in one recv and TPOT comes out 0.
    spec = tmp_path / "tiny.yaml"
    spec.write_text("""
profile: llama3-8b-h100
time_scale: 0.1
topologies:
  - {name: agg 2x, mode: aggregated, workers: {aggregated: 2}}
  - {name: disagg 1P+1D, mode: disaggregated, workers: {prefill: 1, decode: 1}}
workload: {input_len: "200:400", output_len: "12", requests: 6, warmup: 1, image_share: 0.3, seed: 3,
           concurrency: [1, 3]}
slo: {ttft_s: 1.0, tpot_s: 0.05}
""")
    out = tmp_path / "report"
    result = subprocess.run(orchestrator_command("bench", "compare", str(spec), "--out", str(out)),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads((out / "results.json").read_text())
    assert [t["name"] for t in document["topologies"]] == ["agg 2x", "disagg 1P+1D"]
    for topology in document["topologies"]:
        assert topology["gpus"] == 2
        assert [p["load"] for p in topology["points"]] == [1, 3]
        for point in topology["points"]:
            for metric in METRICS:
                assert metric in point, metric
            assert point["completed"] == 6 and point["errors"] == {}
            assert point["ttft_s"]["p50"] > 0 and point["tpot_s"]["p50"] > 0 and point["output_tokens_per_s"] > 0
            # below time scale 1, a zero-cost twin measured the deployment's own time, left unscaled
            assert point["overhead_s"]["ttft_s"] > 0
    report = (out / "report.md").read_text()
    for heading in ("TTFT p50 ms", "TPOT p99 ms", "ITL p50 ms", "E2E p50 s", "req/s", "tok/s/user", "tok/s/GPU",
                    "goodput req/s", "errors", "## Who wins where", "agg 2x", "disagg 1P+1D"):
        assert heading in report, heading
    for plot in ("pareto.png", "ttft.png", "tpot.png"):
        data = (out / plot).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000
        assert f"![{plot}]({plot})" in report


def test_compare_refuses_a_spec_without_topologies(tmp_path):
    spec = tmp_path / "empty.yaml"
    spec.write_text("workload: {concurrency: [1]}\n")
    result = subprocess.run(orchestrator_command("bench", "compare", str(spec), "--out", str(tmp_path / "o")),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "topologies: expected at least one topology" in result.stderr
