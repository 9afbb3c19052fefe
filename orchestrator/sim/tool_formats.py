"""How each model family writes tool calls and reasoning, by the parser names TensorRT-LLM (and vLLM) use. Pure.

A sim worker started with `--tool-call-parser NAME` answers tool calls as a model behind that parser writes them,
so the orchestrator's parsers can be tested end to end. The formats (sources in tests/test_trtllm_conformance.py,
UPSTREAM tool-formats):

| family | names | one call |
|---|---|---|
| hermes | qwen3, hermes | `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>` |
| qwen3_coder | qwen3_coder | `<tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>` |
| llama3_json | llama3_json, llama3 | `{"name": N, "parameters": {...}}` (bare JSON; several joined by `; `) |
| mistral | mistral | `[TOOL_CALLS][{"name": N, "arguments": {...}}]` |
| deepseek_v3 | deepseek_v3, deepseekv3 | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\n{...}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>` |
| deepseek_v31 | deepseek_v31, deepseekv3.1 | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜><｜tool▁calls▁end｜>` |
| kimi_k2 | kimi_k2 | `<|tool_calls_section_begin|><|tool_call_begin|>functions.N:I<|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>` |
| glm45 | glm4, glm45 | `<tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>` |
| harmony | openai, gpt_oss | `<|channel|>commentary to=functions.N <|constrain|>json<|message|>{...}<|call|>` |

In the XML families (qwen3_coder, glm45) a string value is written raw and any other value as JSON. Reasoning:
`qwen3` writes `<think>\\n...\\n</think>\\n\\n` before its answer; `deepseek-r1`, `qwen3_5` and `minimax_m2` start
inside the block (their templates prefill `<think>\\n` into the prompt) and write `...\\n</think>\\n\\n`.
"""

from __future__ import annotations

import json
from typing import Any

TOOL_FAMILIES = {"qwen3": "hermes", "hermes": "hermes", "qwen3_coder": "qwen3_coder", "llama3_json": "llama3_json",
                 "llama3": "llama3_json", "mistral": "mistral", "deepseek_v3": "deepseek_v3",
                 "deepseekv3": "deepseek_v3", "deepseek_v31": "deepseek_v31", "deepseekv3.1": "deepseek_v31",
                 "kimi_k2": "kimi_k2", "glm4": "glm45", "glm45": "glm45", "openai": "harmony", "gpt_oss": "harmony"}
# reasoning parser -> whether the model's own output opens the block (False: the template prefilled `<think>`)
REASONING_OPENS_BLOCK = {"qwen3": True, "deepseek-r1": False, "deepseek_r1": False, "qwen3_5": False,
                         "minimax_m2": False}
TOOL_CALL_PARSERS = tuple(TOOL_FAMILIES)
REASONING_PARSERS = tuple(REASONING_OPENS_BLOCK)

Call = tuple[str, dict[str, Any]]  # (function name, arguments)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _xml_value(value: Any) -> str:
    return value if isinstance(value, str) else _json(value)


def render_calls(parser: str, calls: list[Call]) -> str:
    """The text a model behind `parser` writes for these calls (no EOS)."""
    family = TOOL_FAMILIES[parser]
    if family == "hermes":
        return "\n".join(f'<tool_call>\n{{"name": {_json(name)}, "arguments": {_json(args)}}}\n</tool_call>'
                         for name, args in calls)
    if family == "qwen3_coder":
        return "\n".join("<tool_call>\n<function=" + name + ">\n" +
                         "".join(f"<parameter={key}>\n{_xml_value(value)}\n</parameter>\n"
                                 for key, value in args.items()) + "</function>\n</tool_call>"
                         for name, args in calls)
    if family == "llama3_json":
        return "; ".join(f'{{"name": {_json(name)}, "parameters": {_json(args)}}}' for name, args in calls)
    if family == "mistral":
        return "[TOOL_CALLS]" + _json([{"name": name, "arguments": args} for name, args in calls])
    if family == "deepseek_v3":
        return ("<｜tool▁calls▁begin｜>" +
                "\n".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{_json(args)}\n```"
                          "<｜tool▁call▁end｜>" for name, args in calls) + "<｜tool▁calls▁end｜>")
    if family == "deepseek_v31":
        return ("<｜tool▁calls▁begin｜>" +
                "".join(f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{_json(args)}<｜tool▁call▁end｜>"
                        for name, args in calls) + "<｜tool▁calls▁end｜>")
    if family == "kimi_k2":
        return ("<|tool_calls_section_begin|>" +
                "".join(f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{_json(args)}"
                        "<|tool_call_end|>" for index, (name, args) in enumerate(calls)) +
                "<|tool_calls_section_end|>")
    if family == "glm45":
        return "\n".join(f"<tool_call>{name}\n" +
                         "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{_xml_value(value)}</arg_value>\n"
                                 for key, value in args.items()) + "</tool_call>"
                         for name, args in calls)
    if family == "harmony":
        return "".join(f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{_json(args)}<|call|>"
                       for name, args in calls)
    raise ValueError(f"unknown tool-call parser {parser!r}")


def render_reasoning(parser: str, reasoning: str, *, opened_in_prompt: bool) -> str:
    """The reasoning block before an answer. `opened_in_prompt`: the prompt already ends with `<think>\\n`."""
    opens = REASONING_OPENS_BLOCK[parser] and not opened_in_prompt
    return ("<think>\n" if opens else "") + reasoning + "\n</think>\n\n"
