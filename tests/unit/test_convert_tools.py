"""Function tools in chat requests (pure): what is accepted, what each choice guides, what the template sees."""

import json

import attrs
import pytest

from orchestrator.convert import parse_chat
from orchestrator.convert.engine import check_worker_features
from orchestrator.convert.tools import ToolChoiceMode
from orchestrator.engine.capabilities import FeatureSupport
from orchestrator.errors import InvalidRequest
from orchestrator.models import TINY_CHAT
from orchestrator.testkit.fakes import capabilities
from orchestrator.tokenizer import ModelTokenizer

WEATHER: dict = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": "weather in Paris?"}], **extra}


def error_of(body) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse_chat(body)
    return info.value


def test_tools_default_to_auto_and_are_offered_to_the_template_as_hugging_face_writes_them():
    use = parse_chat(chat(tools=[WEATHER, TIME])).tool_use
    assert use.choice.mode is ToolChoiceMode.AUTO and use.parallel and use.offered
    assert use.template_tools() == [WEATHER, {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    assert parse_chat(chat(tools=[WEATHER])).guided is None  # auto: the model decides, unguided


def test_tool_choice_none_hides_the_tools_and_guides_nothing():
    req = parse_chat(chat(tools=[WEATHER], tool_choice="none"))
    assert not req.tool_use.offered and req.tool_use.template_tools() is None and req.guided is None


def test_a_named_choice_is_guided_by_that_functions_parameter_schema():
    req = parse_chat(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert req.tool_use.choice.mode is ToolChoiceMode.NAMED and req.tool_use.choice.name == "get_weather"
    assert req.guided is not None and req.guided.kind == "json_schema" and req.guided.param == "tool_choice"
    assert json.loads(req.guided.json_schema) == WEATHER["function"]["parameters"]


def test_required_is_guided_by_an_array_of_calls_each_one_of_the_tools():
    req = parse_chat(chat(tools=[WEATHER, TIME], tool_choice="required"))
    assert req.guided is not None
    schema = json.loads(req.guided.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [call["properties"]["name"]["enum"] for call in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["function"]["parameters"]


def test_required_without_parallel_calls_admits_exactly_one_call():
    guided = parse_chat(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)).guided
    assert guided is not None
    schema = json.loads(guided.json_schema)
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"]["enum"] == ["get_weather"]


@pytest.mark.parametrize("body, param", [
    (chat(tools={"type": "function"}), "tools"),
    (chat(tools=[WEATHER] * 129), "tools"),
    (chat(tools=[WEATHER, WEATHER]), "tools"),
    (chat(tools=[{"type": "code_interpreter"}]), "tools[0].type"),
    (chat(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]), "tools[0].function.parameters"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "description": 5}}]),
     "tools[0].function.description"),
    (chat(tool_choice="auto"), "tool_choice"),  # no tools
    (chat(tools=[WEATHER], tool_choice="always"), "tool_choice"),
    (chat(tools=[WEATHER], tool_choice="function"), "tool_choice"),
    (chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name"),
    (chat(tools=[WEATHER], tool_choice={"type": "function"}), "tool_choice.function.name"),
    (chat(tools=[WEATHER], parallel_tool_calls="yes"), "parallel_tool_calls"),
    (chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (chat(functions=[WEATHER["function"]]), "functions"),
    (chat(function_call="auto"), "function_call"),
    (chat(messages=[{"role": "tool", "content": "22C"}]), "messages[0].tool_call_id"),
    (chat(messages=[{"role": "user", "content": "x", "tool_calls": []}]), "messages[0].tool_calls"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": {}}}]}]),
     "messages[0].tool_calls[0].function.arguments"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]),
     "messages[0].tool_calls[0].id"),
    (chat(chat_template_kwargs=["enable_thinking"]), "chat_template_kwargs"),
    (chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs.messages"),
    (chat(chat_template_kwargs={"x": float("nan")}), "chat_template_kwargs"),
    (chat(reasoning_effort="max"), "reasoning_effort"),
])
def test_bad_tool_input_is_a_400_naming_the_field(body, param):
    assert error_of(body).param == param


def tool_loop_history() -> list[dict]:
    return [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22C and sunny"}]


def test_a_tool_loops_history_reaches_the_template_as_hugging_face_templates_read_it():
    req = parse_chat(chat(messages=tool_loop_history(), tools=[WEATHER]))
    assistant, tool = (m.as_template_dict() for m in req.messages[1:])
    # arguments as an object: templates write them with `tojson` or iterate them (Llama 3.x, Qwen, Hermes)
    assert assistant == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert tool == {"role": "tool", "content": "22C and sunny", "tool_call_id": "call_1"}
    assert req.messages[0].as_template_dict() == {"role": "user", "content": "weather in Paris?"}


QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}")


def qwen_like(tmp_path) -> ModelTokenizer:
    (tmp_path / "tokenizer.json").write_text((TINY_CHAT / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": QWEN_LIKE}))
    return ModelTokenizer.from_dir(tmp_path)


def test_a_template_renders_the_tools_the_calls_and_the_template_kwargs_and_never_escapes_unicode(tmp_path):
    tokenizer = qwen_like(tmp_path)
    req = parse_chat(chat(messages=tool_loop_history() + [{"role": "user", "content": "und in Köln?"}],
                          tools=[WEATHER], chat_template_kwargs={"enable_thinking": False}))
    text = tokenizer.render_chat([m.as_template_dict() for m in req.messages], tools=req.tool_use.template_tools(),
                                 variables=json.loads(req.template_kwargs or "{}"))
    assert '{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "und in Köln?" in text and text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_without_tools_a_template_that_asks_for_them_renders_as_under_hugging_face(tmp_path):
    """An undefined name is falsy, as in transformers' environment, not an error: `{% if m.tool_calls %}` on a
    message without calls, `{% if tools %}` on a request without tools."""
    text = qwen_like(tmp_path).render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_reasoning_effort_is_a_template_variable_and_chat_template_kwargs_may_set_it_too():
    assert parse_chat(chat(reasoning_effort="low")).template_kwargs == '{"reasoning_effort":"low"}'
    both = parse_chat(chat(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high", "x": 1}))
    assert both.template_kwargs == '{"reasoning_effort":"high","x":1}'
    assert parse_chat(chat()).template_kwargs is None


def test_a_guided_tool_choice_needs_workers_with_guided_decoding_and_the_400_names_tool_choice():
    req = parse_chat(chat(tools=[WEATHER], tool_choice="required"))
    check_worker_features(req, [("decode", attrs.evolve(capabilities("decode"), guided_decoding=FeatureSupport(True)))])
    with pytest.raises(InvalidRequest, match=r"tool_choice 'required'.*cannot constrain the output") as info:
        check_worker_features(req, [("decode", capabilities("decode"))])
    assert info.value.param == "tool_choice" and info.value.code == "guided_decoding_not_supported"
