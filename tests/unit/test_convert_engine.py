"""The context-window rule, media and feature gating and engine-leg building (pure)."""

import attrs
import pytest
from google.protobuf import json_format

from orchestrator.convert import (
    check_media_capability,
    check_media_options,
    check_media_sources,
    check_worker_features,
    full_leg,
    parse_chat,
    resolve_limits,
    serves_features,
)
from orchestrator.engine.capabilities import FeatureSupport, WorkerCapabilities
from orchestrator.errors import InvalidRequest
from orchestrator.kv import first_gen_tokens, generation_leg, release_leg
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.openengine.v1 import kv_pb2
from orchestrator.prefill import context_only_leg

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


def test_an_explicit_max_tokens_past_the_window_is_clamped_to_the_room_as_trtllm_does():
    """UPSTREAM clamp (tests/e2e/test_trtllm_conformance.py): TensorRT-LLM's executor clamps, it does not refuse."""
    assert limits(text_request(max_tokens=500), prompt=90, max_output=None).max_tokens == 10
    assert limits(text_request(max_tokens=35), prompt=10, configured=40, max_output=None).max_tokens == 30


@pytest.mark.parametrize("extra, prompt, words", [
    ({"min_tokens": 11}, 90, "min_tokens (11) exceeds the 10 tokens left for this request (context window 100, "
                             "prompt 90 tokens)"),
    ({"min_tokens": 8, "max_tokens": 5}, 10, "min_tokens (8) exceeds the 5 tokens left for this request (context "
                                             "window 100, prompt 10 tokens, max_tokens 5)"),
])
def test_a_min_tokens_that_cannot_be_met_is_a_400_naming_both_numbers(extra, prompt, words):
    """Dynamo's sidecar: reject_impossible_minimum. The engine would run into the window or max_tokens first."""
    with pytest.raises(InvalidRequest) as info:
        limits(text_request(**extra), prompt=prompt, max_output=None)
    assert info.value.message == words and info.value.param == "min_tokens"
    assert limits(text_request(min_tokens=10), prompt=90, max_output=None).max_tokens == 10  # exactly enough


def test_a_prompt_at_or_over_the_window_is_a_400_naming_both_numbers():
    with pytest.raises(InvalidRequest) as info:
        limits(text_request(), prompt=100)
    assert "100 tokens" in info.value.message and "context window of 100" in info.value.message
    assert info.value.code == "context_length_exceeded"


def test_a_configured_window_tighter_than_the_engine_applies_to_text():
    with pytest.raises(InvalidRequest, match="context window of 40"):
        limits(text_request(), prompt=45, configured=40)


def test_image_requests_under_a_tighter_configured_window_are_refused():
    with pytest.raises(InvalidRequest) as info:
        limits(image_request(), configured=40, engine=100)
    assert "configured context window of 40" in info.value.message and "own window is 100" in info.value.message


def test_image_requests_without_max_tokens_get_the_text_room_as_an_upper_bound_never_an_engine_default():
    """The engine clamps it to its real room (images included); unset, a revision-3 server would stop at 32."""
    assert limits(image_request(), prompt=10, max_output=None).max_tokens == 90
    assert limits(image_request(), prompt=10, configured=100, max_output=None).max_tokens == 90
    assert limits(image_request(), max_output=50).max_tokens == 50
    assert limits(image_request(max_tokens=500)).max_tokens == 50  # still clamped to max_output_tokens
    assert limits(image_request(), engine=None, max_output=None).max_tokens is None  # no window known: unset


def test_media_gating_names_the_role_and_the_signals_that_refuse():
    check_media_capability(image_request(), [("prefill", True, ""), ("decode", True, "")])
    check_media_capability(text_request(), [("prefill", False, "")])
    with pytest.raises(InvalidRequest,
                       match=r"does not accept images.*decode worker reports supports_multimodal=false"):
        check_media_capability(image_request(), [("prefill", True, ""), ("decode", False, "supports_multimodal=false")])


