"""The answers of a guided tool choice, read as tool calls (convert/tools.py says how they are guided).

- `NamedCall`: `tool_choice` names a function, and the guide made the whole answer its arguments: one call to it,
  its arguments streamed as they come.
- `RequiredCalls`: `tool_choice: "required"`, and the guide made the answer a JSON array of
  {"name": ..., "parameters": {...}}: each element a call, streamed once it is whole.

The engine's guide guarantees the shape; should an answer still not have it (a worker that ignores guides), the
text is given back as content rather than lost.
"""

from __future__ import annotations

import json

from orchestrator.parsers.events import EMPTY, CallIds, Delta, ToolCallDelta


class NamedCall:
    """The whole answer is the arguments of one call to `name`."""

    __slots__ = ("_name", "_ids", "_started")

    def __init__(self, name: str, ids: CallIds) -> None:
        self._name, self._ids, self._started = name, ids, False

    @property
    def tool_calls_begun(self) -> int:
        return int(self._started)

    def feed(self, text: str) -> Delta:
        if not text:
            return EMPTY
        if not self._started:
            self._started = True
            return Delta(tool_calls=(ToolCallDelta(0, self._ids(0), self._name, text),))
        return Delta(tool_calls=(ToolCallDelta(0, None, None, text),))

    def finish(self) -> Delta:
        if not self._started:  # an empty answer is still the one call the request forced: no arguments
            self._started = True
            return Delta(tool_calls=(ToolCallDelta(0, self._ids(0), self._name, "{}"),))
        return EMPTY


class RequiredCalls:
    """The answer is a JSON array of calls. It is read whole at the end: the calls reach a stream with the
    finish, each in one piece (OpenAI's stream shape allows a call's arguments in its first piece)."""

    __slots__ = ("_ids", "_text", "_calls")

    def __init__(self, ids: CallIds) -> None:
        self._ids, self._calls = ids, 0
        self._text: list[str] = []

    @property
    def tool_calls_begun(self) -> int:
        return self._calls

    def feed(self, text: str) -> Delta:
        if text:
            self._text.append(text)
        return EMPTY

    def finish(self) -> Delta:
        text = "".join(self._text)
        self._text = []
        calls = _calls_of(text)
        if calls is None:
            return Delta(text) if text else EMPTY
        self._calls = len(calls)
        return Delta(tool_calls=tuple(ToolCallDelta(i, self._ids(i), name, arguments)
                                      for i, (name, arguments) in enumerate(calls)))


def _calls_of(text: str) -> list[tuple[str, str]] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append((item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))
    return calls
