"""Request parsing and validation (pure): every bad input is a 400 naming its field."""

import pytest

from orchestrator.convert import parse_chat, parse_completion
from orchestrator.convert.api import Part
from orchestrator.errors import InvalidRequest


def chat(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def error_of(fn, body) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        fn(body)
    return info.value


def test_a_plain_chat_request_maps_every_parameter():
    req = parse_chat(chat(max_completion_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.1, seed=3,
                          stop=["END", "##"], stop_token_ids=[5], ignore_eos=True, min_tokens=2,
                          presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
                          stream=True, stream_options={"include_usage": True}, logprobs=True, top_logprobs=3))
    assert req.max_tokens == 7 and req.min_tokens == 2 and req.ignore_eos
    assert req.stop == ("END", "##") and req.stop_token_ids == (5,)
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.5, 0.9, 40, 0.1, 3)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.1)
    assert req.stream and req.include_usage and req.logprobs and req.top_logprobs == 3


def test_max_completion_tokens_wins_over_max_tokens_and_stop_may_be_a_string():
    req = parse_chat(chat(max_tokens=9, max_completion_tokens=4, stop="x"))
    assert req.max_tokens == 4 and req.stop == ("x",)


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    (chat(messages=[]), "messages"),
    (chat(messages="hi"), "messages"),
    (chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": [{"type": "audio"}]}]), "messages[0].content[0].type"),
    (chat(n=17), "n"),
    (chat(best_of=3), "best_of"),
    (chat(use_beam_search=True), "use_beam_search"),
    (chat(max_tokens="ten"), "max_tokens"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens=True), "max_tokens"),
    (chat(temperature=3), "temperature"),
    (chat(top_p=0), "top_p"),
    (chat(seed=-1), "seed"),
    (chat(seed=2**63), "seed"),
    (chat(repetition_penalty=9.2e18), "repetition_penalty"),
    (chat(repetition_penalty=0), "repetition_penalty"),
    (chat(repetition_penalty=float("nan")), "repetition_penalty"),
    (chat(logit_bias={"5": float("nan")}), "logit_bias.5"),
    (chat(logit_bias={"5": float("inf")}), "logit_bias.5"),
    (chat(logit_bias={"5": 101}), "logit_bias.5"),
    (chat(logit_bias={"five": 1}), "logit_bias"),
    (chat(logit_bias=[1]), "logit_bias"),
    (chat(logit_bias={"5": -100}), "logit_bias"),  # well formed, but nothing on the wire carries it
    (chat(stop=[""]), "stop"),
    (chat(stop=5), "stop"),
    (chat(stream="yes"), "stream"),
    (chat(stream_options={"include_usage": True}), "stream_options"),
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(response_format={"type": "xml"}), "response_format.type"),
    (chat(response_format={"type": "json_schema", "json_schema": {}}), "response_format.json_schema"),
    (chat(tools=[{"type": "function"}]), "tools[0].function"),
    (chat(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_bad_chat_input_is_a_400_naming_the_field(body, param):
    assert error_of(parse_chat, body).param == param


def test_the_largest_meaningful_numbers_and_an_empty_logit_bias_are_accepted():
    sampling = parse_chat(chat(seed=2**63 - 1, repetition_penalty=2, logit_bias={})).sampling
    assert (sampling.seed, sampling.repetition_penalty) == (2**63 - 1, 2)


def test_a_body_that_is_not_an_object_is_a_400():
    assert "JSON object" in error_of(parse_chat, ["not", "a", "dict"]).message


def test_response_format_maps_to_guided_decoding():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse_chat(chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert req.guided is not None
    assert req.guided.kind == "json_schema" and '"properties"' in req.guided.json_schema
    json_object = parse_chat(chat(response_format={"type": "json_object"})).guided
    assert json_object is not None
    assert json_object.kind == "json_object"
    assert parse_chat(chat(response_format={"type": "text"})).guided is None


def test_text_parts_stay_parts_and_assistant_null_content_is_allowed():
    """The chat template decides how parts become text (tests/unit/test_tokenizer.py)."""
    req = parse_chat(chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]},
                                    {"role": "assistant", "content": None}]))
    assert [m.content for m in req.messages] == [(Part("text", "a"), Part("text", "b")), ""]


def test_completion_prompts_text_or_token_ids():
    assert parse_completion({"model": "m", "prompt": "hello"}).prompt == "hello"
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}).prompt_ids == (1, 2, 3)
    assert parse_completion({"model": "m", "prompt": ["one"]}).prompt == "one"
    req = parse_completion({"model": "m", "prompt": "x", "logprobs": 2})
    assert req.logprobs and req.top_logprobs == 2


@pytest.mark.parametrize("prompt", ["", [], ["a", "b"], [1, "a"], None, 5])
def test_bad_completion_prompts_are_400s(prompt):
    assert error_of(parse_completion, {"model": "m", "prompt": prompt}).param == "prompt"
