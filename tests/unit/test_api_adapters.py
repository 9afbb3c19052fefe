"""The Responses and Messages adapters' pure parts: the chat request each body runs as, the errors they name,
the blocks an answer is made of, and the embedded store's bounds."""

import base64
import json

import pytest

from orchestrator.convert.messages import parse_messages
from orchestrator.convert.responses import parse_responses
from orchestrator.convert.tools import ToolChoiceMode
from orchestrator.errors import InvalidRequest
from orchestrator.frontend.answer_blocks import AnswerBlocks, Closed, Grew, Opened
from orchestrator.frontend.response_store import SqliteStore, StoredResponse
from orchestrator.parsers import Delta, ToolCallDelta
from orchestrator.synthetic import solid_png

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
PIXEL = base64.b64encode(solid_png(1, 1, (0, 0, 0))).decode()


def template(api) -> list[dict]:
    return [m.as_template_dict() for m in api.messages]


# ---- Responses -> chat --------------------------------------------------------------------------------------

def test_a_responses_input_string_is_one_user_message_after_the_instructions():
    request = parse_responses({"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 9,
                               "temperature": 0.5, "text": {"format": {"type": "json_object"}}})
    assert template(request.api) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert request.api.max_tokens == 9 and request.api.sampling.temperature == 0.5
    assert request.api.guided is not None and request.api.guided.kind == "json_object" and request.store


def test_a_tool_loop_in_responses_items_is_the_chat_history_templates_read():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "check it"}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "snow"},
             {"type": "function_call_output", "call_id": "c2", "output": "sun"}]
    request = parse_responses({"model": "m", "input": items, "tool_choice": {"type": "function", "name": "get_weather"},
                               "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]})
    user, assistant, result_1, result_2 = template(request.api)
    assert user == {"role": "user", "content": [{"type": "text", "text": "weather?"}]}
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"] and assistant["reasoning_content"] == "check it"
    assert (result_1["tool_call_id"], result_2["content"]) == ("c1", "sun")
    assert request.api.tool_use.choice.mode is ToolChoiceMode.NAMED


def test_a_continuation_puts_the_stored_conversation_before_the_input():
    history = [{"type": "message", "role": "user", "content": "first"},
               {"type": "message", "role": "assistant", "content": "answer one"}]
    request = parse_responses({"model": "m", "input": "second", "previous_response_id": "resp_1"}, history)
    assert [m["content"] for m in template(request.api)] == ["first", "answer one", "second"]
    assert request.previous_response_id == "resp_1"
    assert [json.loads(i) for i in request.input_items] == [{"type": "message", "role": "user", "content": "second"}]


@pytest.mark.parametrize("body, param", [
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]},
                {"role": "user", "content": [{"type": "input_image", "image_url": "ftp://x"}]}]},
     "input[1].content[0].image_url.url"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"input": "x", "reasoning": {"effort": 3}}, "reasoning.effort"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "previous_response_id": ""}, "previous_response_id"),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
])
def test_a_malformed_responses_body_names_its_own_field(body, param):
    with pytest.raises(InvalidRequest) as info:
        parse_responses({"model": "m", **body})
    assert info.value.param == param


# ---- Messages -> chat ---------------------------------------------------------------------------------------

def test_a_messages_tool_loop_is_the_chat_history_with_tool_results_before_the_users_text():
    body = {"model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "be kind"}],
            "tools": [{"name": "get_weather", "input_schema": SCHEMA}], "tool_choice": {"type": "any"},
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                                                  {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                   "input": {"city": "Köln"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "rain",
                                              "is_error": False},
                                             {"type": "text", "text": "and tomorrow?"}]}],
            "stop_sequences": ["END"], "thinking": {"type": "disabled"}}
    api = parse_messages(body)
    system, user, assistant, tool, follow_up = template(api)
    assert system == {"role": "system", "content": "be kind"} and user["content"] == "weather?"
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Köln"}}
    assert assistant["reasoning_content"] == "hm"
    assert tool == {"role": "tool", "content": "rain", "tool_call_id": "t1"}
    assert follow_up["content"] == [{"type": "text", "text": "and tomorrow?"}]
    assert api.tool_use.choice.mode is ToolChoiceMode.REQUIRED and api.stop == ("END",)
    assert json.loads(api.template_kwargs or "{}") == {"enable_thinking": False}


