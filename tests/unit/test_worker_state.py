"""A pool worker's states: the whole transition table, and when capabilities are read again."""

import pytest

from orchestrator.workers.states import TRANSITIONS, WorkerEvent, WorkerState, next_state, rereads_capabilities

S, E = WorkerState, WorkerEvent
ACTIVE = [S.CONNECTING, S.READY, S.UNHEALTHY, S.MISCONFIGURED]


def test_the_table_covers_every_state_and_event():
    assert set(TRANSITIONS) == {(state, event) for state in S for event in E}


@pytest.mark.parametrize("state", ACTIVE)
@pytest.mark.parametrize("event, target", [
    (E.HEALTHY, S.READY), (E.IDENTITY_MISMATCH, S.MISCONFIGURED), (E.UNHEALTHY, S.UNHEALTHY),
    (E.UNREACHABLE, S.UNHEALTHY), (E.REMOVED, S.REMOVING),
])
def test_what_an_event_does_does_not_depend_on_the_state_before_it(state, event, target):
    assert next_state(state, event) is target


@pytest.mark.parametrize("event", list(E))
def test_removing_is_final(event):
    assert next_state(S.REMOVING, event) is S.REMOVING


@pytest.mark.parametrize("previous, rereads", [
    (S.CONNECTING, False), (S.READY, False), (S.UNHEALTHY, True), (S.MISCONFIGURED, True),
])
def test_a_worker_back_from_trouble_is_asked_again_what_it_can_do(previous, rereads):
    assert rereads_capabilities(previous, E.HEALTHY) is rereads
    assert not rereads_capabilities(previous, E.UNHEALTHY)


def test_there_is_no_draining_state_because_trtllm_has_none():
    """openengine v0.1.0 (what TensorRT-LLM serves) has no DRAINING health state: a draining worker says
    NOT_READY, which is UNHEALTHY here (tests/e2e/test_trtllm_conformance.py, UPSTREAM health-states)."""
    assert "draining" not in {state.value for state in S}
    assert "draining" not in {event.value for event in E}
