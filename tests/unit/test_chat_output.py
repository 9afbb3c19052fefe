"""A chat answer through its output parser: which parser reads it, and what streamed and whole answers carry."""

import json
import logging

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from orchestrator.convert import parse_chat, parse_completion
from orchestrator.frontend import openai_format as fmt
from orchestrator.frontend.app import _CollectingSink, _Response, _StreamingSink
from orchestrator.frontend.chat_output import OutputParsers
from orchestrator.parsers import PassThrough
from orchestrator.parsers.events import CallIds
from orchestrator.parsers.guided import NamedCall, RequiredCalls
from orchestrator.testkit.fakes import capabilities

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
HERMES_ANSWER = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>')


def chat(**extra):
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": "weather?"}], **extra})


def worker(tool_call_parser=None, reasoning_parser=None):
    return attrs.evolve(capabilities("aggregated"), tool_call_parser=tool_call_parser,
                        reasoning_parser=reasoning_parser)


# ---- which parser ------------------------------------------------------------------------------------------

def test_the_parsers_are_the_ones_the_workers_advertise_unless_the_config_names_others():
    advertised = OutputParsers().spec([worker("hermes", "qwen3")])
    assert (advertised.tool_call_parser, advertised.reasoning_parser) == ("qwen3", "qwen3")  # hermes: an alias
    configured = OutputParsers(tool_call_parser="mistral").spec([worker("hermes", "qwen3")])
    assert (configured.tool_call_parser, configured.reasoning_parser) == ("mistral", "qwen3")
    assert OutputParsers().spec([worker(), worker("hermes")]).tool_call_parser == "qwen3"  # the first that says


def test_a_parser_name_we_do_not_have_is_logged_once_and_its_text_goes_out_as_content(caplog):
    parsers = OutputParsers()
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert parsers.for_request(chat(tools=[WEATHER]), "r", [worker("parser_of_2027")]) is None
    assert sum("parser_of_2027" in r.getMessage() for r in caplog.records) == 1


def test_plain_answers_have_no_parser_on_their_path():
    parsers = OutputParsers()
    assert parsers.for_request(chat(), "r", [worker()]) is None
    assert parsers.for_request(chat(tools=[WEATHER]), "r", [worker()]) is None  # the model says no parser
    assert parsers.for_request(chat(), "r", [worker("hermes")]) is None  # no tools, no reasoning parser
    completion = parse_completion({"model": "m", "prompt": "x"})
    assert parsers.for_request(completion, "r", [worker("hermes", "qwen3")]) is None


def test_tool_choice_none_reads_reasoning_but_leaves_call_markup_as_content():
    parser = OutputParsers().for_request(chat(tools=[WEATHER], tool_choice="none"), "r", [worker("hermes", "qwen3")])
    assert parser is not None
    out = parser.feed('<think>hm</think><tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
    out2 = parser.finish()
    assert out.reasoning == "hm" and not out.tool_calls and not out2.tool_calls
    assert out.content + out2.content == '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'


def test_guided_choices_read_the_guided_shape_whatever_the_model_family():
    parsers = OutputParsers()
    named = parsers.for_request(chat(tools=[WEATHER], tool_choice={"type": "function",
                                                                    "function": {"name": "get_weather"}}),
                                "r", [worker("mistral")])
    required = parsers.for_request(chat(tools=[WEATHER], tool_choice="required"), "r", [worker("mistral")])
    assert isinstance(named, NamedCall) and isinstance(required, RequiredCalls)


# ---- the guided shapes -------------------------------------------------------------------------------------

def collected(parser, pieces):
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, list] = {}
    for d in deltas:
        for call in d.tool_calls:
            calls.setdefault(call.index, [call.id, call.name, ""])[2] += call.arguments
    return content, [tuple(c) for _, c in sorted(calls.items())]


def splits(text):
    return st.lists(st.integers(0, len(text)), max_size=8).map(
        lambda cuts: [text[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)])])


NAMED_ANSWER = '{"city": "Köln", "days": [1, 2]}'
REQUIRED_ANSWER = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'


@settings(max_examples=100, deadline=None)
@given(splits(NAMED_ANSWER))
def test_a_named_choice_is_one_call_whose_arguments_are_the_whole_answer_however_it_is_split(pieces):
    content, calls = collected(NamedCall("get_weather", CallIds("req-1")), pieces)
    assert content == "" and calls == [(CallIds("req-1")(0), "get_weather", NAMED_ANSWER)]


@settings(max_examples=100, deadline=None)
@given(splits(REQUIRED_ANSWER))
def test_required_is_each_element_of_the_array_a_call_however_it_is_split(pieces):
    ids = CallIds("req-1")
    content, calls = collected(RequiredCalls(ids), pieces)
    assert content == "" and calls == [(ids(0), "get_weather", '{"city": "Paris"}'), (ids(1), "get_time", "{}")]


def test_a_guided_answer_that_is_not_the_guided_shape_is_given_back_as_content():
    assert collected(RequiredCalls(CallIds()), ["I will not"]) == ("I will not", [])
    assert collected(NamedCall("f", CallIds("x")), []) == ("", [(CallIds("x")(0), "f", "{}")])


# ---- what the client gets ----------------------------------------------------------------------------------

class Wire:
    def __init__(self):
        self.body = b""

    async def send(self, message):
        self.body += message.get("body", b"")

    def events(self) -> list[dict]:
        return [json.loads(line[6:]) for line in self.body.decode().split("\n\n")
                if line.startswith("data: {")]


