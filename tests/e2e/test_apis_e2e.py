"""The Responses API and the Anthropic Messages API end to end, through the clients that speak them, unchanged.

The simulated workers behave as a Qwen3-like model (docs/simulator.md): they call a tool when one is offered and
the user spoke last, answer in text after a tool result, and think first.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest

from serve_helpers import Deployment

MODEL_FLAGS: tuple[str, ...] = ("--time-scale", "0", "--tool-call-parser", "qwen3", "--reasoning-parser", "qwen3",
                                "--guided-backend", "xgrammar", "--schema-revision", "3", "--natural-eos")
SCHEMA: dict = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_TOOL: Any = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                        "parameters": SCHEMA}
MESSAGES_TOOL: Any = {"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}


@pytest.fixture(scope="module", params=["aggregated", "disaggregated"])
def deployment(request, tmp_path_factory):
    roles = ({"aggregated": [MODEL_FLAGS]} if request.param == "aggregated"
             else {"prefill": [MODEL_FLAGS], "decode": [MODEL_FLAGS]})
    deployment = Deployment(tmp_path_factory.mktemp(request.param), request.param, roles)
    yield deployment
    deployment.close()


# ---- the Responses API ----------------------------------------------------------------------------------

def test_responses_run_a_tool_loop_through_previous_response_id(deployment):
    client = deployment.openai()
    first = client.responses.create(model="tiny-chat", input="What is the weather in Paris?",
                                    tools=[RESPONSES_TOOL], instructions="Use the tools.")
    assert first.status == "completed" and first.id.startswith("resp_")
    kinds = [item.type for item in first.output]
    assert kinds == ["reasoning", "function_call"]  # the model thought, then called (no empty text between)
    call = first.output[1]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    assert first.usage is not None and first.usage.output_tokens_details.reasoning_tokens > 0
    # instructions are not carried to a continuation (as OpenAI does): the client sends them again
    second = client.responses.create(model="tiny-chat", previous_response_id=first.id, tools=[RESPONSES_TOOL],
                                     instructions="Use the tools.",
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "light snow"}])
    assert "light snow" in second.output_text
    # the continuation's prompt starts with the conversation stored: the engine found it cached
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_a_streamed_response_is_the_responses_event_sequence(deployment):
    client = deployment.openai()
    with client.responses.stream(model="tiny-chat", input="Weather in Oslo?", tools=[RESPONSES_TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done == [0, 1]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == final.output[1].arguments and json.loads(arguments)["city"]


def test_a_streamed_text_answer_streams_output_text(deployment):
    client = deployment.openai()
    for budget in (24, 4096):
        with client.responses.stream(model="tiny-chat", input="Tell me a story", max_output_tokens=budget,
                                     reasoning={"effort": "low"}) as stream:
            events = list(stream)
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        last = events[-1]
        assert last.response.output_text == text
        if budget == 24:  # cut while thinking: OpenAI's `response.incomplete`, with the reason
            assert last.type == "response.incomplete" and last.response.incomplete_details is not None
            assert last.response.incomplete_details.reason == "max_output_tokens"
        else:
            assert last.type == "response.completed" and text


def test_json_schema_output_through_text_format(deployment):
    answer = deployment.openai().responses.create(
        model="tiny-chat", input="Where?",
        text={"format": {"type": "json_schema", "name": "place", "schema": SCHEMA}})
    assert isinstance(json.loads(answer.output_text)["city"], str)


def test_a_stored_response_can_be_deleted_and_an_unknown_one_is_a_404(deployment):
    client = deployment.openai()
    answer = client.responses.create(model="tiny-chat", input="hi", max_output_tokens=8)
    client.responses.delete(answer.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(answer.id)
    with pytest.raises(openai.NotFoundError, match="resp_gone"):
        client.responses.create(model="tiny-chat", input="more", previous_response_id="resp_gone")
    unstored = client.responses.create(model="tiny-chat", input="hi", max_output_tokens=8, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "telepathy"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
])
def test_malformed_responses_input_is_a_400_naming_the_field(deployment, body, param):
    with deployment.http() as http:
        reply = http.post("/v1/responses", json={"model": "tiny-chat", **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


# ---- the Messages API ------------------------------------------------------------------------------------

def anthropic_client(deployment) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=deployment.url, api_key="unused", max_retries=0)


def test_messages_run_a_tool_loop(deployment):
    client = anthropic_client(deployment)
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Lima?"}]
    first = client.messages.create(model="tiny-chat", max_tokens=512, messages=messages, tools=[MESSAGES_TOOL],
                                   system="You check the weather.")
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["thinking", "tool_use"]
    use = first.content[1]
    assert use.type == "tool_use" and use.name == "get_weather" and isinstance(use.input, dict)
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": [{"type": "text", "text": "hot and dry"}]}]}]
    second = client.messages.create(model="tiny-chat", max_tokens=512, messages=messages, tools=[MESSAGES_TOOL],
                                    thinking={"type": "disabled"})
    text = "".join(b.text for b in second.content if b.type == "text")
    assert "hot and dry" in text and not any(b.type == "thinking" for b in second.content)
    assert (second.usage.cache_read_input_tokens or 0) > 0  # the loop's shared prefix was cached


def test_a_streamed_message_is_anthropics_event_sequence(deployment):
    client = anthropic_client(deployment)
    with client.messages.stream(model="tiny-chat", max_tokens=512, tools=[MESSAGES_TOOL],
                                messages=[{"role": "user", "content": "Weather in Rome?"}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert final.content[-1].input["city"]


def test_count_tokens_counts_the_rendered_prompt(deployment):
    client = anthropic_client(deployment)
    short = client.messages.count_tokens(model="tiny-chat", messages=[{"role": "user", "content": "hi"}])
    longer = client.messages.count_tokens(model="tiny-chat", messages=[{"role": "user", "content": "hi " * 50}],
                                          tools=[MESSAGES_TOOL])
    assert 0 < short.input_tokens < longer.input_tokens


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0].type"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/tiff", "data": "AAAA"}}]}]}, "messages[0].content[0].source.media_type"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]},
     "tools[0].input_schema"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "maybe"}},
     "tool_choice.type"),
])
def test_malformed_messages_are_anthropic_400s_naming_the_field(deployment, body, field):
    with deployment.http() as http:
        reply = http.post("/v1/messages", json={"model": "tiny-chat", **body})
    assert reply.status_code == 400
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(field)


def test_an_unknown_model_is_anthropics_not_found_error(deployment):
    with pytest.raises(anthropic.NotFoundError) as info:
        anthropic_client(deployment).messages.create(model="claude-9", max_tokens=8,
                                                     messages=[{"role": "user", "content": "x"}])
    assert info.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


# ---- several replicas share the store ----------------------------------------------------------------------

def test_two_replicas_sharing_redis_continue_each_others_responses(tmp_path, redis_server):
    responses = {"store": "redis", "url": redis_server.url, "key_prefix": f"test-{tmp_path.name}"}
    first = Deployment(tmp_path, "aggregated", {"aggregated": [MODEL_FLAGS]}, responses=responses)
    try:
        second_server = first.servers.start(first.config)
        client_a = first.openai()
        client_b = openai.OpenAI(base_url=second_server.url + "/v1", api_key="unused", max_retries=0)
        answer = client_a.responses.create(model="tiny-chat", input="Remember the word heron.", max_output_tokens=8)
        followup = client_b.responses.create(model="tiny-chat", input="And now?", max_output_tokens=8,
                                             previous_response_id=answer.id)
        assert followup.previous_response_id == answer.id
        assert client_a.responses.retrieve(followup.id).id == followup.id
        with httpx.Client(base_url=second_server.url) as http:
            assert http.delete(f"/v1/responses/{answer.id}").json()["deleted"] is True
        with pytest.raises(openai.NotFoundError):
            client_a.responses.retrieve(answer.id)
    finally:
        first.close()


# ---- a continuation follows its prefix ---------------------------------------------------------------------

def test_a_continuation_is_routed_where_its_conversation_is_cached(tmp_path):
    """previous_response_id makes the new prompt the stored conversation plus the new input: with kv_aware
    routing over three workers, every continuation lands where its conversation was served and finds it cached
    (round robin would move two in three of them to a worker that holds none of it)."""
    deployment = Deployment(tmp_path, "aggregated", {"aggregated": [MODEL_FLAGS] * 3},
                            routing={"aggregated": "kv_aware"})
    try:
        client = deployment.openai()
        threads = {}
        for name in ("heron", "otter", "lynx"):
            instructions = f"You are the {name} guide. " + " ".join(f"{name}-rule-{i} holds;" for i in range(60))
            threads[name] = (instructions, client.responses.create(
                model="tiny-chat", input=f"Tell me about the {name}.", instructions=instructions,
                max_output_tokens=16, reasoning={"effort": "low"}))
        for turn, order in enumerate((["lynx", "otter", "heron"], ["otter", "heron", "lynx"])):
            for name in order:  # (not the order they started in: a round robin would line up by chance)
                instructions, previous = threads[name]
                # the load each worker reports is fresh with its next health check (kv-routing.md)
                time.sleep(0.5)
                answer = client.responses.create(model="tiny-chat", input=f"And then ({turn})?",
                                                 instructions=instructions, previous_response_id=previous.id,
                                                 max_output_tokens=16)
                assert answer.usage is not None
                assert answer.usage.input_tokens_details.cached_tokens >= 18 * 32, (name, turn, answer.usage)
                threads[name] = (instructions, answer)
    finally:
        deployment.close()


def test_a_message_that_ends_on_a_stop_sequence_says_which(deployment):
    """After a tool result the model answers "The tool returned ..."; cut on "returned" that is Anthropic's
    stop_reason "stop_sequence", naming it, and its text is not in the answer."""
    client = anthropic_client(deployment)
    messages: list[Any] = [
        {"role": "user", "content": "Weather in Quito?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Quito"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "mild"}]}]
    kwargs: dict[str, Any] = {"model": "tiny-chat", "max_tokens": 64, "messages": messages,
                              "tools": [MESSAGES_TOOL], "stop_sequences": ["returned"],
                              "thinking": {"type": "disabled"}}
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    for answer in (whole, streamed):
        assert answer.stop_reason == "stop_sequence" and answer.stop_sequence == "returned"
        text = "".join(getattr(b, "text", "") for b in answer.content if b.type == "text")
        assert text.startswith("The tool") and "returned" not in text
