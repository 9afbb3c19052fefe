"""Each tool-call and reasoning format, as the upstream parser (file and commit) or model card shows the model
writing it, and what it must parse to. docs/parsers.md has the same facts as a table; tests/unit/test_parsers.py runs
every sample here through every split of its text."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import pytest

from orchestrator import parsers

TRTLLM = "NVIDIA/TensorRT-LLM"
VLLM = "vllm-project/vllm"
TRT_PARSERS = f"{TRTLLM} tensorrt_llm/serve/tool_parser"
VLLM_PARSERS = f"{VLLM} vllm/entrypoints/openai/tool_parsers"


def ds(words: str) -> str:
    """DeepSeek's special tokens (U+FF5C bars, U+2581 spaces), escaped so no look-alike sits in the source."""
    return "<\uff5c" + words.replace(" ", "\u2581") + "\uff5c>"


WEATHER_TOOL = [{"type": "function", "function": {"name": "get_current_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer"}}}}}]


class Sample(NamedTuple):
    family: str
    tool_call_parser: str | None
    reasoning_parser: str | None
    source: str  # repository, file and commit (or model card) the format is taken from
    text: str  # what the model writes
    content: str
    reasoning: str
    calls: tuple[tuple[str, dict[str, Any]], ...]  # (name, arguments as a value)
    kwargs: dict[str, Any] = {}  # noqa: RUF012 - never mutated; ParserSpec.new's keywords


