"""Parsers by name: TensorRT-LLM's names (what `ModelInfo.tool_call_parser` / `reasoning_parser` carry), vLLM's
where TensorRT-LLM has none or spells it differently. docs/parsers.md has the table with the sources."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from orchestrator.parsers.base import ToolParser
from orchestrator.parsers.combined import ChatParser, PassThrough, StreamParser
from orchestrator.parsers.events import CallIds
from orchestrator.parsers.harmony import HarmonyParser
from orchestrator.parsers.reasoning import ThinkReasoning
from orchestrator.parsers.tools_json import HermesParser, Llama3JsonParser, MistralParser
from orchestrator.parsers.tools_special import DeepSeekV3Parser, DeepSeekV31Parser, KimiK2Parser
from orchestrator.parsers.tools_xml import Glm45Parser, Qwen3CoderParser

ToolFactory = Callable[[CallIds, "list[dict[str, Any]] | None"], ToolParser]

# canonical name -> the family's parser class
TOOL_PARSERS: dict[str, ToolFactory] = {
    # TensorRT-LLM's names (tensorrt_llm/serve/tool_parser/tool_parser_factory.py)
    "qwen3": HermesParser,  # the <tool_call> JSON family
    "qwen3_coder": Qwen3CoderParser,
    "kimi_k2": KimiK2Parser,
    "deepseek_v3": DeepSeekV3Parser,
    "deepseek_v31": DeepSeekV31Parser,
    "glm4": Glm45Parser,  # GLM-4.5 / 4.6
    "glm47": Glm45Parser,  # GLM-4.7 drops the newlines; one reader takes both
    # families TensorRT-LLM has no parser for: vLLM's names
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
# gpt-oss: one harmony parser does reasoning and tools together (parsers/harmony.py). TensorRT-LLM handles harmony
# outside its parser registries (serve/harmony_adapter.py); these are vLLM's names.
HARMONY_TOOL = "openai"
HARMONY_REASONING = "openai_gptoss"
TOOL_ALIASES: dict[str, str] = {
    "hermes": "qwen3",  # vLLM's name for the same format
    "llama4_json": "llama3_json",
    "qwen3_xml": "qwen3_coder",
    "glm45": "glm4",
    "deepseekv3": "deepseek_v3",  # TensorRT-LLM's earlier spellings
    "deepseekv3.1": "deepseek_v31",
    "gpt_oss": HARMONY_TOOL,
    "harmony": HARMONY_TOOL,
}



@attrs.frozen
class ThinkFamily:
    """How a `<think>` model's answer starts and ends its reasoning."""

    starts_inside: bool  # the template ends the prompt with <think>: the answer starts inside the reasoning
    switchable: bool  # the request's enable_thinking / thinking turns the reasoning off (or, see below, on)
    implicit_close: str = ""  # a marker that also ends the reasoning, left in the content (a tool section)


REASONING_PARSERS: dict[str, ThinkFamily] = {
    "deepseek-r1": ThinkFamily(True, False),
    "qwen3": ThinkFamily(False, True),  # the model opens <think> itself; enable_thinking=false prefills a closed one
    "qwen3_5": ThinkFamily(True, True),
    "nemotron-v3": ThinkFamily(True, True, "<tool_call>"),
    "deepseek_v4": ThinkFamily(True, True),  # thinking only when the request turns it on (_THINKING_OFF_BY_DEFAULT)
    "kimi_k2": ThinkFamily(False, False, "<|tool_calls_section_begin|>"),
    "kimi_k25": ThinkFamily(True, True, "<|tool_calls_section_begin|>"),
}
REASONING_ALIASES: dict[str, str] = {
    "deepseek_r1": "deepseek-r1",  # vLLM's spelling
    "nano-v3": "nemotron-v3",
    "gpt_oss": HARMONY_REASONING,
    "harmony": HARMONY_REASONING,
}
# reasoning parsers whose thinking is off unless the request asks for it
_THINKING_OFF_BY_DEFAULT = {"deepseek_v4"}


