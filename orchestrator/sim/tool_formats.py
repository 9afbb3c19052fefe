"""How each model family writes tool calls and reasoning, by the parser names TensorRT-LLM (and vLLM) use. Pure.

A sim worker started with `--tool-call-parser NAME` answers tool calls as a model behind that parser writes them,
so the orchestrator's parsers can be tested end to end. docs/simulator.md has the table of formats; the sources
are in tests/e2e/test_trtllm_conformance.py (UPSTREAM tool-formats, reasoning-formats). DeepSeek's markers are
written with fullwidth bars (U+FF5C) and U+2581 for spaces, as its tokenizer has them.

gpt-oss (`openai`, `gpt_oss`) writes its whole answer in harmony channels, reasoning included, whatever the
reasoning parser: `<|channel|>analysis<|message|>R<|end|><|start|>assistant` first (unless thinking is off), then
a call in the commentary channel or text after `<|channel|>final<|message|>`.

In the XML families (qwen3_coder, glm45) a string value is written raw and any other value as JSON. Reasoning:
`qwen3` writes `<think>\\n...\\n</think>\\n\\n` before its answer; `deepseek-r1`, `qwen3_5` and `minimax_m2`
start inside the block (their templates prefill `<think>\\n` into the prompt) and write `...\\n</think>\\n\\n`.
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

_BAR, _SPACE = "\uff5c", "\u2581"  # DeepSeek's marker characters
DS_CALLS_BEGIN = f"<{_BAR}tool{_SPACE}calls{_SPACE}begin{_BAR}>"
DS_CALLS_END = f"<{_BAR}tool{_SPACE}calls{_SPACE}end{_BAR}>"
DS_CALL_BEGIN = f"<{_BAR}tool{_SPACE}call{_SPACE}begin{_BAR}>"
DS_CALL_END = f"<{_BAR}tool{_SPACE}call{_SPACE}end{_BAR}>"
DS_SEP = f"<{_BAR}tool{_SPACE}sep{_BAR}>"


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
        return (DS_CALLS_BEGIN + "\n".join(f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{_json(args)}\n```"
                                           f"{DS_CALL_END}" for name, args in calls) + DS_CALLS_END)
    if family == "deepseek_v31":
        return (DS_CALLS_BEGIN + "".join(f"{DS_CALL_BEGIN}{name}{DS_SEP}{_json(args)}{DS_CALL_END}"
                                         for name, args in calls) + DS_CALLS_END)
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
        return "".join(f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{_json(args)}"
                       "<|call|>" for name, args in calls)
    raise ValueError(f"unknown tool-call parser {parser!r}")


HARMONY_ANALYSIS = "<|channel|>analysis<|message|>{}<|end|><|start|>assistant"
HARMONY_FINAL = "<|channel|>final<|message|>"


def harmony(parser: str) -> bool:
    """gpt-oss writes everything in harmony channels: its reasoning (analysis), calls (commentary), text (final)."""
    return TOOL_FAMILIES.get(parser) == "harmony"


def render_reasoning(parser: str, reasoning: str, *, opened_in_prompt: bool) -> str:
    """The reasoning block before an answer. `opened_in_prompt`: the prompt already ends with `<think>\\n`."""
    opens = REASONING_OPENS_BLOCK[parser] and not opened_in_prompt
    return ("<think>\n" if opens else "") + reasoning + "\n</think>\n\n"
