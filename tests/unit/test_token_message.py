"""Token ids read from a message's wire bytes (engine/token_message.py): the shapes the workers send take the fast
path, and no bytes at all are ever read differently from protobuf's own parse (engine/events.decode)."""

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.engine import events as ev
from orchestrator.engine.token_message import token_ids
from orchestrator.openengine.v1 import generation_pb2 as g

UINT32 = st.integers(min_value=0, max_value=2**32 - 1)
SHORT_TEXT = st.text(max_size=6)


def full_decode(payload: bytes):
    return ev.decode(g.GenerateResponse.FromString(payload), worker="w")


def comparable(event):
    """Events compare by value; an engine error by what it says (EngineError has no __eq__)."""
    if isinstance(event, ev.Failed):
        error = event.error
        return type(error), str(error), error.code, error.retryable
    return event


def reads_as_protobuf_does(payload: bytes) -> None:
    try:
        expected = full_decode(payload)
    except DecodeError:
        assert token_ids(payload) is None
        return
    assert comparable(ev.decode_bytes(payload, worker="w")) == comparable(expected)


def token_message(ids, *, request_id="chatcmpl-1-0a", output_index=None, text="") -> bytes:
    output = g.TokenOutput(tokens=[g.TokenInfo(token_id=i) for i in ids], text=text)
    if output_index is not None:
        output.output_index = output_index
    return g.GenerateResponse(request_id=request_id, token=output).SerializeToString()


@pytest.mark.parametrize("ids, kwargs, who", [
    ([1234], {"output_index": 0}, "our simulated worker"),
    ([1234], {"output_index": 0, "text": " Paris"}, "TensorRT-LLM's servicer, with the delta text"),
    ([7, 8, 9], {"output_index": 0, "text": "abc"}, "several tokens in one message"),
    ([0], {"output_index": 0}, "token id 0 (an empty TokenInfo)"),
    ([2**32 - 1], {}, "the largest id, no output_index"),
    ([5], {"request_id": "", "output_index": 3}, "no request_id, a second sequence"),
])
def test_the_messages_workers_send_take_the_fast_path(ids, kwargs, who):
    payload = token_message(ids, **kwargs)
    assert token_ids(payload) == ids, who
    assert ev.decode_bytes(payload, worker="w") == full_decode(payload) == ev.Tokens(tuple(ids))


@pytest.mark.parametrize("payload, why", [
    (token_message([5], request_id="r" * 128), "a request_id of 128 bytes"),
    (token_message([5], request_id="é"), "a non-ASCII request_id (protobuf checks its UTF-8)"),
    (token_message([5], text="é"), "non-ASCII text"),
    (token_message([5], text="x" * 130), "a TokenOutput of 128 bytes or more"),
    (token_message(list(range(1, 60))), "many tokens in one message"),
    (g.GenerateResponse(request_id="r", token=g.TokenOutput(tokens=[g.TokenInfo(token_id=5, logprob=-0.5)]))
     .SerializeToString(), "a logprob"),
    (g.GenerateResponse(token=g.TokenOutput(tokens=[g.TokenInfo(token_id=5)]), usage=g.Usage(prompt_tokens=3))
     .SerializeToString(), "a usage after the token"),
    (token_message([5])[-4:] + token_message([5])[:-4], "the fields in another order"),
    (bytes.fromhex("1a08120608ffffffff1f"), "a five-byte id above 2**32 - 1"),
    (bytes.fromhex("1a09120708858080808000"), "a six-byte varint"),
    (g.GenerateResponse(request_id="r", finished=g.GenerationFinished(reason=g.FINISH_REASON_LENGTH))
     .SerializeToString(), "another event"),
    (b"", "no bytes"),
])
def test_any_other_shape_takes_the_full_parse(payload, why):
    assert token_ids(payload) is None, why
    reads_as_protobuf_does(payload)


@st.composite
def token_infos(draw):
    info = g.TokenInfo(token_id=draw(UINT32))
    if draw(st.integers(0, 3)) == 0:
        info.logprob = draw(st.floats(allow_nan=False, max_value=0))
    if draw(st.integers(0, 4)) == 0:
        info.token = draw(SHORT_TEXT)
    return info


