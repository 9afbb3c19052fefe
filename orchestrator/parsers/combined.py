"""The parser a request owns: reasoning first, then tool calls on what is left as content (as vLLM and SGLang
order them), or a pass-through when neither applies."""

from __future__ import annotations

from typing import Protocol

from orchestrator.parsers.base import ToolParser
from orchestrator.parsers.events import EMPTY, Delta, new_delta
from orchestrator.parsers.reasoning import ThinkReasoning


class StreamParser(Protocol):
    """Text deltas in, `Delta`s out. Feeding the same text in any split gives the same concatenated output."""

    def feed(self, text: str) -> Delta: ...

    def finish(self) -> Delta: ...

    @property
    def tool_calls_begun(self) -> int:
        """How many tool calls the answer has begun (the caller's `finish_reason: "tool_calls"` test)."""
        ...


class PassThrough:
    """No parser selected (or `tool_choice: "none"` on a model without reasoning): content as it comes."""

    __slots__ = ()

    def feed(self, text: str) -> Delta:
        return new_delta(Delta, (text, "", ())) if text else EMPTY

    def finish(self) -> Delta:
        return EMPTY

    @property
    def tool_calls_begun(self) -> int:
        return 0


class ChatParser:
    """A reasoning parser, then a tool parser on what it leaves as content. (Either alone is a StreamParser by
    itself: ParserSpec.new hands it out bare, one call less per token.)"""

    __slots__ = ("_reasoning", "_tools")

    def __init__(self, reasoning: ThinkReasoning, tools: ToolParser) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @property
    def tool_calls_begun(self) -> int:
        return self._tools.tool_calls_begun

    def feed(self, text: str) -> Delta:
        reasoning = self._reasoning
        if not reasoning.held and "<" not in text:  # the hot path: no tag of reasoning's in sight
            if reasoning.in_reasoning:
                return new_delta(Delta, ("", text, ())) if text else EMPTY
            return self._tools.feed(text)
        split = reasoning.feed(text)
        if not split.content:
            return split
        tools = self._tools.feed(split.content)
        if not split.reasoning:
            return tools
        return new_delta(Delta, (tools.content, split.reasoning, tools.tool_calls))

    def finish(self) -> Delta:
        split = self._reasoning.finish()
        tools = self._tools.feed(split.content) if split.content else EMPTY
        last = self._tools.finish()
        return Delta(tools.content + last.content, split.reasoning, tools.tool_calls + last.tool_calls)
