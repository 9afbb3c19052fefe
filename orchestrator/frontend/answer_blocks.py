"""A parsed answer as the ordered blocks the Responses and Messages APIs speak of. Pure: no I/O.

The output parsers give deltas of reasoning, content and tool calls (orchestrator/parsers); both APIs shape an
answer as a list of blocks (output items; content blocks), each opened, grown and closed in turn: the model's
reasoning, its text, each tool call. `AnswerBlocks` turns the deltas into those events, and keeps the blocks for
the whole answer, so a stream and a collected answer are the same blocks.

Whitespace the model writes between blocks (the blank line after `</think>`, before a call) opens no text block
of its own: it is held until text follows, and dropped when a call or the end comes instead.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from orchestrator.parsers import Delta

Kind = Literal["reasoning", "text", "tool_call"]


class Block:
    __slots__ = ("index", "kind", "parts", "call_id", "name")

    def __init__(self, index: int, kind: Kind, call_id: str = "", name: str = "") -> None:
        self.index, self.kind, self.call_id, self.name = index, kind, call_id, name
        self.parts: list[str] = []

    @property
    def text(self) -> str:
        """Its text: reasoning, the answer's text, or a call's arguments (a JSON string)."""
        return "".join(self.parts)


class Opened(NamedTuple):
    block: Block


class Grew(NamedTuple):
    block: Block
    text: str


class Closed(NamedTuple):
    block: Block


BlockEvent = Opened | Grew | Closed


class AnswerBlocks:
    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._calls: dict[int, Block] = {}  # a parser's call index -> its block
        self._held = ""  # whitespace waiting to see whether text follows

    def feed(self, delta: Delta) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if delta.reasoning:
            self._grow("reasoning", delta.reasoning, events)
        if delta.content:
            self._text(delta.content, events)
        for piece in delta.tool_calls:
            block = self._calls.get(piece.index)
            if block is None or piece.name is not None:
                self._held = ""
                block = self._open_block("tool_call", events, call_id=piece.id or "", name=piece.name or "")
                self._calls[piece.index] = block
            if piece.arguments:
                block.parts.append(piece.arguments)
                events.append(Grew(block, piece.arguments))
        return events

    def close(self) -> list[BlockEvent]:
        """The answer is over: the open block closes (held whitespace is dropped)."""
        events: list[BlockEvent] = []
        self._held = ""
        if self._open is not None:
            events.append(Closed(self._open))
            self._open = None
        return events

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._calls)

    def _text(self, text: str, events: list[BlockEvent]) -> None:
        if self._open is not None and self._open.kind == "text":
            self._grow("text", text, events)
            return
        if not text.strip():
            self._held += text
            return
        text, self._held = self._held + text, ""
        self._grow("text", text, events)

    def _grow(self, kind: Kind, text: str, events: list[BlockEvent]) -> None:
        block = self._open
        if block is None or block.kind != kind:
            block = self._open_block(kind, events)
        block.parts.append(text)
        events.append(Grew(block, text))

    def _open_block(self, kind: Kind, events: list[BlockEvent], *, call_id: str = "", name: str = "") -> Block:
        if self._open is not None:
            events.append(Closed(self._open))
        block = Block(len(self.blocks), kind, call_id, name)
        self.blocks.append(block)
        self._open = block
        events.append(Opened(block))
        return block
