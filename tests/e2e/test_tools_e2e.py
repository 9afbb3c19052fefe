"""Agent-ready chat end to end: the clients application developers run, unchanged, against real deployments.

The simulated workers behave as a Qwen3-like model (docs/simulator.md): they advertise the `qwen3` tool-call
and reasoning parsers and an xgrammar backend, call a tool when one is offered and the user spoke last, answer in
text after a tool result, think first unless `enable_thinking` is false, and honour a JSON-schema guide.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from serve_helpers import Deployment, chat_body, sse_events

MODEL_FLAGS: tuple[str, ...] = ("--time-scale", "0", "--tool-call-parser", "qwen3", "--reasoning-parser", "qwen3",
                                "--guided-backend", "xgrammar", "--natural-eos")
WEATHER: dict = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME: dict = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["aggregated", "disaggregated"])
def deployment(request, tmp_path_factory):
    """Aggregated on the sibling server's persona, which advertises both parsers in ModelInfo; disaggregated on
    revision 1's, which advertises only its reasoning parser (TensorRT-LLM fills tool_call_parser nowhere
    there), so the config names the tool-call parser, as an operator of such a fleet does."""
    roles: dict[str, list[tuple[str, ...]]]
    if request.param == "aggregated":
        roles = {"aggregated": [(*MODEL_FLAGS, "--schema-revision", "3")]}
        sections: dict = {}
    else:
        roles = {"prefill": [MODEL_FLAGS], "decode": [MODEL_FLAGS]}
        sections = {"model": {"tool_call_parser": "qwen3"}}
    deployment = Deployment(tmp_path_factory.mktemp(request.param), request.param, roles, **sections)
    yield deployment
    deployment.close()


def test_the_openai_sdk_runs_a_two_step_tool_loop(deployment):
    client = deployment.openai()
    messages: list = list(QUESTION)
    first = client.chat.completions.create(model="tiny-chat", messages=messages, tools=[WEATHER, TIME])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and calls[0].type == "function" and calls[0].id.startswith("call_")
    assert calls[0].function.name in ("get_weather", "get_time")
    arguments = json.loads(calls[0].function.arguments)
    assert isinstance(arguments, dict) and set(arguments) >= set(
        (WEATHER if calls[0].function.name == "get_weather" else TIME)["function"]["parameters"]["required"])
    assert choice.message.reasoning_content  # the model thought first (qwen3)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": calls[0].id, "content": "18 degrees and light rain"}]
    second = client.chat.completions.create(model="tiny-chat", messages=messages, tools=[WEATHER, TIME])
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    assert "18 degrees and light rain" in (second.choices[0].message.content or "")


def test_a_streamed_tool_loop_reads_as_openai_streams_it(deployment):
    client = deployment.openai()
    messages: list = list(QUESTION)
    calls: dict[int, dict] = {}
    content, reasoning, finish = "", "", None
    with client.chat.completions.create(model="tiny-chat", messages=messages, tools=[WEATHER], stream=True,
                                        stream_options={"include_usage": True}) as stream:
        for chunk in stream:
            if not chunk.choices:
                assert chunk.usage is not None and chunk.usage.completion_tokens > 0
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for piece in delta.tool_calls or ():
                if piece.id is not None:
                    assert piece.function is not None and piece.function.name == "get_weather"
                    calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
                assert piece.function is not None
                calls[piece.index]["arguments"] += piece.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and reasoning and list(calls) == [0]
    assert "city" in json.loads(calls[0]["arguments"])
    messages += [{"role": "assistant", "content": content or None, "tool_calls": [
                     {"id": calls[0]["id"], "type": "function",
                      "function": {"name": "get_weather", "arguments": calls[0]["arguments"]}}]},
                 {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny, 24 degrees"}]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="tiny-chat", messages=messages, tools=[WEATHER], stream=True) if chunk.choices)
    assert "sunny, 24 degrees" in text


def test_tool_choice_none_answers_in_text_and_named_and_required_force_calls(deployment):
    client = deployment.openai()
    plain = client.chat.completions.create(model="tiny-chat", messages=QUESTION, tools=[WEATHER], tool_choice="none",
                                           max_tokens=24)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")
    named = client.chat.completions.create(model="tiny-chat", messages=QUESTION, tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = named.choices[0].message.tool_calls[0]
    assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    assert isinstance(json.loads(call.function.arguments)["zone"], str)
    required = client.chat.completions.create(model="tiny-chat", messages=QUESTION, tools=[WEATHER, TIME],
                                              tool_choice="required", parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in ("get_weather", "get_time") and json.loads(calls[0].function.arguments)


def test_json_mode_answers_a_valid_instance_of_the_schema(deployment):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "rain": {"type": "boolean"},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "rain", "days"]}
    answer = deployment.openai().chat.completions.create(
        model="tiny-chat", messages=QUESTION,
        response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": schema}})
    value = json.loads(answer.choices[0].message.content)
    assert isinstance(value["city"], str) and isinstance(value["rain"], bool) and 1 <= value["days"] <= 7
    assert json.loads(deployment.openai().chat.completions.create(
        model="tiny-chat", messages=QUESTION, response_format={"type": "json_object"}).choices[0].message.content)


def test_thinking_can_be_turned_off_per_request(deployment):
    client = deployment.openai()
    thinking = client.chat.completions.create(model="tiny-chat", messages=QUESTION, max_tokens=64)
    silent = client.chat.completions.create(model="tiny-chat", messages=QUESTION, max_tokens=64,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert thinking.choices[0].message.reasoning_content
    assert "<think>" not in (thinking.choices[0].message.content or "")
    assert getattr(silent.choices[0].message, "reasoning_content", None) is None


def test_n_choices_are_indexed_interleaved_in_a_stream_and_counted_in_the_usage(deployment):
    client = deployment.openai()
    whole = client.chat.completions.create(model="tiny-chat", messages=QUESTION, n=3, max_tokens=12, seed=7,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage.completion_tokens == 36 and whole.usage.prompt_tokens > 0
    with deployment.http() as http:
        body = chat_body(n=2, max_tokens=8, stream=True, stream_options={"include_usage": True})
        events = sse_events(http.post("/v1/chat/completions", json=body).text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1]
    usage = [e for e in events[:-1] if not e["choices"]]
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 16


def test_n_on_completions_too(deployment):
    answer = deployment.openai().completions.create(model="tiny-chat", prompt="The weather", n=2, max_tokens=5)
    assert [c.index for c in answer.choices] == [0, 1] and answer.usage.completion_tokens == 10


def test_litellm_runs_a_two_step_tool_loop(deployment, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled price table: no fetch from the internet
    litellm = pytest.importorskip("litellm")
    kwargs = {"model": "openai/tiny-chat", "api_base": deployment.url + "/v1", "api_key": "unused",
              "tools": [WEATHER]}
    messages: list = list(QUESTION)
    first = litellm.completion(messages=messages, **kwargs)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "windy"}]
    second = litellm.completion(messages=messages, **kwargs)
    assert second.choices[0].finish_reason == "stop" and "windy" in second.choices[0].message.content


def test_the_openai_agents_sdk_calls_a_function_tool_and_answers_with_its_result(deployment):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        seen.append(city)
        return f"hail over {city}"

    async def run() -> str:
        client = AsyncOpenAI(base_url=deployment.url + "/v1", api_key="unused", max_retries=0)
        agent = agents.Agent(name="forecaster", instructions="Answer with the weather.", tools=[get_weather],
                             model=agents.OpenAIChatCompletionsModel(model="tiny-chat", openai_client=client))
        result = await agents.Runner.run(agent, "What is the weather in Oslo?",
                                         run_config=agents.RunConfig(tracing_disabled=True), max_turns=4)
        return str(result.final_output)

    final = asyncio.run(run())
    assert len(seen) == 1 and "hail over" in final