async def streamed(api, parser, pieces, reason="stop"):
    wire = Wire()
    response = _Response(wire.send, [])
    sink = _StreamingSink(response, fmt.ChunkWriter("chat", "chatcmpl-1", "m", 0), api, str,
                          per_token=True, parser=parser)
    for piece in pieces:
        await sink.deltas([(piece, (), ())])
    await sink.finish(reason, 3, len(pieces))
    await response.end_stream()
    return wire.events()


def accumulate(events: list[dict]) -> dict:
    """What a client makes of the stream: every event is a valid OpenAI chunk; the pieces add up."""
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for event in events:
        chunk = ChatCompletionChunk.model_validate(event)
        choice = chunk.choices[0]
        delta = event["choices"][0]["delta"]
        message["content"] += delta.get("content") or ""
        message["reasoning_content"] += delta.get("reasoning_content") or ""
        for call in choice.delta.tool_calls or ():
            if call.id is not None:  # a call's first piece: its id, type and name
                assert call.type == "function" and call.function is not None and call.function.name
                message["tool_calls"][call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            assert call.function is not None
            message["tool_calls"][call.index]["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    message["tool_calls"] = [c for _, c in sorted(message["tool_calls"].items())]
    return {"message": message, "finish_reason": finish}


async def whole(api, parser, pieces, reason="stop"):
    sink = _CollectingSink("chat", api, str, parser=parser)
    for piece in pieces:
        await sink.deltas([(piece, (), ())])
    await sink.finish(reason, 3, len(pieces))
    body = sink.response("chatcmpl-1", "m", 0)
    ChatCompletion.model_validate(body)
    return body["choices"][0]


async def test_a_streamed_answer_with_calls_is_text_then_calls_as_openai_streams_them_and_finishes_tool_calls():
    api = chat(tools=[WEATHER])
    parsers = OutputParsers()
    events = await streamed(api, parsers.for_request(api, "r1", [worker("hermes")]), list(HERMES_ANSWER))
    answer = accumulate(events)
    ids = CallIds("r1")
    assert answer == {"finish_reason": "tool_calls", "message": {
        "content": "Let me check.", "reasoning_content": "",
        "tool_calls": [{"id": ids(0), "name": "get_weather", "arguments": '{"city": "Paris"}'},
                       {"id": ids(1), "name": "get_weather", "arguments": '{"city": "Köln"}'}]}}
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"


async def test_a_whole_answer_is_what_the_stream_adds_up_to_with_null_content_when_only_calls():
    api = chat(tools=[WEATHER])
    parsers = OutputParsers()
    choice = await whole(api, parsers.for_request(api, "r1", [worker("hermes")]), list(HERMES_ANSWER))
    ids = CallIds("r1")
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": ids(0), "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": ids(1), "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Köln"}'}}]}
    only_calls = await whole(api, parsers.for_request(api, "r1", [worker("hermes")]),
                             [HERMES_ANSWER.removeprefix("Let me check.")])
    assert only_calls["message"]["content"] is None


async def test_reasoning_streams_as_reasoning_content_and_a_whole_answer_carries_it():
    api = chat()
    parsers = OutputParsers()
    text = ["<thi", "nk>The user wants", " weather.</th", "ink>Sunny."]
    answer = accumulate(await streamed(api, parsers.for_request(api, "r", [worker(None, "qwen3")]), text))
    assert answer["message"] == {"content": "Sunny.", "reasoning_content": "The user wants weather.",
                                 "tool_calls": []}
    assert answer["finish_reason"] == "stop"
    choice = await whole(api, parsers.for_request(api, "r", [worker(None, "qwen3")]), text)
    assert choice["message"] == {"role": "assistant", "content": "Sunny.",
                                 "reasoning_content": "The user wants weather."}


async def test_a_call_cut_off_by_max_tokens_keeps_finish_reason_length():
    api = chat(tools=[WEATHER])
    cut = HERMES_ANSWER[:60]
    answer = accumulate(await streamed(api, OutputParsers().for_request(api, "r", [worker("hermes")]), [cut],
                                       reason="length"))
    assert answer["finish_reason"] == "length"


async def test_a_required_choice_streams_its_calls_with_the_finish():
    api = chat(tools=[WEATHER], tool_choice="required")
    parser = OutputParsers().for_request(api, "r", [worker()])
    answer = accumulate(await streamed(api, parser, ['[{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}]']))
    assert answer["finish_reason"] == "tool_calls"
    assert answer["message"]["tool_calls"] == [{"id": CallIds("r")(0), "name": "get_weather",
                                                "arguments": '{"city": "Oslo"}'}]


def test_pass_through_is_never_put_on_the_path():
    parser = OutputParsers().for_request(chat(tools=[WEATHER], tool_choice="none"), "r", [worker("hermes")])
    assert parser is None or not isinstance(parser, PassThrough)


@pytest.mark.parametrize("pieces", [["a", "b"], ["<tool_call>nonsense"]])
async def test_text_that_is_not_a_call_is_never_lost(pieces):
    api = chat(tools=[WEATHER])
    answer = accumulate(await streamed(api, OutputParsers().for_request(api, "r", [worker("hermes")]), pieces))
    assert answer["message"]["content"] == "".join(pieces) and answer["finish_reason"] == "stop"


def test_a_family_whose_markers_are_special_tokens_keeps_them_in_the_answers_text():
    parsers = OutputParsers()
    assert parsers.keep_special_tokens(chat(tools=[WEATHER]), [worker("mistral")])
    assert parsers.keep_special_tokens(chat(tools=[WEATHER]), [worker("llama3_json")])
    assert not parsers.keep_special_tokens(chat(tools=[WEATHER]), [worker("hermes", "qwen3")])
    assert not parsers.keep_special_tokens(parse_completion({"model": "m", "prompt": "x"}), [worker("mistral")])