class UnknownParserError(ValueError):
    """A parser name we do not have: the caller turns it into a config error or a degraded worker."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        super().__init__(f"unknown {kind} parser {name!r}; known: {', '.join(known)}")
        self.kind = kind
        self.name = name
        self.known = known


def tool_parser_names() -> list[str]:
    return sorted([*TOOL_PARSERS, HARMONY_TOOL, *TOOL_ALIASES])


def reasoning_parser_names() -> list[str]:
    return sorted([*REASONING_PARSERS, HARMONY_REASONING, *REASONING_ALIASES])


def _canonical(kind: str, name: str | None, table: dict[str, Any], aliases: dict[str, str],
               known: list[str]) -> str | None:
    if name is None or name == "" or name.lower() == "none":
        return None
    key = name.lower()
    key = aliases.get(key, key)
    if key not in table and key not in (HARMONY_TOOL, HARMONY_REASONING):
        raise UnknownParserError(kind, name, known)
    return key


def _thinking_on(name: str, kwargs: dict[str, Any]) -> bool:
    """What the request's chat_template_kwargs say about thinking (`enable_thinking`, or DeepSeek's `thinking`)."""
    for key in ("enable_thinking", "thinking"):
        value = kwargs.get(key)
        if value is not None:
            return bool(value)
    return name not in _THINKING_OFF_BY_DEFAULT


@attrs.frozen
class ParserSpec:
    """The parser pair a model needs, resolved once (at config or discovery time); `new` makes one request's
    parser. Build it with `resolve`, which raises UnknownParserError for a name we do not have."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    @property
    def harmony(self) -> bool:
        """gpt-oss: `new` needs harmony's encoding (parsers.harmony.load_encoding(), once at start-up)."""
        return self.tool_call_parser == HARMONY_TOOL or self.reasoning_parser == HARMONY_REASONING

    @property
    def needs_special_tokens(self) -> bool:
        """Whether the worker must send special tokens in the text (detokenize without skipping them): the
        family's markers are special tokens that a skipping detokenizer drops."""
        if self.harmony:
            return True
        factory = TOOL_PARSERS.get(self.tool_call_parser or "")
        return bool(getattr(factory, "SPECIAL_TOKENS", False))

    def new(self, *, seed: str | None = None, tools: list[dict[str, Any]] | None = None, tool_calls: bool = True,
            chat_template_kwargs: dict[str, Any] | None = None, prompt_opens_reasoning: bool | None = None,
            harmony_encoding: Any = None) -> StreamParser:
        """One request's parser.

        seed: makes tool-call ids deterministic (use the request id); tools: the request's tools (the XML families
        type parameter values by their schema); tool_calls: False for `tool_choice: "none"` (calls are then left
        as content); chat_template_kwargs: the request's, for `enable_thinking`; prompt_opens_reasoning: True when
        the rendered prompt ends inside a reasoning block, False when it closed it, None to use the family's
        default; harmony_encoding: for gpt-oss (see `harmony`), ValueError without it.
        """
        if self.harmony:
            if harmony_encoding is None:
                raise ValueError("gpt-oss output needs harmony's encoding: load it once with "
                                 "orchestrator.parsers.harmony.load_encoding() and pass harmony_encoding=")
            return HarmonyParser(harmony_encoding, CallIds(seed), tool_calls=tool_calls)
        reasoning = None
        if self.reasoning_parser is not None:
            family = REASONING_PARSERS[self.reasoning_parser]
            thinking = _thinking_on(self.reasoning_parser, chat_template_kwargs or {}) if family.switchable else True
            if prompt_opens_reasoning is not None:
                reasoning = ThinkReasoning(prompt_opens_reasoning, family.implicit_close)
            elif thinking:
                reasoning = ThinkReasoning(family.starts_inside, family.implicit_close)
        parser = None
        if self.tool_call_parser is not None and tool_calls:
            parser = TOOL_PARSERS[self.tool_call_parser](CallIds(seed), tools)
        if reasoning is not None and parser is not None:
            return ChatParser(reasoning, parser)
        return reasoning or parser or PassThrough()


def resolve(tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> ParserSpec:
    """Names as the worker advertises them or the config overrides them; None, "" or "none" select nothing."""
    tool = _canonical("tool call", tool_call_parser, TOOL_PARSERS, TOOL_ALIASES, tool_parser_names())
    reasoning = _canonical("reasoning", reasoning_parser, REASONING_PARSERS, REASONING_ALIASES,
                           reasoning_parser_names())
    return ParserSpec(tool, reasoning)