def test_media_sources_must_be_among_the_encodings_a_worker_lists():
    check_media_sources(image_request(), [("decode", frozenset())])  # revision 1: not said, not refused
    check_media_sources(image_request(), [("decode", frozenset({"url", "data_uri"}))])
    with pytest.raises(InvalidRequest,
                       match=r"messages\[0\].content\[0\]: the decode worker does not take an image URL"):
        check_media_sources(image_request(), [("decode", frozenset({"data_uri"}))])


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
    assert leg.stopping.max_tokens == 50 and leg.stopping.min_tokens == 1 and leg.stopping.ignore_eos
    assert leg.response.return_output_logprobs and leg.response.output_candidates.top_n == 2
    assert leg.guided.WhichOneof("guide") == "json_object"
    (item,) = leg.media
    assert (item.modality, item.url, item.uuid) == (g.MODALITY_IMAGE, "https://a.example/1.png", "cat")


def test_logprobs_without_candidates_still_ask_the_engine_for_one():
    """UPSTREAM logprobs-top-n: TensorRT-LLM computes the sampled token's logprob only when at least one
    candidate is requested; the extra candidate is not shown to the client (openai_format trims to top_logprobs)."""
    req = text_request(logprobs=True)
    leg = full_leg(req, request_id="r", model="m", prompt_ids=[1], limits=limits(req))
    assert leg.response.return_output_logprobs and leg.response.output_candidates.top_n == 1
    plain = full_leg(text_request(), request_id="r", model="m", prompt_ids=[1], limits=limits(text_request()))
    assert not plain.HasField("response")


def test_the_leg_always_has_its_prompt_sampling_and_stopping_messages_and_their_order_of_conditions():
    """full_leg fills the message in place: it must serialize as one built from its parts would."""
    bare = text_request()
    leg = full_leg(bare, request_id="r", model="m", prompt_ids=[], limits=limits(bare))
    assert leg.HasField("token_ids") and leg.HasField("sampling") and leg.HasField("stopping")
    req = text_request(stop=["a", "b"], stop_token_ids=[5, 6], top_p=0.5, max_tokens=3, ignore_eos=True)
    leg = full_leg(req, request_id="r", model="m", prompt_ids=[1, 2, 3], limits=limits(req))
    from_parts = g.GenerateRequest(
        request_id="r", model="m", token_ids=g.TokenIds(ids=[1, 2, 3]), sampling=g.SamplingParams(top_p=0.5),
        stopping=g.StoppingOptions(conditions=[g.StopCondition(stop_text="a"), g.StopCondition(stop_text="b"),
                                               g.StopCondition(stop_token_id=5), g.StopCondition(stop_token_id=6)],
                                   max_tokens=3, ignore_eos=True))
    from_parts.extra["detokenize"] = False
    assert leg.SerializeToString(deterministic=True) == from_parts.SerializeToString(deterministic=True)


def _session():
    session = kv_pb2.KvSessionRef(session_id="17", transfer_backend="nixl", dp_rank=2,
                                  endpoints=[kv_pb2.KvEndpoint(host="10.0.0.1", port=5, protocol="tcp")])
    session.attributes_struct.update({"opaque_state": "b64==", "first_gen_tokens": [42], "draft_tokens": [],
                                      "disagg_request_id": "17", "ctx_usage": {"prompt_tokens": 9},
                                      "first_gen_log_probs": [], "schedule_style": 1})
    return session


def test_context_only_leg_is_the_full_request_with_one_token_and_the_request_type():
    req = image_request(seed=5, stop=["Z"], logprobs=True, min_tokens=2, ignore_eos=True,
                        response_format={"type": "json_object"})
    full = full_leg(req, request_id="r", model="m", prompt_ids=[1, 2, 3], limits=limits(req))
    ctx = context_only_leg(full)
    assert ctx.extra["request_type"] == "context_only" and ctx.stopping.max_tokens == 1
    ctx.stopping.max_tokens = full.stopping.max_tokens
    del ctx.extra["request_type"]
    assert ctx == full  # nothing else differs: the first token is sampled under the client's every option
    assert "request_type" not in full.extra  # the full request is untouched


