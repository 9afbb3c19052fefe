"""What the simulated model answers: a scripted start (reasoning, a tool call, a guided instance) and where it
ends. Pure: a function of the prompt, the guide, the seed and the persona's parsers, so the prefill and decode
legs, and a migrated continuation, script the same answer.

- A guide (json_schema, json_object, choice, structural_tag) is answered with a valid instance and EOS, as guided
  decoding forces; no reasoning block then (the grammar holds from the first token). A regex or EBNF guide is not
  modelled: the text stays unconstrained.
- A chat whose tools are offered calls one when tool_choice is required or a named function, or when it is auto and
  the last turn is the user's (two distinct functions when the template allowed parallel calls); the calls are
  written in the advertised tool parser's format (hermes without one: the tiny-chat template's own) with
  arguments valid under each function's parameters, then EOS. After a tool result (last turn `tool`) the model
  answers in text that quotes the result. tool_choice none: text.
- With a reasoning parser and thinking on (the template did not close an empty block), the answer starts with
  a reasoning block in that parser's format. gpt-oss (harmony) writes every part in its channel.
- Free text (after any scripted start) is the usual deterministic words; without max_tokens it ends with EOS
  after a natural length: a log-normal draw per prompt and seed, median 64 tokens, sigma 0.75, clipped to
  [8, 1024] (chat answers are mostly short, with a long tail), counted from the start of the answer.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import attrs
from tokenizers import Tokenizer

from orchestrator.sim import schema_instance, tool_formats
from orchestrator.sim.chat_prompt import ChatPrompt

NATURAL_MEDIAN, NATURAL_SIGMA, NATURAL_MIN, NATURAL_MAX = 64, 0.75, 8, 1024
_WORDS = ("the", "request", "asks", "about", "weather", "in", "a", "city", "so", "I", "should", "check", "what",
          "tools", "can", "answer", "it", "and", "then", "reply", "briefly", "with", "numbers", "first")


@attrs.frozen
class Plan:
    script: tuple[int, ...] = ()  # the answer's first tokens
    ends: bool = False  # EOS right after the script (structured output); else free words follow
    offset: int = 0  # answer tokens already in the prompt (a migrated request's)
    natural_length: int | None = None  # EOS once the answer has this many tokens (None: only max_tokens ends it)


@attrs.frozen
class Parsers:
    tool_call: str = ""  # a tool_formats.TOOL_FAMILIES name, or "" (hermes calls, nothing advertised)
    reasoning: str = ""  # a tool_formats.REASONING_OPENS_BLOCK name, or "" (no reasoning)


def natural_length(key: int) -> int:
    rng = random.Random(key ^ 0x5EED_1E46)
    draw = math.exp(math.log(NATURAL_MEDIAN) + NATURAL_SIGMA * rng.gauss(0.0, 1.0))
    return max(NATURAL_MIN, min(NATURAL_MAX, round(draw)))


def plan(chat: ChatPrompt | None, guide: tuple[str, Any] | None, parsers: Parsers, key: int, tokenizer: Tokenizer,
         *, max_tokens_given: bool) -> Plan:
    """The answer for a request. `key`: the prompt's (up to the answer) and seed's output.request_key."""
    rng = random.Random(key)
    offset = chat.answered if chat is not None else 0
    natural = None if max_tokens_given else natural_length(key)
    text = guided_text(guide, rng) if guide is not None else None
    if text is not None:
        return Plan(_encode(tokenizer, text), ends=True, offset=offset)
    if chat is None:
        return Plan(natural_length=natural)
    pieces = []
    harmony = tool_formats.harmony(parsers.tool_call)
    if harmony and not chat.thinking_off:
        pieces.append(tool_formats.HARMONY_ANALYSIS.format(_sentence(rng, 12, 40)))
    elif parsers.reasoning and not chat.thinking_off:
        pieces.append(tool_formats.render_reasoning(parsers.reasoning, _sentence(rng, 12, 40),
                                                    opened_in_prompt=False))
    calls = _calls(chat, rng)
    if calls:
        pieces.append(tool_formats.render_calls(parsers.tool_call or "hermes", calls))
        return Plan(_encode(tokenizer, "".join(pieces)), ends=True, offset=offset)
    if harmony:
        pieces.append(tool_formats.HARMONY_FINAL)
    if chat.last_role == "tool":
        pieces.append(f"The tool returned {chat.last_content.strip()[:200]}. ")
    script = _encode(tokenizer, "".join(pieces)) if pieces else ()
    return Plan(script, ends=False, offset=offset,
                natural_length=None if natural is None else len(script) + natural)


def _encode(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False).ids)


def _sentence(rng: random.Random, low: int, high: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(low, high))]
    return " ".join(words).capitalize() + "."


def _calls(chat: ChatPrompt, rng: random.Random) -> list[tool_formats.Call]:
    if not chat.tools or chat.tool_choice == "none":
        return []
    if chat.tool_choice == "auto" and chat.last_role != "user":
        return []  # after a tool result (or anything but a question) the model answers in text
    named = None
    if chat.tool_choice == "function":
        named = next((f for f in chat.tools if f["name"] == chat.named_function), None)
    if named is not None:
        functions = [named]
    elif chat.parallel_calls and len(chat.tools) > 1:  # allowed several: two distinct functions, as models do
        functions = rng.sample(list(chat.tools), 2)
    else:
        functions = [rng.choice(chat.tools)]
    return [(function["name"], _arguments(function, rng)) for function in functions]


def _arguments(function: dict, rng: random.Random) -> dict:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    try:
        arguments = schema_instance.instance(parameters, rng)
    except schema_instance.SchemaError:
        arguments = {}
    return arguments if isinstance(arguments, dict) else {}


def guided_text(guide: tuple[str, Any], rng: random.Random) -> str | None:
    """A text the guide admits (None: a guide the sim does not model, or one it cannot read)."""
    kind, value = guide
    try:
        if kind == "json_schema":
            return json.dumps(schema_instance.instance(json.loads(value), rng), ensure_ascii=False)
        if kind == "json_object":
            return json.dumps({"answer": _sentence(rng, 3, 12)})
        if kind == "choice":
            return rng.choice(list(value)) if value else None
        if kind == "structural_tag":
            return _structural_text(json.loads(value), rng)
    except (ValueError, KeyError, TypeError, IndexError):  # an unreadable guide: answer unconstrained
        return None
    return None


def _structural_text(tag: dict, rng: random.Random) -> str:
    """xgrammar's structural tags: the legacy {structures, triggers} form, or {format: ...} with its format types."""
    if "structures" in tag:
        structure = rng.choice(tag["structures"])
        return (structure["begin"] + json.dumps(schema_instance.instance(structure.get("schema", {}), rng))
                + structure["end"])
    return _format_text(tag.get("format", tag), rng)


def _format_text(fmt: dict, rng: random.Random) -> str:
    kind = fmt.get("type")
    if kind == "const_string":
        return fmt["value"]
    if kind == "json_schema":
        return json.dumps(schema_instance.instance(fmt.get("json_schema", {}), rng), ensure_ascii=False)
    if kind == "any_text":
        return _sentence(rng, 3, 12)
    if kind == "tag":
        return fmt["begin"] + _format_text(fmt.get("content", {"type": "any_text"}), rng) + fmt["end"]
    if kind == "sequence":
        return "".join(_format_text(element, rng) for element in fmt["elements"])
    if kind == "or":
        return _format_text(rng.choice(fmt["elements"]), rng)
    if kind in ("triggered_tags", "tags_with_separator"):  # one tag: a single call, no text around it
        return _format_text({"type": "tag", **rng.choice(fmt["tags"])}, rng) if fmt.get("tags") else ""
    if kind == "qwen_xml_parameter":  # Qwen3-Coder's <parameter=K>V</parameter> body for a JSON schema
        arguments = schema_instance.instance(fmt.get("json_schema", {}), rng)
        return "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                       for k, v in (arguments.items() if isinstance(arguments, dict) else ()))
    return ""  # regex, grammar: not modelled
