"""The parser a request owns: reasoning first, then tool calls on what is left as content (as vLLM and SGLang
order them), or a pass-through when neither applies."""

from __future__ import annotations

from typing import Protocol

from orchestrator.parsers.base import ToolParser
from orchestrator.parsers.events import EMPTY, Delta
from orchestrator.parsers.reasoning import ThinkReasoning


class StreamParser(Protocol):
    """Text deltas in, `Delta`s out. Feeding the same text in any split gives the same concatenated output."""

    def feed(self, text: str) -> Delta: ...

    def finish(self) -> Delta: ...


class PassThrough:
    """No parser selected (or `tool_choice: "none"` on a model without reasoning): content as it comes."""

    __slots__ = ()

    def feed(self, text: str) -> Delta:
        return Delta(text) if text else EMPTY

    def finish(self) -> Delta:
        return EMPTY


class ChatParser:
    """A reasoning parser, a tool parser, or both; either may be None."""

    __slots__ = ("_reasoning", "_tools")

    def __init__(self, reasoning: ThinkReasoning | None, tools: ToolParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @property
    def tool_calls_begun(self) -> int:
        """How many tool calls the answer has begun (the caller's `finish_reason: "tool_calls"` test)."""
        return self._tools.calls if self._tools is not None else 0

    def feed(self, text: str) -> Delta:
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text)
        else:
            reasoning, content = "", text
        if self._tools is not None and content:
            content, calls = self._tools.feed(content)
            return Delta(content, reasoning, calls)
        return Delta(content, reasoning)

    def finish(self) -> Delta:
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        if self._tools is None:
            return Delta(content, reasoning)
        more_content, calls = self._tools.feed(content) if content else ("", ())
        last_content, last_calls = self._tools.finish()
        return Delta(more_content + last_content, reasoning, calls + last_calls)