def test_a_messages_image_travels_as_a_data_url():
    api = parse_messages({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PIXEL}},
        {"type": "text", "text": "what is it?"}]}]})
    assert len(api.images) == 1


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 8, "messages": []}, "messages"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"max_tokens": 8, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                      "input": "x"}]}]},
     "messages[0].content[0].input"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "stop_sequences": [""]}, "stop_sequences"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "has space",
                                                                                 "input_schema": {}}]},
     "tools[0].name"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "maybe"}},
     "thinking.type"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
])
def test_a_malformed_messages_body_names_its_own_field(body, param):
    with pytest.raises(InvalidRequest) as info:
        parse_messages({"model": "m", **body})
    assert info.value.param == param


# ---- an answer's blocks -------------------------------------------------------------------------------------

def test_an_answers_blocks_open_grow_and_close_in_the_order_the_model_wrote_them():
    blocks = AnswerBlocks()
    events = blocks.feed(Delta(reasoning="think"))
    events += blocks.feed(Delta(content="\n\n"))  # whitespace between blocks: no text block of its own
    events += blocks.feed(Delta(tool_calls=(ToolCallDelta(0, "c0", "f", '{"a":'),)))
    events += blocks.feed(Delta(tool_calls=(ToolCallDelta(0, None, None, "1}"),)))
    events += blocks.feed(Delta(content="\n"))
    events += blocks.feed(Delta(content=" done"))
    events += blocks.close()
    shape = [(type(e).__name__, e.block.index, e.text if isinstance(e, Grew) else None) for e in events]
    assert shape == [("Opened", 0, None), ("Grew", 0, "think"), ("Closed", 0, None), ("Opened", 1, None),
                     ("Grew", 1, '{"a":'), ("Grew", 1, "1}"), ("Closed", 1, None), ("Opened", 2, None),
                     ("Grew", 2, "\n done"), ("Closed", 2, None)]
    assert [(b.kind, b.text) for b in blocks.blocks] == [("reasoning", "think"), ("tool_call", '{"a":1}'),
                                                         ("text", "\n done")]
    assert blocks.has_tool_calls and isinstance(events[0], Opened) and isinstance(events[-1], Closed)


def test_whitespace_before_the_end_opens_nothing():
    blocks = AnswerBlocks()
    assert blocks.feed(Delta(content="  \n")) == [] and blocks.close() == [] and blocks.blocks == []


# ---- the embedded store -------------------------------------------------------------------------------------

def record(rid: str, at: float) -> StoredResponse:
    return StoredResponse(rid, at, json.dumps({"id": rid}), "[]")


async def test_the_embedded_store_keeps_at_most_max_count_and_forgets_what_is_too_old(tmp_path):
    now = [1000.0]
    store = SqliteStore(tmp_path / "responses.sqlite3", max_age_s=60, max_count=3, clock=lambda: now[0])
    for i in range(5):
        await store.put(record(f"r{i}", 1000.0 + i))
    assert [await store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    now[0] = 1063.5  # r2 and r3 are past 60 s
    assert await store.get("r2") is None and await store.get("r4") is not None
    assert await store.delete("r4") and not await store.delete("r4") and await store.get("r4") is None
    store.close()
    reopened = SqliteStore(tmp_path / "responses.sqlite3", max_age_s=600, max_count=3, clock=lambda: now[0])
    assert (await reopened.get("r3")) is not None  # the file outlives the process that wrote it
    reopened.close()