@st.composite
def responses(draw):
    response = g.GenerateResponse(request_id=draw(st.text(max_size=draw(st.sampled_from([0, 30, 140])))))
    kind = draw(st.sampled_from(["token"] * 4 + ["finished", "prefill_ready", "error", "none"]))
    if kind == "token":
        output = g.TokenOutput(tokens=draw(st.lists(token_infos(), max_size=4)), text=draw(SHORT_TEXT))
        if draw(st.booleans()):
            output.output_index = draw(UINT32)
        response.token.CopyFrom(output)
    elif kind == "finished":
        response.finished.reason = g.FINISH_REASON_LENGTH
    elif kind == "prefill_ready":
        response.prefill_ready.kv_session.session_id = "s"
    elif kind == "error":
        response.error.message = "boom"
    if draw(st.integers(0, 3)) == 0:
        response.usage.prompt_tokens = draw(UINT32)
    return response


@given(responses())
@settings(max_examples=500, deadline=None)
def test_any_response_reads_as_protobuf_reads_it(response):
    reads_as_protobuf_does(response.SerializeToString())


@given(st.binary(max_size=48))
@settings(max_examples=1500, deadline=None)
def test_arbitrary_bytes_are_never_read_differently(payload):
    reads_as_protobuf_does(payload)


@given(st.lists(UINT32, min_size=1, max_size=3), st.booleans(), st.data())
@settings(max_examples=1500, deadline=None)
def test_a_worker_message_with_any_byte_changed_is_never_misread(ids, with_text, data):
    """One changed byte anywhere (a length, a tag, a continuation bit) in the messages workers send."""
    payload = bytearray(token_message(ids, output_index=0, text="ab" if with_text else ""))
    index = data.draw(st.integers(0, len(payload) - 1))
    payload[index] = data.draw(st.integers(0, 255))
    reads_as_protobuf_does(bytes(payload))


def test_one_token_events_are_shared_frozen_values_across_requests():
    first, second = (ev.decode_bytes(token_message([4242], request_id=rid, output_index=0), worker="w")
                     for rid in ("chatcmpl-1", "chatcmpl-2"))
    assert first is second and first == ev.Tokens((4242,))
    with_text = ev.decode_bytes(token_message([4242], output_index=0, text=" x"), worker="w")
    assert with_text == first  # other bytes for the same token: its own entry, the same value


def test_a_full_table_of_shared_events_still_reads_every_message(monkeypatch):
    monkeypatch.setattr(ev, "_TOKEN_EVENTS", {})
    monkeypatch.setattr(ev, "_TOKEN_EVENTS_LIMIT", 2)
    events = [ev.decode_bytes(token_message([i]), worker="w") for i in (1, 2, 3, 3)]
    assert events == [ev.Tokens((i,)) for i in (1, 2, 3, 3)]
    assert len(ev._TOKEN_EVENTS) == 2 and events[2] is not events[3]


def test_several_tokens_in_one_message_are_read_but_not_kept():
    payload = token_message([7, 8], output_index=0)
    assert ev.decode_bytes(payload, worker="w") == ev.Tokens((7, 8))
    assert token_message([7, 8], request_id="") not in ev._TOKEN_EVENTS


def _token_message(*infos: g.TokenInfo) -> g.GenerateResponse:
    return g.GenerateResponse(request_id="r", token=g.TokenOutput(tokens=list(infos)))


def test_logprobs_are_clamped_as_revision_1_does_and_nan_is_no_value():
    """UPSTREAM logprob-floor: -inf (a masked token) floors at -9999 whichever server sent it."""
    message = _token_message(
        g.TokenInfo(token_id=1, logprob=float("-inf"), candidates=[g.LogProb(token_id=1, logprob=float("-inf")),
                                                                     g.LogProb(token_id=2, logprob=float("nan"))]),
        g.TokenInfo(token_id=2, logprob=float("nan")),
        g.TokenInfo(token_id=3, logprob=float("inf")))
    event = ev.decode(message, worker="w")
    assert isinstance(event, ev.Tokens)
    assert [(lp.token_id, lp.logprob, lp.top) for lp in event.logprobs] == [
        (1, -9999.0, ((1, -9999.0),)), (2, None, ()), (3, 0.0, ())]


def test_a_token_without_a_logprob_keeps_its_place_among_tokens_with_one():
    """UPSTREAM logprob-shortfall: a generation leg's first token comes without its logprob."""
    event = ev.decode(_token_message(g.TokenInfo(token_id=5), g.TokenInfo(token_id=6, logprob=-0.25)), worker="w")
    assert isinstance(event, ev.Tokens)
    assert [(lp.token_id, lp.logprob) for lp in event.logprobs] == [(5, None), (6, -0.25)]