SAMPLES = [
    Sample("hermes / qwen", "qwen3", None,
           f"{TRTLLM} tensorrt_llm/serve/tool_parser/qwen3_tool_parser.py@f343b8f6e216945989b0ecfe9fb6979ce63cc264",
           'I will check.\n<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Tokyo"}}\n'
           '</tool_call>\n<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Paris"}}\n'
           '</tool_call>',
           "I will check.\n", "",
           (("get_current_weather", {"location": "Tokyo"}), ("get_current_weather", {"location": "Paris"}))),
    Sample("hermes (vLLM name)", "hermes", None,
           f"{VLLM_PARSERS}/hermes_tool_parser.py@836d1f31211015f62485b0151fbbf85b6cc7a934 (model card "
           "NousResearch/Hermes-2-Pro-Llama-3-8B)",
           '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>',
           "", "", (("get_stock_fundamentals", {"symbol": "TSLA"}),)),
    Sample("llama 3.x python_tag", "llama3_json", None,
           f"{VLLM_PARSERS}/llama_tool_parser.py@500932bbc320fe504bf7d323283e708fd956a549 (Llama 3.1 model "
           "card, JSON tool calling)",
           '<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco", "metric": "celsius"}}',
           "", "", (("get_weather", {"city": "San Francisco", "metric": "celsius"}),)),
    Sample("llama 3.x bare JSON", "llama3_json", None,
           f"{VLLM_PARSERS}/llama_tool_parser.py@500932bbc320fe504bf7d323283e708fd956a549 (Llama 3.2 model card)",
           '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
           '{"name": "get_time", "parameters": {"zone": "CET"}}',
           "", "", (("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"}))),
    Sample("mistral JSON array", "mistral", None,
           f"{VLLM_PARSERS}/mistral_tool_parser.py@021235c55cb811d29770331cef7e08a25b6f4241 (tokenizer v3 and "
           "earlier)",
           '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"city": "Dallas", "state": "TX", '
           '"unit": "fahrenheit"}}, {"name": "get_time", "arguments": {}}]',
           "", "", (("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}),
                    ("get_time", {}))),
    Sample("mistral name[ARGS]", "mistral", None,
           f"{VLLM_PARSERS}/mistral_tool_parser.py@021235c55cb811d29770331cef7e08a25b6f4241 (tokenizer v11 on, "
           "with the [ARGS] control token in the text)",
           'Sure.[TOOL_CALLS]get_current_weather[ARGS]{"city": "Dallas"}[TOOL_CALLS]get_time[ARGS]{}',
           "Sure.", "", (("get_current_weather", {"city": "Dallas"}), ("get_time", {}))),
    Sample("qwen3-coder XML", "qwen3_coder", None,
           f"{TRT_PARSERS}/qwen3_coder_parser.py@0e6260459464d37ba27f0dadf0511d95052939f0 (model card "
           "Qwen/Qwen3-Coder-480B-A35B-Instruct)",
           "Checking.\n<tool_call>\n<function=get_current_weather>\n<parameter=location>\nBoston\n</parameter>\n"
           "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
           "Checking.\n", "", (("get_current_weather", {"location": "Boston", "days": 3}),),
           {"tools": WEATHER_TOOL}),
    Sample("deepseek v3", "deepseek_v3", None,
           f"{TRT_PARSERS}/deepseekv3_parser.py@205f8c25d5e278aa761e452168815d560beb7f89",
           f"{ds('tool calls begin')}{ds('tool call begin')}function{ds('tool sep')}get_current_weather\n"
           f'```json\n{{"location": "Tokyo"}}\n```{ds("tool call end")}\n{ds("tool call begin")}function'
           f'{ds("tool sep")}get_current_weather\n```json\n{{"location": "Paris"}}\n```{ds("tool call end")}'
           f"{ds('tool calls end')}",
           "", "", (("get_current_weather", {"location": "Tokyo"}), ("get_current_weather", {"location": "Paris"}))),
    Sample("deepseek v3.1", "deepseek_v31", None,
           f"{TRT_PARSERS}/deepseekv31_parser.py@1262edbc3809b30af94c3cf2ec2736a14642b821",
           f'{ds("tool calls begin")}{ds("tool call begin")}get_current_weather{ds("tool sep")}{{"location": '
           f'"Tokyo"}}{ds("tool call end")}{ds("tool call begin")}get_current_weather{ds("tool sep")}'
           f'{{"location": "Paris"}}{ds("tool call end")}{ds("tool calls end")}',
           "", "", (("get_current_weather", {"location": "Tokyo"}), ("get_current_weather", {"location": "Paris"}))),
    Sample("kimi k2", "kimi_k2", None,
           f"{TRT_PARSERS}/kimi_k2_tool_parser.py@65b31db1b401d3752b8ebe7c29093cbfb6af04b7 (model card "
           "moonshotai/Kimi-K2-Instruct docs/tool_call_guidance.md)",
           "Let me check.<|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_weather:0"
           '<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|>\n<|tool_call_begin|>'
           'functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>\n<|tool_calls_section_end|>',
           "Let me check.", "", (("get_weather", {"city": "Beijing"}), ("get_time", {}))),
    Sample("glm-4.5", "glm4", None,
           f"{TRT_PARSERS}/glm4_parser.py@2f5b0091b42555a4fabfa5545dc3dbfe5e4ba749",
           "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n<arg_key>date</arg_key>\n"
           "<arg_value>2024-06-27</arg_value>\n</tool_call>",
           "", "", (("get_weather", {"city": "北京", "date": "2024-06-27"}),)),
    Sample("glm-4.7", "glm47", None,
           f"{TRT_PARSERS}/glm47_parser.py@1545b5798b26dad23d2ff800f61751b445b30c09",
           "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Beijing</arg_value><arg_key>days</arg_key>"
           "<arg_value>2</arg_value></tool_call>",
           "", "", (("get_weather", {"city": "Beijing", "days": 2}),)),
    Sample("mistral name{args}", "mistral", None,
           f"{VLLM_PARSERS}/mistral_tool_parser.py@021235c55cb811d29770331cef7e08a25b6f4241 (tokenizer v11 on, "
           "[ARGS] skipped by the detokenizer)",
           '[TOOL_CALLS]add{"a": 3.5, "b": 4}', "", "", (("add", {"a": 3.5, "b": 4}),)),
    Sample("deepseek-r1 reasoning", None, "deepseek-r1",
           f"{TRTLLM} tensorrt_llm/llmapi/reasoning_parser.py@033a9d09d040acf7024ef3190d1fdf8780e2b192 "
           "(the prompt ends with <think>)",
           "The user greets me.\n</think>\n\nHello! How can I help?",
           "\n\nHello! How can I help?", "The user greets me.\n", ()),
    Sample("qwen3 reasoning then a call", "qwen3", "qwen3",
           f"{TRTLLM} tensorrt_llm/llmapi/reasoning_parser.py@033a9d09d040acf7024ef3190d1fdf8780e2b192",
           '<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
           '{"city": "Berlin"}}\n</tool_call>',
           "\n\n", "\nI need the weather.\n", (("get_weather", {"city": "Berlin"}),)),
    Sample("kimi k2 thinking into a call", "kimi_k2", "kimi_k2",
           f"{TRTLLM} tensorrt_llm/llmapi/reasoning_parser.py@033a9d09d040acf7024ef3190d1fdf8780e2b192 "
           "(a tool section ends the reasoning without </think>)",
           "<think>I should search.<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0"
           '<|tool_call_argument_begin|>{"q": "x"}<|tool_call_end|><|tool_calls_section_end|>',
           "", "I should search.", (("search", {"q": "x"}),)),
    Sample("qwen3 thinking off", None, "qwen3",
           f"{TRTLLM} tensorrt_llm/llmapi/reasoning_parser.py@033a9d09d040acf7024ef3190d1fdf8780e2b192 "
           "(enable_thinking=false prefills an empty block)",
           "Hello <think> is just text here.", "Hello <think> is just text here.", "", (),
           {"chat_template_kwargs": {"enable_thinking": False}}),
]


def collected(sample: Sample) -> parsers.Message:
    spec = parsers.resolve(sample.tool_call_parser, sample.reasoning_parser)
    return parsers.parse_whole(spec.new(seed="conformance", **sample.kwargs), sample.text)


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.family for s in SAMPLES])
def test_each_upstream_sample_parses_to_what_the_format_means(sample: Sample):
    message = collected(sample)
    assert message.content == sample.content
    assert message.reasoning_content == sample.reasoning
    assert [(call.name, json.loads(call.arguments)) for call in message.tool_calls] == list(sample.calls)
    assert len({call.id for call in message.tool_calls}) == len(message.tool_calls)
