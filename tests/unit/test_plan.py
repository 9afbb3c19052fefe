"""flow/plan.py: one frozen value per way a request runs, typed by its path."""

import attrs
import pytest

from orchestrator.convert import parse_chat
from orchestrator.flow.plan import PlanPath, SplitPlan, WholePlan, planned
from orchestrator.metrics import Metrics
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.roles import Role
from orchestrator.testkit.fakes import FakeEngineClient, fake_worker

API = parse_chat({"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]})
FULL = g.GenerateRequest(request_id="r1")


def worker(role: str, name: str):
    return fake_worker(role, FakeEngineClient(name))


def plan_of(path: PlanPath, *workers, target_ranks=()):
    return planned(path, workers, request_id="r1", api=API, full=FULL, prompt_tokens=3, target_ranks=target_ranks)


def test_a_split_plan_runs_a_prefill_leg_then_a_decode_leg():
    prefill, decode = worker("prefill", "p0"), worker("decode", "d0")
    plan = plan_of(PlanPath.DISAGGREGATED, prefill, decode)
    assert isinstance(plan, SplitPlan) and (plan.prefill, plan.decode) == (prefill, decode)
    assert plan.path is PlanPath.DISAGGREGATED and plan.workers == (prefill, decode)


@pytest.mark.parametrize(("path", "role"), [(PlanPath.AGGREGATED, "aggregated"), (PlanPath.LOCAL, "decode")])
def test_a_whole_plan_runs_one_leg_on_one_worker(path, role):
    one = worker(role, "w0")
    plan = plan_of(path, one)
    assert isinstance(plan, WholePlan) and plan.path is path and plan.workers == (one,)


def test_each_path_names_the_roles_of_its_workers_in_leg_order():
    assert PlanPath.AGGREGATED.roles == (Role.AGGREGATED,)
    assert PlanPath.LOCAL.roles == (Role.DECODE,)
    assert PlanPath.DISAGGREGATED.roles == (Role.PREFILL, Role.DECODE)


def test_a_plan_needs_one_worker_per_role_of_its_path():
    with pytest.raises(ValueError):
        plan_of(PlanPath.DISAGGREGATED, worker("decode", "d0"))


def test_a_whole_plan_is_never_the_split_path():
    with pytest.raises(ValueError):
        WholePlan(request_id="r1", api=API, full=FULL, prompt_tokens=3, path=PlanPath.DISAGGREGATED,
                  worker=worker("decode", "d0"))


def test_a_plan_is_frozen_all_the_way_to_its_ranks():
    routed = worker("aggregated", "a0")
    plan = plan_of(PlanPath.AGGREGATED, routed, target_ranks=((routed, 2),))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.worker = worker("aggregated", "a1")
    assert isinstance(plan.target_ranks, tuple) and all(isinstance(pair, tuple) for pair in plan.target_ranks)


def test_the_target_rank_is_asked_only_of_the_worker_the_planner_routed_to():
    routed, other = worker("prefill", "p0"), worker("prefill", "p1")
    plan = plan_of(PlanPath.DISAGGREGATED, routed, worker("decode", "d0"), target_ranks=((routed, 3),))
    assert plan.target_rank(routed) == 3 and plan.target_rank(other) is None


def test_every_path_has_its_metric_series():
    assert set(Metrics().by_path) == set(PlanPath)
