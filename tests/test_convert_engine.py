"""The context-window rule, media gating and engine-leg building (pure)."""

import pytest

from orchestrator import disagg
from orchestrator.convert import ApiError, check_media_capability, full_leg, parse_chat, resolve_limits
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.openengine.v1 import kv_pb2

IMG = {"type": "image_url", "image_url": {"url": "https://a.example/1.png"}}


def text_request(**extra):
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})


def image_request(**extra):
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": [IMG, IMG]}],
                       "multi_modal_uuids": ["u1", "u2"], **extra})


def limits(req, prompt=10, configured=None, engine=100, max_output=50):
    return resolve_limits(req, prompt_tokens=prompt, configured_window=configured, engine_window=engine,
                          max_output_tokens=max_output)


def test_text_max_tokens_defaults_to_the_room_left_and_is_clamped_to_max_output():
    assert limits(text_request(), prompt=90).max_tokens == 10
    assert limits(text_request(), prompt=10).max_tokens == 50
    assert limits(text_request(max_tokens=80), prompt=10).max_tokens == 50
    assert limits(text_request(max_tokens=20), prompt=10).max_tokens == 20


def test_a_prompt_at_or_over_the_window_is_a_400_naming_both_numbers():
    with pytest.raises(ApiError) as info:
        limits(text_request(), prompt=100)
    assert "100 tokens" in info.value.message and "context window of 100" in info.value.message
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"


def test_a_configured_window_tighter_than_the_engine_applies_to_text():
    with pytest.raises(ApiError, match="context window of 40"):
        limits(text_request(), prompt=45, configured=40)
    with pytest.raises(ApiError, match="exceed the context window of 40"):
        limits(text_request(max_tokens=35), prompt=10, configured=40)


def test_image_requests_under_a_tighter_configured_window_are_refused():
    with pytest.raises(ApiError) as info:
        limits(image_request(), configured=40, engine=100)
    assert "configured context window of 40" in info.value.message and "own window is 100" in info.value.message


def test_image_requests_leave_max_tokens_unset_when_the_window_is_the_engines():
    assert limits(image_request()).max_tokens is None
    assert limits(image_request(), configured=100).max_tokens is None
    assert limits(image_request(max_tokens=500)).max_tokens == 50  # still clamped to max_output_tokens


def test_media_gating_names_the_role_that_refuses():
    check_media_capability(image_request(), [("prefill", True), ("decode", True)])
    check_media_capability(text_request(), [("prefill", False)])
    with pytest.raises(ApiError, match="does not accept images.*decode worker"):
        check_media_capability(image_request(), [("prefill", True), ("decode", False)])


def test_full_leg_carries_prompt_media_sampling_stopping_logprobs_and_guides():
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": [IMG]}], "seed": 7,
                      "temperature": 0.2, "stop": ["X"], "stop_token_ids": [9], "min_tokens": 1, "ignore_eos": True,
                      "logprobs": True, "top_logprobs": 2, "response_format": {"type": "json_object"},
                      "multi_modal_uuids": ["cat"]})
    leg = full_leg(req, request_id="r", model="m", prompt_ids=[1, 2], limits=limits(req))
    assert leg.request_id == "r" and list(leg.token_ids.ids) == [1, 2]
    assert leg.sampling.seed == 7 and leg.sampling.temperature == pytest.approx(0.2)
    assert not leg.sampling.HasField("top_p")
    assert [c.WhichOneof("condition") for c in leg.stopping.conditions] == ["stop_text", "stop_token_id"]
    assert not leg.stopping.HasField("max_tokens") and leg.stopping.min_tokens == 1 and leg.stopping.ignore_eos
    assert leg.response.return_output_logprobs and leg.response.output_candidates.top_n == 2
    assert leg.guided.WhichOneof("guide") == "json_object"
    (item,) = leg.media
    assert (item.modality, item.url, item.uuid) == (g.MODALITY_IMAGE, "https://a.example/1.png", "cat")


def _session():
    session = kv_pb2.KvSessionRef(session_id="ctx-1", transfer_backend="nixl", dp_rank=2,
                                  endpoints=[kv_pb2.KvEndpoint(host="10.0.0.1", port=5, protocol="tcp")])
    session.attributes_struct.update({"opaque_state": "b64==", "first_gen_tokens": [42], "draft_tokens": [],
                                      "disagg_request_id": "ctx-1", "ctx_usage": {"prompt_tokens": 9},
                                      "first_gen_log_probs": [], "schedule_style": "x"})
    return session


def test_context_only_leg_is_the_prompt_and_media_with_one_token_and_the_request_type():
    req = image_request(seed=5, stop=["Z"], logprobs=True)
    full = full_leg(req, request_id="r", model="m", prompt_ids=[1, 2, 3], limits=limits(req))
    ctx = disagg.context_only_leg(full)
    assert ctx.extra["request_type"] == "context_only" and ctx.stopping.max_tokens == 1
    assert not ctx.stopping.conditions and not ctx.HasField("response")
    assert ctx.token_ids == full.token_ids and list(ctx.media) == list(full.media) and ctx.sampling == full.sampling
    assert "request_type" not in full.extra  # the full request is untouched


def test_generation_leg_carries_the_session_untouched_and_the_same_prompt_and_media():
    req = image_request(max_tokens=5)
    full = full_leg(req, request_id="r", model="m", prompt_ids=[1, 2, 3], limits=limits(req))
    session = _session()
    leg = disagg.generation_leg(full, session)
    assert leg.kv.session == session
    assert leg.kv.session.SerializeToString(deterministic=True) == session.SerializeToString(deterministic=True)
    assert leg.token_ids == full.token_ids and list(leg.media) == list(full.media)
    assert [m.uuid for m in leg.media] == ["u1", "u2"]
    assert leg.stopping.max_tokens == 5 and "request_type" not in leg.extra
    assert disagg.first_gen_tokens(session) == [42]


def test_sessions_without_id_endpoints_or_opaque_state_are_refused():
    disagg.check_session(_session())
    for broken in ("session_id", "endpoints", "opaque_state"):
        session = _session()
        if broken == "opaque_state":
            del session.attributes_struct["opaque_state"]
        else:
            session.ClearField(broken)
        with pytest.raises(disagg.HandoffError):
            disagg.check_session(session)