def test_generation_leg_carries_the_session_untouched_and_the_same_prompt_and_media():
    req = image_request(max_tokens=5)
    full = full_leg(req, request_id="r", model="m", prompt_ids=[1, 2, 3], limits=limits(req))
    session = _session()
    leg = generation_leg(full, session)
    assert leg.request_id == "r-gen"  # its own id: one engine may run both legs (tests/e2e/test_trtllm_conformance.py)
    assert leg.kv.session == session
    assert leg.kv.session.SerializeToString(deterministic=True) == session.SerializeToString(deterministic=True)
    assert leg.token_ids == full.token_ids and list(leg.media) == list(full.media)
    assert [m.uuid for m in leg.media] == ["u1", "u2"]
    assert leg.stopping.max_tokens == 5 and "request_type" not in leg.extra
    assert first_gen_tokens(session) == [42]


def test_release_leg_pulls_the_session_for_one_token_and_asks_nothing_else():
    req = image_request(max_tokens=5, logprobs=True, min_tokens=3, response_format={"type": "json_object"})
    full = full_leg(req, request_id="r", model="m", prompt_ids=[1, 2, 3], limits=limits(req))
    leg = release_leg(full, _session())
    assert leg.request_id == "r-kv-release" and leg.kv.session == _session()
    assert leg.stopping == g.StoppingOptions(max_tokens=1)
    assert not leg.HasField("response") and not leg.HasField("guided")
    assert leg.token_ids == full.token_ids and list(leg.media) == list(full.media)


def test_media_options_go_only_to_workers_that_take_them_and_only_with_media():
    req = image_request(media_io_kwargs={"image": {"max_pixels": 1024}})
    check_media_options(req, [("prefill", True), ("decode", True)])
    with pytest.raises(InvalidRequest, match="decode worker does not take per-request media options"):
        check_media_options(req, [("prefill", True), ("decode", False)])
    with pytest.raises(InvalidRequest, match="only allowed with media"):
        check_media_options(text_request(media_io_kwargs={"image": {}}), [("decode", True)])
    with pytest.raises(InvalidRequest, match=r"media_io_kwargs\.vision"):
        image_request(media_io_kwargs={"vision": {}})
    leg = full_leg(req, request_id="r", model="m", prompt_ids=[1], limits=limits(req))
    assert json_format.MessageToDict(leg.media_options) == {"image": {"max_pixels": 1024}}


def _caps(**features):
    from orchestrator.testkit.fakes import capabilities

    return attrs.evolve(capabilities("decode"), instance_id="trtllm-d0", **features)


def test_a_guide_goes_only_to_workers_that_advertise_guided_decoding_and_its_mode():
    """UPSTREAM guided-capability: TensorRT-LLM advertises guided decoding only with a grammar backend, and the
    sibling server ignores a guide without one (an unconstrained answer), so the check is ours, before any leg."""
    guided = text_request(response_format={"type": "json_object"})
    check_worker_features(guided, [("decode", _caps(guided_decoding=FeatureSupport(True)))])  # modes not listed
    check_worker_features(guided, [("decode", _caps(guided_decoding=FeatureSupport(True, frozenset({"json_object"}))))])
    check_worker_features(text_request(), [("decode", _caps())])  # no guide, nothing asked
    with pytest.raises(InvalidRequest) as info:
        check_worker_features(guided, [("prefill", _caps(guided_decoding=FeatureSupport(True))), ("decode", _caps())])
    assert info.value.message.startswith("response_format json_object: the decode worker (trtllm-d0) cannot "
                                         "constrain the output: guided decoding is not supported")
    assert info.value.param == "response_format" and info.value.code == "guided_decoding_not_supported"
    regex_only = _caps(guided_decoding=FeatureSupport(True, frozenset({"regex", "json_schema"})))
    with pytest.raises(InvalidRequest, match="its guided decoding modes are json_schema, regex"):
        check_worker_features(guided, [("decode", regex_only)])


def test_logprobs_go_only_to_workers_that_return_them_within_their_candidate_limit():
    top5 = FeatureSupport(True, frozenset({"top_n"}), max_top_n=5)
    check_worker_features(text_request(logprobs=True, top_logprobs=5), [("decode", _caps(output_logprobs=top5))])
    with pytest.raises(InvalidRequest, match=r"top_logprobs: the decode worker \(trtllm-d0\) returns at most 5 "
                                             "candidates, 6 were asked for"):
        check_worker_features(text_request(logprobs=True, top_logprobs=6), [("decode", _caps(output_logprobs=top5))])
    for unsupported in (FeatureSupport(), FeatureSupport(True, frozenset({"token_ids"}))):
        with pytest.raises(InvalidRequest, match="does not return output logprobs by top-n candidates"):
            check_worker_features(text_request(logprobs=True), [("decode", _caps(output_logprobs=unsupported))])


