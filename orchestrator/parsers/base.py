"""The common frame of the tool-call parsers: a buffer of text not yet decided, an output being built, and the
bookkeeping of call indexes and ids. A family writes `_step` (consume what can be decided, say whether to go on)."""

from __future__ import annotations

import json
from typing import Any

from orchestrator.parsers.events import EMPTY, CallIds, Delta, ToolCallDelta, new_delta
from orchestrator.parsers.text import held_suffix


def parameter_types(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, str]]:
    """function name -> parameter name -> JSON-schema type, from an OpenAI `tools` list (what the XML families
    need to turn a parameter's text into a JSON value). Anything malformed is skipped: the request layer validates
    tools; here a missing type only means "keep the text as a string"."""
    types: dict[str, dict[str, str]] = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        properties = (function.get("parameters") or {}).get("properties") if isinstance(
            function.get("parameters"), dict) else None
        found: dict[str, str] = {}
        if isinstance(properties, dict):
            for name, schema in properties.items():
                kind = schema.get("type") if isinstance(schema, dict) else None
                if isinstance(kind, list):  # ["integer", "null"]: the first non-null type decides
                    kind = next((k for k in kind if k != "null"), None)
                if isinstance(kind, str):
                    found[name] = kind
        types[function["name"]] = found
    return types


def json_text(value: Any) -> str:
    """The one way the parsers write JSON they build themselves (non-ASCII kept, OpenAI's separators)."""
    return json.dumps(value, ensure_ascii=False)


class ToolParser:
    """Base of the incremental tool-call parsers: a StreamParser on its own (`feed(text)` and `finish()` give
    Deltas with content and tool calls), or behind a reasoning parser in a ChatParser.

    Whitespace that follows a call is held: it is dropped when another call or the end follows, and goes out with
    the content when text follows, so parallel calls separated by newlines add no stray content.
    """

    START = ""  # the marker that opens the tool-call part of the output, found in the content state
    # whether the format's markers are special tokens a detokenizer skips by default (ParserSpec.needs_special_tokens)
    SPECIAL_TOKENS = False

    def __init__(self, ids: CallIds, tools: list[dict[str, Any]] | None = None) -> None:
        self._ids = ids
        self._tools = tools
        self._buf = ""
        self._in_content = True
        self._count = 0  # calls begun so far; the next call's index
        self._holding = False  # after a call: whitespace is held (see the class docstring)
        self._pending_ws = ""
        self._out_content: list[str] = []
        self._out_calls: list[ToolCallDelta] = []

    # ---- the public face ------------------------------------------------------------------------------------
    def feed(self, text: str) -> Delta:
        if self._in_content and not self._buf and not self._holding and self.START[0] not in text:
            # the hot path: plain content without the marker's first character, so neither the marker nor the
            # start of one (a single `in`, no regex, no scan)
            return new_delta(Delta, (text, "", ())) if text else EMPTY
        self._buf += text
        while self._step(False):
            pass
        return self._take()

    def finish(self) -> Delta:
        while self._step(True):
            pass
        if self._buf:  # a family that left text undecided at the end: it was never part of a call
            self._emit_content(self._buf)
            self._buf = ""
        return self._take()

    @property
    def tool_calls_begun(self) -> int:
        """How many tool calls the answer has begun (the caller's `finish_reason: "tool_calls"` test)."""
        return self._count

    # ---- for the families -----------------------------------------------------------------------------------
    def _step(self, final: bool) -> bool:
        """Consume from self._buf what can be decided; True to be called again. `final`: no more text comes."""
        raise NotImplementedError

    def _scan_content(self, final: bool) -> bool:
        """The content state: emit text up to the start marker, keep a possible partial marker. True when the
        marker was found (the buffer then starts just after it)."""
        buf = self._buf
        i = buf.find(self.START)
        if i != -1:
            self._emit_content(buf[:i])
            self._buf = buf[i + len(self.START):]
            self._in_content = False
            return True
        held = 0 if final else held_suffix(buf, self.START)
        self._emit_content(buf[:len(buf) - held])
        self._buf = buf[len(buf) - held:]
        return False

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        if self._holding:
            if not text.strip():
                self._pending_ws += text
                return
            text = self._pending_ws + text
            self._pending_ws = ""
            self._holding = False
        self._out_content.append(text)

    def _call_ended(self) -> None:
        """After a call: whitespace that follows is held (see the class docstring)."""
        self._holding = True
        stripped = self._buf.lstrip()
        self._pending_ws = self._buf[:len(self._buf) - len(stripped)]
        self._buf = stripped

    def _begin_call(self, name: str, arguments: str = "", call_id: str | None = None) -> None:
        self._pending_ws = ""
        self._holding = False
        index = self._count
        self._count += 1
        self._out_calls.append(ToolCallDelta(index, call_id or self._new_id(index), name, arguments))

    def _new_id(self, index: int) -> str:
        return self._ids(index)

    def _emit_arguments(self, text: str) -> None:
        if not text:
            return
        last = self._out_calls[-1] if self._out_calls else None
        index = self._count - 1
        if last is not None and last.index == index:
            self._out_calls[-1] = last._replace(arguments=last.arguments + text)
        else:
            self._out_calls.append(ToolCallDelta(index, None, None, text))

    def _take(self) -> Delta:
        if not self._out_content and not self._out_calls:
            return EMPTY
        content = "".join(self._out_content)
        calls = tuple(self._out_calls)
        self._out_content.clear()
        self._out_calls.clear()
        return Delta(content, "", calls)
