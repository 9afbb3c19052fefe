"""gpt-oss (the harmony format) through `openai-harmony`'s StreamableParser, not by hand.

The model writes messages `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>
...<|return|>`; a tool call is a commentary message addressed `to=functions.NAME` (its JSON arguments end with
`<|call|>`). Mapped as vLLM and TensorRT-LLM map them: analysis -> reasoning, final -> content, commentary without
a recipient (a preamble) -> content, commentary to `functions.NAME` -> a tool call whose arguments are the
message's text as written. A call to any other recipient (a built-in tool such as `browser.search`) is not a
function call: its text goes to reasoning, as the model's own working.

Token ids are the native input (`feed_tokens`); `feed(text)` encodes text with harmony's own encoding, holding
back a trailing partial special token (`<|...`) so a special token split across deltas is encoded whole. Either
way the special tokens must reach the parser: the worker's detokenizer must not skip them.

Loading the encoding reads (or downloads) its vocabulary: that is I/O, done once at start-up by the caller
(`load_encoding`), and handed to each request's parser.
"""

from __future__ import annotations

from typing import Any, Protocol

from orchestrator.parsers.events import EMPTY, CallIds, Delta, ToolCallDelta


class _Streamable(Protocol):
    """What this module uses of openai_harmony.StreamableParser."""

    def process(self, token: int) -> Any: ...

    def process_eos(self) -> Any: ...

    @property
    def current_channel(self) -> str | None: ...

    @property
    def current_recipient(self) -> str | None: ...

    @property
    def last_content_delta(self) -> str | None: ...

    @property
    def messages(self) -> list[Any]: ...


def _harmony() -> Any:
    """openai_harmony, imported when gpt-oss is first parsed (it has no type information for mypy)."""
    import openai_harmony  # type: ignore[import-untyped]

    return openai_harmony


def load_encoding() -> Any:
    """harmony's gpt-oss encoding (I/O: reads the vocabulary from TIKTOKEN_ENCODINGS_BASE or downloads it)."""
    harmony = _harmony()
    return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


def new_streamable(encoding: Any) -> _Streamable:
    harmony = _harmony()
    return harmony.StreamableParser(encoding, harmony.Role.ASSISTANT)


FUNCTIONS = "functions."


class HarmonyParser:
    """One request's gpt-oss parser: a StreamableParser and the calls seen so far."""

    def __init__(self, encoding: Any, ids: CallIds, tool_calls: bool = True,
                 streamable: _Streamable | None = None) -> None:
        self._encoding = encoding
        self._stream = streamable if streamable is not None else new_streamable(encoding)
        self._ids = ids
        self._tool_calls = tool_calls
        self._held = ""  # text that may be the start of a special token
        self._calls = 0
        self._call_message = -1  # the message number of the call being streamed, -1 when none
        self._broken = False  # harmony refused the sequence: the rest is content, never lost

    @property
    def tool_calls_begun(self) -> int:
        return self._calls

    def feed(self, text: str) -> Delta:
        text = self._held + text
        i = text.rfind("<")
        if i != -1 and text.find("|>", i) == -1 and (len(text) - i < 2 or text[i + 1] == "|"):
            self._held, text = text[i:], text[:i]
        else:
            self._held = ""
        if not text:
            return EMPTY
        if self._broken:
            return Delta(text)
        return self.feed_tokens(self._encoding.encode(text, allowed_special="all"), text)

    def feed_tokens(self, tokens: list[int], text: str | None = None) -> Delta:
        """Token ids as the model produced them. `text`: their text, given back as content if harmony refuses
        them (decoded from the ids when not given)."""
        if self._broken:
            return Delta(text if text is not None else self._encoding.decode(tokens))
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCallDelta] = []
        stream = self._stream
        for n, token in enumerate(tokens):
            before = len(stream.messages)
            try:
                stream.process(token)
            except Exception:  # noqa: BLE001 - harmony's HarmonyError or a Rust panic: the text must survive
                self._broken = True
                rest = tokens[n:]
                content.append(self._encoding.decode(rest))
                break
            self._route(stream.last_content_delta or "", before, content, reasoning, calls)
        return Delta("".join(content), "".join(reasoning), tuple(calls))

    def finish(self) -> Delta:
        held, self._held = self._held, ""
        delta = self.feed_tokens(self._encoding.encode(held, allowed_special="all"), held) if held else EMPTY
        if self._broken:
            return delta
        content: list[str] = [delta.content]
        reasoning: list[str] = [delta.reasoning]
        calls: list[ToolCallDelta] = list(delta.tool_calls)
        before = len(self._stream.messages)
        try:
            self._stream.process_eos()
        except Exception:  # noqa: BLE001 - an unfinished message at the end is not an error for the client
            return Delta("".join(content), "".join(reasoning), tuple(calls))
        self._route("", before, content, reasoning, calls)
        return Delta("".join(content), "".join(reasoning), tuple(calls))

    def _route(self, text: str, before: int, content: list[str], reasoning: list[str],
               calls: list[ToolCallDelta]) -> None:
        stream = self._stream
        finished = len(stream.messages) > before
        if finished:
            # a call with no argument text never had a delta to open it: open it from the finished message
            message = stream.messages[-1]
            recipient = getattr(message, "recipient", None) or ""
            if self._is_call(recipient) and self._call_message != before:
                self._open_call(recipient, before, calls)
            self._call_message = -1
            return
        if not text:
            return
        channel = stream.current_channel
        recipient = stream.current_recipient or ""
        message_no = len(stream.messages)
        if self._is_call(recipient):
            if self._call_message != message_no:
                self._open_call(recipient, message_no, calls)
            calls.append(ToolCallDelta(self._calls - 1, None, None, text))
        elif channel == "analysis" or recipient:
            reasoning.append(text)
        else:  # final, a commentary preamble, or a message without a channel
            content.append(text)

    def _is_call(self, recipient: str) -> bool:
        return self._tool_calls and recipient.startswith(FUNCTIONS) and len(recipient) > len(FUNCTIONS)

    def _open_call(self, recipient: str, message_no: int, calls: list[ToolCallDelta]) -> None:
        index = self._calls
        self._calls += 1
        self._call_message = message_no
        calls.append(ToolCallDelta(index, self._ids(index), recipient[len(FUNCTIONS):].split(" ")[0], ""))
