"""`orchestrator bench plan`: the virtual-clock cluster charges exactly the simulator's cost model, and the
planner ranks every topology of a GPU budget."""

import json

import pytest

from orchestrator.bench.compare import SloSpec
from orchestrator.bench.plan import (
    PlanSpec,
    PlanWorkload,
    Topology,
    VirtualCluster,
    load_plan_spec,
    main_plan,
    pareto_frontier,
    topologies,
)
from orchestrator.config import ConfigError
from orchestrator.sim.profiles import PROFILES

PROFILE = PROFILES["llama3-8b-h100"]


def test_one_aggregated_request_costs_one_prefill_step_then_one_decode_step_per_token():
    (record,) = VirtualCluster(Topology("aggregated", aggregated=1), PROFILE, 0).run([(2000, 5)], concurrency=1)
    assert record.ttft == pytest.approx(PROFILE.prefill_ms([2000]) / 1000)
    decode = sum(PROFILE.decode_ms([2000 + k]) for k in range(1, 5))
    assert record.e2e == pytest.approx((PROFILE.prefill_ms([2000]) + decode) / 1000)
    assert record.output_tokens == 5


def test_a_disaggregated_request_pays_the_kv_transfer_before_its_first_token():
    cluster = VirtualCluster(Topology("disaggregated", prefill=1, decode=1), PROFILE, 0)
    (record,) = cluster.run([(2000, 3)], concurrency=1)
    handoff = (PROFILE.prefill_ms([2000]) + PROFILE.kv_transfer_ms(2000)) / 1000
    assert record.ttft == pytest.approx(handoff)
    assert record.e2e == pytest.approx(handoff + sum(PROFILE.decode_ms([2000 + k]) for k in (1, 2)) / 1000)
    for worker in cluster.workers["prefill"] + cluster.workers["decode"]:
        assert worker.scheduler.used_blocks == 0 and worker.scheduler.idle  # sessions pulled, nothing held


def test_conditional_mode_prefills_short_prompts_on_the_decode_worker():
    cluster = VirtualCluster(Topology("conditional", prefill=1, decode=1), PROFILE, max_local_prefill_length=500)
    records = cluster.run([(400, 2), (2000, 2)], concurrency=2)
    assert cluster.workers["prefill"][0].scheduler.steps > 0
    short = next(r for r in records if r.input_tokens == 400)
    assert short.ttft == pytest.approx(PROFILE.prefill_ms([400]) / 1000, rel=0.5)  # no KV transfer on the way


def test_every_topology_of_the_budget_is_considered():
    names = [t.name for t in topologies(PlanSpec(gpus=4))]
    assert names == ["aggregated 4x", "disaggregated 1P:3D", "disaggregated 2P:2D", "disaggregated 3P:1D",
                     "conditional 1P:3D", "conditional 2P:2D", "conditional 3P:1D"]
    assert all(t.gpus == 4 for t in topologies(PlanSpec(gpus=4)))


def test_the_pareto_frontier_keeps_only_undominated_points():
    points: list[tuple[float, float]] = [(1, 10), (2, 9), (2, 5), (3, 3), (1.5, 4), (3, 8)]
    assert pareto_frontier(points) == [(1, 10), (2, 9), (3, 8)]


def test_a_plan_ranks_topologies_by_goodput_per_gpu_and_writes_its_report(tmp_path):
    spec_file = tmp_path / "plan.yaml"
    spec_file.write_text("gpus: 3\nprofile: llama3-8b-h100\nworkload: {input_len: '1000:2000', output_len: '40', "
                         "requests: 40, concurrency: [4, 16]}\nslo: {ttft_s: 1.0, tpot_s: 0.015}\n")
    assert main_plan(spec_file, tmp_path / "out", aiconfigurator=None) == 0
    document = json.loads((tmp_path / "out" / "results.json").read_text())
    ranked = [t["best"]["goodput_per_gpu"] for t in document["topologies"]]
    assert ranked == sorted(ranked, reverse=True) and len(ranked) == 5
    assert all(p["completed"] == 40 for t in document["topologies"] for p in t["points"])
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"**Choose {document['topologies'][0]['name']}**" in report
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 1000
    assert "aiconfigurator was not installed" in report


@pytest.mark.parametrize("text, key", [
    ("gpus: 0\n", "gpus"),
    ("modes: [aggregated, mixed]\n", "modes[1]"),
    ("profile: nope\n", "profile"),
    ("workload: {input_len: 'x'}\n", "workload.input_len"),
    ("workload: {concurrency: []}\n", "workload.concurrency"),
])
def test_plan_file_errors_name_the_key(tmp_path, text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_plan_spec(path)


def test_defaults_are_a_complete_spec():
    assert PlanSpec().workload == PlanWorkload() and PlanSpec().slo == SloSpec()
