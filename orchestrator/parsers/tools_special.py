"""Tool calls in a section delimited by special tokens, one call after another, arguments as raw JSON between a
header and an end marker: DeepSeek V3 and V3.1, Kimi K2. Arguments stream as the model writes them."""

from __future__ import annotations

import re
from typing import Any

from orchestrator.parsers.base import ToolParser
from orchestrator.parsers.events import CallIds
from orchestrator.parsers.text import held_suffix, held_suffix_any


def _ds(words: str) -> str:
    """DeepSeek's special tokens: `<|tool calls begin|>` written with U+FF5C for the bars and U+2581 for the
    spaces, as its tokenizer spells them (escaped here so no look-alike character sits in the source)."""
    return "<\uff5c" + words.replace(" ", "\u2581") + "\uff5c>"


class SectionParser(ToolParser):
    """START opens the section; each call is CALL_BEGIN header HEADER_END arguments ARGS_END [CALL_END]; the
    section closes with SECTION_END. A family says how its header names the call (`_header`)."""

    SECTION_END = ""
    CALL_BEGIN = ""
    HEADER_END = ""
    ARGS_END = ""
    CALL_END = ""  # a marker after ARGS_END that closes the call, when the format has one
    MAX_HEADER = 512  # a header longer than this without HEADER_END is not one

    def __init__(self, ids: CallIds, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(ids, tools)
        self._state = "content"

    def _header(self, header: str) -> tuple[str, str | None] | None:
        """(function name, the model's own call id or None), or None when the header does not name a call."""
        raise NotImplementedError

    def _step(self, final: bool) -> bool:
        state = self._state
        if state == "content":
            if self._scan_content(final):
                self._state = "section"
                return True
            return False
        if state == "section":
            return self._read_section(final)
        if state == "header":
            return self._read_header(final)
        if state == "args":
            return self._read_args(final)
        return self._read_call_end(final)

    def _read_section(self, final: bool) -> bool:
        # whitespace before a marker in the section is dropped; the buffer is not touched until that is decided,
        # so how the text was split cannot change what is kept
        buf = self._buf
        stripped = buf.lstrip()
        for marker, state in ((self.CALL_BEGIN, "header"), (self.SECTION_END, "content")):
            if stripped.startswith(marker):
                self._buf = stripped[len(marker):]
                self._state = state
                if state == "content":
                    self._in_content = True
                    self._call_ended()
                return True
        if not stripped:
            if final:
                self._buf = ""
                self._to_content()
            return False
        if not final and (self.CALL_BEGIN.startswith(stripped) or self.SECTION_END.startswith(stripped)):
            return False
        # text in the section that is neither a call nor the section's end: content, never lost
        ends = [i for i in (buf.find(self.CALL_BEGIN), buf.find(self.SECTION_END)) if i != -1]
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
        keep = len(buf) - held_suffix_any(buf, (self.CALL_BEGIN, self.SECTION_END))
        keep = len(buf[:keep].rstrip())  # trailing whitespace waits: a marker may follow it
        self._emit_content(buf[:keep])
        self._buf = buf[keep:]
        return False

    def _read_header(self, final: bool) -> bool:
        buf = self._buf
        i = buf.find(self.HEADER_END)
        if i == -1:
            if final or len(buf) - held_suffix(buf, self.HEADER_END) > self.MAX_HEADER:
                self._reject(self.CALL_BEGIN + buf, "")
                return not final
            return False
        named = self._header(buf[:i])
        if named is None:
            self._reject(self.CALL_BEGIN + buf[:i + len(self.HEADER_END)], buf[i + len(self.HEADER_END):])
            return True
        self._begin_call(named[0], call_id=named[1])
        self._buf = buf[i + len(self.HEADER_END):]
        self._state = "args"
        return True

    def _read_args(self, final: bool) -> bool:
        buf = self._buf
        i = buf.find(self.ARGS_END)
        if i == -1:
            held = 0 if final else held_suffix(buf, self.ARGS_END)
            self._emit_arguments(buf[:len(buf) - held])
            self._buf = buf[len(buf) - held:]
            if final:  # cut off: the call keeps the arguments it streamed
                self._to_content()
            return False
        self._emit_arguments(buf[:i])
        self._buf = buf[i + len(self.ARGS_END):]
        self._state = "call_end" if self.CALL_END else "section"
        return True

    def _read_call_end(self, final: bool) -> bool:
        buf = self._buf
        i = buf.find(self.CALL_END)
        if i == -1:
            if final:
                self._emit_content(buf.strip())
                self._buf = ""
                self._to_content()
            return False
        self._emit_content(buf[:i].strip())
        self._buf = buf[i + len(self.CALL_END):]
        self._state = "section"
        return True

    def _reject(self, raw: str, rest: str) -> None:
        """A call that names no function: its text is content, never lost."""
        self._emit_content(raw)
        self._buf = rest
        self._to_content()

    def _to_content(self) -> None:
        self._state = "content"
        self._in_content = True


class DeepSeekV3Parser(SectionParser):
    """`<|tool calls begin|><|tool call begin|>function<|tool sep|>NAME\\n```json\\n{...}\\n```<|tool call end|>
    ...<|tool calls end|>` (markers as _ds writes them)."""

    START = _ds("tool calls begin")
    SECTION_END = _ds("tool calls end")
    CALL_BEGIN = _ds("tool call begin")
    SEP = _ds("tool sep")
    HEADER_END = "```json\n"
    ARGS_END = "\n```"
    CALL_END = _ds("tool call end")

    def _header(self, header: str) -> tuple[str, str | None] | None:
        kind, sep, name = header.partition(self.SEP)
        name = name.strip()
        if not sep or kind.strip() != "function" or not name or any(c in name for c in "<>{}\n"):
            return None
        return name, None


class DeepSeekV31Parser(SectionParser):
    """`<|tool calls begin|><|tool call begin|>NAME<|tool sep|>{...}<|tool call end|>...<|tool calls end|>` (markers
    as _ds writes them)."""

    START = _ds("tool calls begin")
    SECTION_END = _ds("tool calls end")
    CALL_BEGIN = _ds("tool call begin")
    HEADER_END = _ds("tool sep")
    ARGS_END = _ds("tool call end")

    def _header(self, header: str) -> tuple[str, str | None] | None:
        name = header.strip()
        if not name or any(c in name for c in "<>{}\n"):
            return None
        return name, None


_KIMI_ID = re.compile(r"\s*((?:functions\.)?([\w.\-]+):\d+)\s*\Z")


class KimiK2Parser(SectionParser):
    """`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{...}
    <|tool_call_end|>...<|tool_calls_section_end|>`. The call id is the model's own `functions.NAME:N`: Kimi's
    chat template renders it back in the history, and the model counts on that form."""

    START = "<|tool_calls_section_begin|>"
    SECTION_END = "<|tool_calls_section_end|>"
    CALL_BEGIN = "<|tool_call_begin|>"
    HEADER_END = "<|tool_call_argument_begin|>"
    ARGS_END = "<|tool_call_end|>"

    def _header(self, header: str) -> tuple[str, str | None] | None:
        match = _KIMI_ID.match(header)
        if match is None:
            return None
        return match.group(2), match.group(1)