def test_a_cache_salt_goes_only_to_workers_that_advertise_supports_cache_salt():
    """UPSTREAM cache-salt-advertised: what a server advertises is what its Generate accepts; a worker that dropped
    the salt would let one tenant's request reuse (and learn of, through cached_tokens) another tenant's blocks."""
    salted = attrs.evolve(text_request(), cache_salt="key:tenant")
    check_worker_features(salted, [("prefill", _caps()), ("decode", _caps())])  # both advertise it
    check_worker_features(text_request(), [("decode", _caps(supports_cache_salt=False))])  # no salt, nothing asked
    with pytest.raises(InvalidRequest) as info:
        check_worker_features(salted, [("prefill", _caps()), ("decode", _caps(supports_cache_salt=False))])
    assert info.value.message.startswith("cache_salt: the decode worker (trtllm-d0) does not isolate its prefix "
                                         "cache by salt")
    assert info.value.param == "cache_salt" and info.value.code == "cache_salt_not_supported"
    assert not serves_features(salted, _caps(supports_cache_salt=False))  # nor is it moved to one
    assert serves_features(salted, _caps())


def test_supports_cache_salt_is_read_from_model_info_and_unset_is_no():
    from orchestrator.openengine.v1 import model_pb2, server_pb2

    def caps(generation: model_pb2.GenerationCapabilities) -> WorkerCapabilities:
        return WorkerCapabilities.from_protos(server_pb2.ServerInfo(), model_pb2.ModelInfo(generation=generation))

    assert caps(model_pb2.GenerationCapabilities(supports_cache_salt=True)).supports_cache_salt
    assert not caps(model_pb2.GenerationCapabilities(supports_cache_salt=False)).supports_cache_salt
    assert not caps(model_pb2.GenerationCapabilities()).supports_cache_salt


def test_feature_support_is_read_from_model_info():
    from orchestrator.openengine.v1 import model_pb2

    caps = model_pb2.GenerationCapabilities(
        guided_decoding=model_pb2.GuidedDecodingCapabilities(
            supported=True, modes=[model_pb2.GUIDED_DECODING_MODE_JSON_SCHEMA, model_pb2.GUIDED_DECODING_MODE_REGEX]),
        output_logprobs=model_pb2.LogprobCapabilities(
            supported=True, candidate_selection_modes=[model_pb2.CANDIDATE_TOKEN_SELECTION_MODE_TOP_N], max_top_n=20))
    assert FeatureSupport.guided(caps.guided_decoding) == FeatureSupport(True, frozenset({"json_schema", "regex"}))
    assert FeatureSupport.logprobs(caps.output_logprobs) == FeatureSupport(True, frozenset({"top_n"}), 20)
    assert FeatureSupport.guided(model_pb2.GuidedDecodingCapabilities()) == FeatureSupport()  # unsaid: unsupported


def test_the_cache_salt_goes_on_every_leg_under_its_keys_namespace():
    from orchestrator.convert.api import cache_namespace

    assert cache_namespace(None, None) is None
    assert cache_namespace(None, "c1") == "request:c1"
    assert cache_namespace("tenant", None) == "key:tenant"
    assert cache_namespace("tenant", "c1") == "key:tenant\nrequest:c1"
    assert cache_namespace(None, "key:tenant") != cache_namespace("tenant", None)  # a client cannot name a key's
    req = attrs.evolve(parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                   "cache_salt": "c1"}), cache_salt="key:tenant\nrequest:c1")
    leg = full_leg(req, request_id="r", model="m", prompt_ids=[1, 2], limits=limits(req))
    assert leg.kv.cache_salt == "key:tenant\nrequest:c1"
    for bad in ("", 5, "x" * 1025):
        with pytest.raises(InvalidRequest, match="cache_salt"):
            parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": bad})
