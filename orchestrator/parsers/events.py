"""What a parser hands back: deltas for a stream, and the collected message they add up to.

The values are NamedTuples, not attrs classes: one is built per generated token on the streaming hot path, and a
tuple costs a fraction of an attrs instance (the whole per-token budget is 2 µs, benchmarks/parsers.py).
"""

from __future__ import annotations

import hashlib
import uuid
from typing import NamedTuple


class ToolCallDelta(NamedTuple):
    """One piece of one tool call, as OpenAI streams it: the first piece of a call carries its `id` and `name`
    (and maybe the start of its arguments), later pieces only argument text."""

    index: int  # type: ignore[assignment]  # OpenAI's field name; it shadows tuple.index, unused here
    id: str | None
    name: str | None
    arguments: str

    def openai(self) -> dict[str, object]:
        """As an element of a chunk's `delta.tool_calls`."""
        function: dict[str, str] = {"arguments": self.arguments}
        if self.id is None:
            return {"index": self.index, "function": function}
        function["name"] = self.name or ""
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


class Delta(NamedTuple):
    """What one `feed` (or `finish`) produced. Empty strings and an empty tuple mean nothing of that kind."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


EMPTY = Delta()
# Delta's own constructor is a Python function (NamedTuple's __new__); the hot paths build their Deltas with
# tuple's, half the cost: new_delta(Delta, (content, reasoning, tool_calls)).
new_delta = tuple.__new__


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str  # a JSON string, as OpenAI's `function.arguments`

    def openai(self) -> dict[str, object]:
        """As an element of `message.tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class Message(NamedTuple):
    """The collected view of a whole answer: `message.content`, `reasoning_content`, `tool_calls`."""

    content: str
    reasoning_content: str
    tool_calls: tuple[ToolCall, ...]


class Collector:
    """Adds deltas up into a `Message`; the collected view is by construction the concatenation of the stream."""

    __slots__ = ("_content", "_reasoning", "_calls")

    def __init__(self) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, list[str]] = {}  # index -> [id, name, argument pieces...]

    def add(self, delta: Delta) -> None:
        if delta.content:
            self._content.append(delta.content)
        if delta.reasoning:
            self._reasoning.append(delta.reasoning)
        for piece in delta.tool_calls:
            parts = self._calls.get(piece.index)
            if parts is None:
                parts = self._calls[piece.index] = [piece.id or "", piece.name or ""]
            parts.append(piece.arguments)

    def message(self) -> Message:
        calls = tuple(ToolCall(parts[0], parts[1], "".join(parts[2:]))
                      for _, parts in sorted(self._calls.items()))
        return Message("".join(self._content), "".join(self._reasoning), calls)


class CallIds:
    """Tool-call ids: `call_` and 24 hex digits, unique per call in a request. Derived from the request's seed when
    there is one, so a replayed or migrated request names its calls the same; random otherwise."""

    __slots__ = ("_seed",)

    def __init__(self, seed: str | None = None) -> None:
        self._seed = seed if seed is not None else uuid.uuid4().hex

    def __call__(self, index: int) -> str:
        return f"call_{self._digest(index).hex()}"

    def alphanumeric(self, index: int, length: int = 9) -> str:
        """For templates that insist on their own id form (Mistral's: nine letters and digits)."""
        number = int.from_bytes(self._digest(index), "big")
        chars = []
        for _ in range(length):
            number, digit = divmod(number, 62)
            chars.append(_ALPHANUMERIC[digit])
        return "".join(chars)

    def _digest(self, index: int) -> bytes:
        return hashlib.blake2b(f"{self._seed}\x00{index}".encode(), digest_size=12).digest()


_ALPHANUMERIC = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
