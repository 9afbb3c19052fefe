"""Tool calls written as JSON objects `{"name": ..., "arguments": {...}}`: the `<tool_call>` family (Hermes, Qwen
2.5 / 3), Llama 3.x (`<|python_tag|>` or a bare object opening the answer; `parameters` for `arguments`) and
Mistral (`[TOOL_CALLS]` with a JSON array, or the newer `[TOOL_CALLS]name[ARGS]{...}`).

Arguments stream raw: once `{"name": "...", "arguments": ` has been read, every character of the arguments object
goes out as the model wrote it, so nothing is ever taken back and the concatenated fragments are the model's own
JSON text. An object whose keys come in another order is read whole and its arguments written with json_text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from orchestrator.parsers.base import ToolParser, json_text
from orchestrator.parsers.events import CallIds
from orchestrator.parsers.text import JsonValueEnd, held_suffix

# `{"name": "get_weather", "arguments": {` as far as the opening brace of the arguments
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*\{')


def _call_of(obj: Any) -> tuple[str, str] | None:
    """(name, arguments JSON) of a whole call object, or None when it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        return obj["name"], arguments
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json_text(arguments)


class JsonCallParser(ToolParser):
    """A call is one JSON object; the family says what opens the calls (`_scan_content`) and what may come
    between and after them (`_after_call`)."""

    GUARD = ""  # an end tag that closes the call even inside an unbalanced object (outside strings)

    def __init__(self, ids: CallIds, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(ids, tools)
        self._state = "content"
        self._raw = ""  # the text of a call not yet known to be one, given back as content if it is not
        self._whole: JsonValueEnd | None = None  # the whole-object scan while the header is not yet matched
        self._scanned = 0
        self._args: JsonValueEnd | None = None

    def _step(self, final: bool) -> bool:
        if self._state == "content":
            if self._scan_content(final):
                self._raw = self.START
                self._state = "object"
                return True
            return False
        if self._state == "object":
            return self._read_object(final)
        if self._state == "args":
            return self._read_args(final)
        return self._after_call(final)

    # ---- one object -------------------------------------------------------------------------------------------
    def _read_object(self, final: bool) -> bool:
        buf = self._buf
        stripped = buf.lstrip()
        if not stripped:
            if final:
                self._raw += buf
                self._buf = ""
                self._reject(final)
            return False
        if stripped[0] != "{":
            self._reject(final)
            return True
        match = _HEADER.match(buf)
        if match is not None:
            try:
                name = json.loads(f'"{match.group(1)}"')
            except ValueError:
                name = None
            if isinstance(name, str) and name:
                self._begin_call(name, "{")
                self._buf = buf[match.end():]
                self._raw = ""
                self._whole = None
                self._args = JsonValueEnd()
                self._state = "args"
                return True
        if self._whole is None:
            self._whole = JsonValueEnd(depth=0)
            self._scanned = 0
        end = self._whole.scan(buf[self._scanned:])
        if end == -1:
            self._scanned = len(buf)
            if final:
                self._raw += buf
                self._buf = ""
                self._whole = None
                self._reject(final)
            return False
        end += self._scanned
        self._whole = None
        text = buf[:end]
        try:
            call = _call_of(json.loads(text))
        except ValueError:
            call = None
        self._buf = buf[end:]
        if call is None:
            self._raw += text
            self._reject(final)
            return True
        self._begin_call(*call)
        self._raw = ""
        self._state = "close"
        self._whole = JsonValueEnd(depth=0)  # already closed: _close_outer passes at once
        return True

    def _scan(self, scanner: JsonValueEnd, buf: str) -> tuple[str, int]:
        """Scan buf for the end of an open JSON value, minding the family's end tag (GUARD): ("closed", index
        past the value), ("guard", index of an end tag outside any string: the value was never closed), or
        ("more", how much of buf is decided; the rest may be the start of the end tag)."""
        guard = self.GUARD
        pos = 0
        while True:
            i = buf.find(guard, pos) if guard else -1
            end = scanner.scan(buf[pos:] if i == -1 else buf[pos:i])
            if end != -1:
                return "closed", pos + end
            if i == -1:
                # a held partial end tag has no quote, bracket or backslash: scanning it again later is harmless
                held = held_suffix(buf, guard) if guard and not scanner.in_string else 0
                return "more", len(buf) - held
            if not scanner.in_string:
                return "guard", i
            pos = i + len(guard)  # the end tag sits inside a string value: it is text

    def _read_args(self, final: bool) -> bool:
        scanner = self._args
        if scanner is None:
            return False
        buf = self._buf
        outcome, at = self._scan(scanner, buf)
        if outcome == "more":
            if final:  # cut off: the call keeps the arguments it streamed
                at = len(buf)
            self._emit_arguments(buf[:at])
            self._buf = buf[at:]
            if final:
                self._buf = ""
                self._to_content()
            return False
        self._emit_arguments(buf[:at])
        self._buf = buf[at:]
        self._args = None
        if outcome == "guard":  # the end tag came first: the call ends with its arguments as written
            self._state = "after"
            return True
        self._whole = JsonValueEnd(depth=1)  # what is left of the outer object: its `}` (or extra keys)
        self._state = "close"
        return True

    def _close_outer(self) -> bool:
        """Skip the rest of the outer object after the arguments; True once past its closing brace (or at the
        family's end tag, when the model left the object open)."""
        scanner = self._whole
        if scanner is None or scanner.depth == 0:
            self._whole = None
            return True
        outcome, at = self._scan(scanner, self._buf)
        self._buf = self._buf[at:]
        if outcome == "more":
            return False
        self._whole = None
        return True

    def _to_content(self) -> None:
        self._state = "content"
        self._in_content = True

    def _reject(self, final: bool) -> None:
        """What was read as the start of a call (self._raw) is not one: it is content, never lost."""
        self._emit_content(self._raw)
        self._raw = ""
        self._whole = None
        self._to_content()

    def _after_call(self, final: bool) -> bool:
        raise NotImplementedError


class HermesParser(JsonCallParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, calls one after another (Hermes 2 Pro,
    Qwen 2.5, Qwen 3)."""

    START = "<tool_call>"
    END = "</tool_call>"
    GUARD = END

    def _reject(self, final: bool) -> None:
        # not a call: the whole block, tags and all, becomes content once its end tag is read
        if final:
            self._raw += self._buf
            self._buf = ""
            super()._reject(final)
        else:
            self._state = "reject"

    def _step(self, final: bool) -> bool:
        if self._state != "reject":
            return super()._step(final)
        buf = self._buf
        i = buf.find(self.END)
        if i == -1:
            if not final:
                return False
            i = len(buf) - len(self.END)
        self._raw += buf[:i + len(self.END)]
        self._buf = buf[i + len(self.END):]
        super()._reject(final)
        return True

    def _after_call(self, final: bool) -> bool:
        if self._state == "close":
            if not self._close_outer():
                if final:
                    self._end_block()
                return False
            self._state = "after"
        buf = self._buf
        i = buf.find(self.END)
        if i == -1:
            if final:
                leftover = buf.strip()
                self._buf = ""
                self._end_block()
                self._emit_content(leftover)
            return False
        leftover = buf[:i].strip()
        self._buf = buf[i + len(self.END):]
        self._end_block()
        self._emit_content(leftover)
        return True

    def _end_block(self) -> None:
        self._to_content()
        self._call_ended()


class Llama3JsonParser(JsonCallParser):
    """Llama 3.x JSON calls: `<|python_tag|>{"name": ..., "parameters": {...}}`, or a bare such object opening the
    answer; several are separated by `;`."""

    START = "<|python_tag|>"
    SPECIAL_TOKENS = True  # <|python_tag|> is a special token of Llama 3's tokenizer

    def __init__(self, ids: CallIds, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(ids, tools)
        self._state = "start"
        self._in_content = False

    def _step(self, final: bool) -> bool:
        if self._state == "start":  # a bare object may open the answer; anything else is content
            stripped = self._buf.lstrip()
            if not stripped and not final:
                return False
            if stripped[:1] == "{":
                self._state = "object"
            else:
                self._to_content()
            return True
        return super()._step(final)

    def _after_call(self, final: bool) -> bool:
        if self._state == "close":
            if not self._close_outer():
                if final:
                    self._to_content()
                return False
            self._state = "after"
        stripped = self._buf.lstrip()
        if not stripped:
            if final:
                self._to_content()
                self._buf = ""
            return False
        if stripped[0] == ";":
            self._buf = stripped[1:]
            self._raw = ""
            self._state = "object"
            return True
        self._to_content()
        self._call_ended()
        return True


class MistralParser(JsonCallParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizer v3 and earlier) or
    `[TOOL_CALLS]name[ARGS]{...}` (tokenizer v11 on, optionally `name[CALL_ID]id[ARGS]{...}`; `name{...}` when
    the detokenizer skipped the [ARGS] control token), repeated."""

    START = "[TOOL_CALLS]"
    SPECIAL_TOKENS = True  # a control token of Mistral's tokenizers (vLLM turns skip_special_tokens off for it)
    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"
    MAX_NAME = 256

    def __init__(self, ids: CallIds, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(ids, tools)
        self._array = False

    def _step(self, final: bool) -> bool:
        if self._state == "content":
            if self._scan_content(final):
                self._raw = self.START
                self._state = "kind"
                return True
            return False
        if self._state == "kind":
            stripped = self._buf.lstrip()
            if not stripped and not final:
                return False
            self._array = stripped[:1] == "["
            if self._array:
                self._raw += self._buf[:len(self._buf) - len(stripped) + 1]
                self._buf = stripped[1:]
                self._state = "object"
            else:
                self._state = "name"
            return True
        if self._state == "name":
            return self._read_name(final)
        return super()._step(final)

    def _new_id(self, index: int) -> str:
        return self._ids.alphanumeric(index)  # Mistral's templates reject any other id form

    def _read_name(self, final: bool) -> bool:
        buf = self._buf
        i = buf.find(self.ARGS)
        brace = buf.find("{")
        if brace != -1 and (i == -1 or brace < i):
            # `name{...}`: the text of a detokenizer that skipped the [ARGS] control token (vLLM's form)
            head, rest = buf[:brace], buf[brace:]
        elif i != -1:
            head, rest = buf[:i], buf[i + len(self.ARGS):]
        else:
            # a name is short: past MAX_NAME characters without `[ARGS]` or `{` this is not a call
            if final or len(buf) - held_suffix(buf, self.ARGS) > self.MAX_NAME:
                self._raw += buf
                self._buf = ""
                self._reject(final)
                return not final
            return False
        name = head.partition(self.CALL_ID)[0].strip()
        stripped = rest.lstrip()
        if not stripped and not final:
            return False
        if not name or any(c in name for c in ' \n{}[]"') or stripped[:1] != "{":
            self._raw += buf[:len(buf) - len(rest)]
            self._buf = rest
            self._reject(final)
            return True
        self._begin_call(name, "{")
        self._raw = ""
        self._buf = stripped[1:]
        self._args = JsonValueEnd()
        self._state = "args"
        return True

    def _read_args(self, final: bool) -> bool:
        if self._array:
            return super()._read_args(final)
        scanner = self._args
        if scanner is None:
            return False
        buf = self._buf
        end = scanner.scan(buf)
        if end == -1:
            self._emit_arguments(buf)
            self._buf = ""
            if final:
                self._to_content()
            return False
        self._emit_arguments(buf[:end])
        self._buf = buf[end:]
        self._args = None
        self._to_content()
        self._call_ended()
        return True

    def _after_call(self, final: bool) -> bool:
        # the array form: `,` then the next object, `]` ends the calls
        if self._state == "close":
            if not self._close_outer():
                if final:
                    self._to_content()
                return False
            self._state = "after"
        stripped = self._buf.lstrip()
        if not stripped:
            if final:
                self._to_content()
                self._buf = ""
            return False
        if stripped[0] == ",":
            self._buf = stripped[1:]
            self._raw = ""
            self._state = "object"
            return True
        self._buf = stripped[1:] if stripped[0] == "]" else stripped
        self._to_content()
        self._call_ended()
        return True
