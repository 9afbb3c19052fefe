"""SSE chunks of a streamed response (frontend/openai_format.py): each one is an OpenAI chunk object that
any JSON parser reads back to exactly the text, role, logprobs and finish reason it was given."""

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.frontend import openai_format as fmt

TEXT = st.text(st.characters(blacklist_categories=["Cs"]), max_size=12)  # no lone surrogates: text is UTF-8
HEAD: dict[str, Any] = {"id": "chatcmpl-7", "created": 1700000000, "model": "tiny-chat"}


def parse(event: bytes) -> dict:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    return json.loads(event[len(b"data: "):])


def writer(kind: str) -> fmt.ChunkWriter:
    return fmt.ChunkWriter(kind, HEAD["id"], HEAD["model"], HEAD["created"])


@given(st.lists(TEXT, min_size=1, max_size=5))
@settings(max_examples=300, deadline=None)
def test_chat_deltas_carry_their_text_and_the_role_once(texts):
    chat = writer("chat")
    chunks = [parse(chat.delta(text)) for text in texts]
    for index, (chunk, text) in enumerate(zip(chunks, texts)):
        assert chunk == {**HEAD, "object": "chat.completion.chunk", "choices": [{
            "index": 0, "delta": {"role": "assistant", "content": text} if index == 0 else {"content": text},
            "logprobs": None, "finish_reason": None}]}


@given(TEXT)
@settings(max_examples=200, deadline=None)
def test_completion_deltas_carry_their_text(text):
    chunk = parse(writer("completion").delta(text))
    assert chunk == {**HEAD, "object": "text_completion",
                     "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_delta_with_logprobs_carries_them_after_the_first(kind):
    chunk_writer = writer(kind)
    chunk_writer.delta("a")
    logprobs = {"content": [{"token": "b", "logprob": -0.5, "bytes": [98], "top_logprobs": []}]}
    choice = parse(chunk_writer.delta("b\n\"", logprobs))["choices"][0]
    assert choice["logprobs"] == logprobs
    assert choice.get("delta", {}).get("content", choice.get("text")) == "b\n\""


@pytest.mark.parametrize("kind, role_sent", [("chat", True), ("chat", False), ("completion", False)])
def test_the_finish_and_usage_chunks(kind, role_sent):
    chunk_writer = writer(kind)
    if role_sent:
        chunk_writer.delta("hi")
    choice = parse(chunk_writer.finish("length"))["choices"][0]
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    if kind == "chat":
        assert choice["delta"] == ({} if role_sent else {"role": "assistant", "content": ""})
    usage = parse(chunk_writer.usage(5, 3))
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 3,
                                                         "total_tokens": 8}


@given(TEXT, TEXT, st.integers(0, 2**40), st.integers(0, 2**31), st.integers(0, 2**31),
       st.none() | st.integers(0, 2**31))
@settings(max_examples=200, deadline=None)
def test_any_request_id_and_model_read_back_and_usage_adds_up(request_id, model, created, prompt, completion, cached):
    """The head and the usage chunk are spelled out by hand: they must be what the JSON encoder gives."""
    chunk_writer = fmt.ChunkWriter("chat", request_id, model, created)
    head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    assert parse(chunk_writer.delta("x")) == {**head, "choices": [{"index": 0, "delta": {
        "role": "assistant", "content": "x"}, "logprobs": None, "finish_reason": None}]}
    usage = chunk_writer.usage(prompt, completion, cached)
    details = {} if cached is None else {"prompt_tokens_details": {"cached_tokens": cached}}
    assert parse(usage) == {**head, "choices": [], "usage": {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion, **details}}
    assert usage == fmt.sse({**head, "choices": [], "usage": fmt.usage(prompt, completion, cached)})  # byte for byte


def test_logprobs_show_only_the_candidates_the_client_asked_for():
    """The engine is asked for at least one candidate (tests/unit/test_convert_engine.py); top_logprobs 0 shows none."""
    from orchestrator.engine.events import TokenLogprob

    lp = [TokenLogprob(7, -0.5, ((7, -0.5), (8, -1.5)))]
    text = str
    assert fmt.chat_logprobs(lp, text, 0)["content"][0]["top_logprobs"] == []
    assert [c["token"] for c in fmt.chat_logprobs(lp, text, 1)["content"][0]["top_logprobs"]] == ["7"]
    assert fmt.completion_logprobs(lp, text, 0, 0)["top_logprobs"] == [{}]
    assert fmt.completion_logprobs(lp, text, 0, 2)["top_logprobs"] == [{"7": -0.5, "8": -1.5}]


@given(st.sampled_from(["chat", "completion"]), st.lists(TEXT, min_size=1, max_size=5), st.booleans())
@settings(max_examples=200, deadline=None)
def test_deltas_of_a_batch_are_the_single_deltas_joined(kind, texts, earlier_delta):
    one_by_one, batched = writer(kind), writer(kind)
    if earlier_delta:
        one_by_one.delta("a"), batched.delta("a")
    assert batched.deltas(texts) == b"".join(one_by_one.delta(text) for text in texts)
    assert batched.delta("z") == one_by_one.delta("z")  # and both know the role was sent


@given(TEXT, TEXT)
@settings(max_examples=200, deadline=None)
def test_a_token_event_is_what_the_encoder_gives_whatever_the_request_id_and_model_hold(request_id, text):
    """The token's event is cut from a template around a marker: a head holding that marker changes nothing."""
    for model in ("tiny-chat", "\x00text\x00", text):
        for kind in ("chat", "completion"):
            chunk_writer = fmt.ChunkWriter(kind, request_id + "\x00text\x00", model, 7)
            chunk_writer.delta("")  # past the role
            choice = parse(chunk_writer.delta(text))
            assert choice["id"] == request_id + "\x00text\x00" and choice["model"] == model
            assert choice["choices"][0].get("delta", {}).get("content", choice["choices"][0].get("text")) == text


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_no_texts_make_no_events(kind):
    writer = fmt.ChunkWriter(kind, "id", "m", 1)
    assert writer.deltas([]) == b""
    writer.delta("a")  # (a chat stream's role is sent)
    assert writer.deltas([]) == b""


def test_no_event_or_response_ever_holds_a_non_finite_number():
    with pytest.raises(ValueError):
        fmt.sse({"logprob": float("-inf")})
    chunk = fmt.ChunkWriter("chat", "id", "m", 0)
    chunk.delta("")  # the role
    with pytest.raises(ValueError):
        chunk.delta("a", {"content": [{"logprob": float("nan")}]})


def test_a_token_the_engine_gave_no_logprob_says_so_with_null():
    from orchestrator.engine.events import TokenLogprob

    lp = [*fmt.unknown_logprobs([7]), TokenLogprob(8, -0.5, ((8, -0.5),))]
    chat = fmt.chat_logprobs(lp, str, 1)["content"]
    assert [(c["token"], c["logprob"], len(c["top_logprobs"])) for c in chat] == [("7", None, 0), ("8", -0.5, 1)]
    completion = fmt.completion_logprobs(lp, str, 0, 1)
    assert completion["token_logprobs"] == [None, -0.5] and completion["top_logprobs"] == [None, {"8": -0.5}]
