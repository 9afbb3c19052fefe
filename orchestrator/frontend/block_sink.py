"""The output sink of the APIs whose answers are blocks (the Responses and Messages APIs).

The decode stage writes text deltas to it as to any sink (decode/deltas.py's OutputSink); it runs the request's
output parser over them (the same parser the chat path runs, across both legs and any migration), turns the
parsed deltas into blocks (answer_blocks.py) and, when the answer is streamed, hands each batch of block events
to its API's writer. It is written from the request's task only: no direct delivery.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from orchestrator.frontend.answer_blocks import AnswerBlocks, BlockEvent
from orchestrator.parsers import Delta, StreamParser


class BlockWriter(Protocol):
    def blocks(self, events: list[BlockEvent]) -> bytes: ...


class BlockSink:
    per_token = False  # blocks grow by whatever arrived together
    direct = None  # written from the request's task only: no direct delivery

    def __init__(self, parser: StreamParser | None, writer: BlockWriter | None = None,
                 send: Callable[[bytes], object] | None = None) -> None:
        """`writer` and `send` (an async callable taking bytes): a stream's; None for an answer sent whole."""
        self.parser, self.writer, self.send = parser, writer, send
        self.answer = AnswerBlocks()
        self.reason = "stop"
        self.prompt_tokens = self.completion_tokens = 0
        self.cached_tokens: int | None = None
        self.stop_text: str | None = None  # the stop string the answer ended on

    async def deltas(self, items: Sequence) -> None:
        events: list[BlockEvent] = []
        for text, _, _ in items:
            events += self.answer.feed(self._parse(text))
        await self._write(events)

    def ending(self) -> None:
        pass

    async def finish(self, reason: str, prompt_tokens: int, completion_tokens: int, *,
                     cached_tokens: int | None = None, stop_text: str | None = None) -> None:
        events = self.answer.feed(self.parser.finish()) if self.parser is not None else []
        events += self.answer.close()
        if reason == "stop" and self.answer.has_tool_calls:
            reason = "tool_calls"
        self.reason, self.prompt_tokens, self.completion_tokens = reason, prompt_tokens, completion_tokens
        self.cached_tokens, self.stop_text = cached_tokens, stop_text
        await self._write(events)

    def _parse(self, text: str) -> Delta:
        return self.parser.feed(text) if self.parser is not None else Delta(text)

    async def _write(self, events: list[BlockEvent]) -> None:
        if events and self.writer is not None and self.send is not None:
            data = self.writer.blocks(events)
            if data:
                await self.send(data)  # type: ignore[misc]  # an async callable
