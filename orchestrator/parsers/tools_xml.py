"""Tool calls whose arguments are XML-ish key/value pairs, not JSON: Qwen3-Coder
(`<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`) and GLM-4.5 / 4.7
(`<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>`).

The arguments string is built with json_text: `{` when the call's name is read, then `"key": value` as each
parameter closes (a value is final only then: "12" may still become "123"), then `}` when the call closes. A
value's JSON type comes from the request's tool schema; without one, Qwen3-Coder keeps text (as upstream does)
and GLM takes the text as JSON when it parses as such (as upstream does).
"""

from __future__ import annotations

import json
from typing import Any

from orchestrator.parsers.base import ToolParser, json_text, parameter_types
from orchestrator.parsers.events import CallIds
from orchestrator.parsers.text import held_suffix


def _typed(text: str, kind: str | None, guess: bool) -> Any:
    """A parameter's text as the JSON value its schema type says (or, with `guess`, as whatever JSON it is)."""
    if kind == "string" or (kind is None and not guess):
        return text
    if kind == "boolean" and text.strip() in ("True", "False"):
        return text.strip() == "True"
    try:
        return json.loads(text)
    except ValueError:
        return text


class XmlCallParser(ToolParser):
    """The shared frame: `<tool_call>` head (the family reads the name), parameters, `</tool_call>`."""

    START = "<tool_call>"
    END = "</tool_call>"
    KEY_OPEN = ""
    GUESS_TYPES = False
    MAX_HEAD = 256

    def __init__(self, ids: CallIds, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(ids, tools)
        self._state = "content"
        self._types = parameter_types(tools)
        self._name = ""
        self._first = True
        self._raw = ""

    def _step(self, final: bool) -> bool:
        state = self._state
        if state == "content":
            if self._scan_content(final):
                self._state = "head"
                return True
            return False
        if state == "head":
            return self._read_head(final)
        if state == "params":
            return self._read_params(final)
        if state == "reject":
            return self._read_reject(final)
        return self._read_tail(final)

    # ---- the family's part ------------------------------------------------------------------------------------
    def _read_head(self, final: bool) -> bool:
        raise NotImplementedError

    def _read_param(self, buf: str, final: bool) -> tuple[str, str, str] | None:
        """(key, value text, the rest) for a whole parameter at the start of buf, or None to wait."""
        raise NotImplementedError

    def _closes_call(self, buf: str) -> str | None:
        """The rest after the call's closing marker when buf starts with it, else None."""
        raise NotImplementedError

    # ---- shared -------------------------------------------------------------------------------------------------
    def _start_call(self, name: str) -> None:
        self._name = name
        self._first = True
        self._begin_call(name, "{")
        self._state = "params"

    def _read_params(self, final: bool) -> bool:
        # whitespace between parameters is dropped; the buffer is not touched until that is decided, so how the
        # text was split cannot change what is kept
        buf = self._buf
        stripped = buf.lstrip()
        if not stripped:
            if final:
                self._buf = ""
                self._to_content()
            return False
        rest = self._closes_call(stripped)
        if rest is not None:
            self._emit_arguments("}")
            self._buf = rest
            return True
        if stripped.startswith(self.KEY_OPEN):
            param = self._read_param(stripped, final)
            if param is None:
                if final:  # cut off inside a parameter: the call keeps what it streamed
                    self._buf = ""
                    self._to_content()
                return False
            key, text, self._buf = param
            value = _typed(text, self._types.get(self._name, {}).get(key), self.GUESS_TYPES)
            self._emit_arguments(("" if self._first else ", ") + json_text(key) + ": " + json_text(value))
            self._first = False
            return True
        if not final and any(marker.startswith(stripped) for marker in self._markers()):
            return False
        # text between parameters that is none of the format's markers: content, never lost
        ends = [i for i in (buf.find(m) for m in self._markers()) if i != -1]
        if ends:
            cut = min(ends)
            self._emit_content(buf[:cut].rstrip())
            self._buf = buf[cut:]
            return True
        if final:
            self._emit_content(buf)
            self._buf = ""
            self._to_content()
            return False
        keep = len(buf) - max(held_suffix(buf, marker) for marker in self._markers())
        keep = len(buf[:keep].rstrip())  # trailing whitespace waits: a marker may follow it
        self._emit_content(buf[:keep])
        self._buf = buf[keep:]
        return False

    def _markers(self) -> tuple[str, ...]:
        return (self.KEY_OPEN, self.END)

    def _read_tail(self, final: bool) -> bool:
        """After the function closed: up to `</tool_call>`."""
        buf = self._buf
        i = buf.find(self.END)
        if i == -1:
            if final:
                self._emit_content(buf.strip())
                self._buf = ""
                self._to_content()
            return False
        self._emit_content(buf[:i].strip())
        self._buf = buf[i + len(self.END):]
        self._to_content()
        self._call_ended()
        return True

    def _reject(self) -> None:
        self._raw = self.START
        self._state = "reject"

    def _read_reject(self, final: bool) -> bool:
        """A `<tool_call>` block that names no function: the whole block becomes content."""
        buf = self._buf
        i = buf.find(self.END)
        if i == -1 and not final:
            return False
        cut = len(buf) if i == -1 else i + len(self.END)
        self._emit_content(self._raw + buf[:cut])
        self._buf = buf[cut:]
        self._to_content()
        return True

    def _to_content(self) -> None:
        self._state = "content"
        self._in_content = True


class Qwen3CoderParser(XmlCallParser):
    """`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`; a
    value loses one leading and one trailing newline."""

    FUNCTION = "<function="
    KEY_OPEN = "<parameter="
    KEY_CLOSE = "</parameter>"
    FUNCTION_END = "</function>"

    def _read_head(self, final: bool) -> bool:
        buf = self._buf.lstrip()
        if not buf or (not final and self.FUNCTION.startswith(buf)):
            if final:
                self._reject()
            return final
        if not buf.startswith(self.FUNCTION):
            self._reject()
            return True
        i = buf.find(">")
        if i == -1:
            if final or len(buf) > self.MAX_HEAD:
                self._reject()
                return True
            return False
        name = buf[len(self.FUNCTION):i].strip()
        if not name or any(c in name for c in "<{\n"):
            self._reject()
            return True
        self._buf = buf[i + 1:]
        self._start_call(name)
        return True

    def _read_param(self, buf: str, final: bool) -> tuple[str, str, str] | None:
        i = buf.find(">")
        if i == -1:
            return None
        key = buf[len(self.KEY_OPEN):i].strip()
        body = buf[i + 1:]
        # the value ends at `</parameter>`; a model that forgets it ends it at the next parameter or `</function>`
        ends = [j for j in (body.find(self.KEY_CLOSE), body.find(self.KEY_OPEN), body.find(self.FUNCTION_END))
                if j != -1]
        if not ends:
            return None
        j = min(ends)
        text = body[:j]
        rest = body[j + len(self.KEY_CLOSE):] if body.startswith(self.KEY_CLOSE, j) else body[j:]
        if text.startswith("\n"):
            text = text[1:]
        if text.endswith("\n"):
            text = text[:-1]
        return key, text, rest

    def _closes_call(self, buf: str) -> str | None:
        if buf.startswith(self.FUNCTION_END):
            self._state = "tail"
            return buf[len(self.FUNCTION_END):]
        if buf.startswith(self.END):  # `</function>` forgotten
            self._to_content()
            self._call_ended_after(buf[len(self.END):])
            return self._buf
        return None

    def _call_ended_after(self, rest: str) -> None:
        self._buf = rest
        self._call_ended()

    def _markers(self) -> tuple[str, ...]:
        return (self.KEY_OPEN, self.FUNCTION_END, self.END)


class Glm45Parser(XmlCallParser):
    """`<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>` (GLM-4.5 / 4.6;
    GLM-4.7 drops the newlines, which this reads too)."""

    KEY_OPEN = "<arg_key>"
    KEY_CLOSE = "</arg_key>"
    VALUE_OPEN = "<arg_value>"
    VALUE_CLOSE = "</arg_value>"
    GUESS_TYPES = True

    def _read_head(self, final: bool) -> bool:
        buf = self._buf
        ends = [i for i in (buf.find("\n"), buf.find(self.KEY_OPEN), buf.find(self.END)) if i != -1]
        if not ends:
            held = max(held_suffix(buf, self.KEY_OPEN), held_suffix(buf, self.END))
            if final or len(buf) - held > self.MAX_HEAD:
                self._reject()
                return True
            return False
        i = min(ends)
        name = buf[:i].strip()
        if not name or any(c in name for c in "<>{}\"") or " " in name:
            self._reject()
            return True
        self._buf = buf[i:]
        self._start_call(name)
        return True

    def _read_param(self, buf: str, final: bool) -> tuple[str, str, str] | None:
        i = buf.find(self.KEY_CLOSE)
        if i == -1:
            return None
        key = buf[len(self.KEY_OPEN):i].strip()
        body = buf[i + len(self.KEY_CLOSE):].lstrip()
        if not body.startswith(self.VALUE_OPEN):
            if len(body) < len(self.VALUE_OPEN) and self.VALUE_OPEN.startswith(body):
                return None
            return key, "", body  # a key without a value: the value is empty text
        j = body.find(self.VALUE_CLOSE)
        if j == -1:
            return None
        return key, body[len(self.VALUE_OPEN):j], body[j + len(self.VALUE_CLOSE):]

    def _closes_call(self, buf: str) -> str | None:
        if buf.startswith(self.END):
            self._to_content()
            rest = buf[len(self.END):]
            self._buf = rest
            self._call_ended()
            return self._buf
        return None
