"""Reasoning parsers: split a model's text into reasoning and content before the tool parser sees the content."""

from __future__ import annotations

from orchestrator.parsers.events import EMPTY, Delta, new_delta
from orchestrator.parsers.text import held_suffix


class ThinkReasoning:
    """`<think>reasoning</think>content` (DeepSeek-R1, Qwen3, and the models that copy them).

    `in_reasoning` says where the answer starts: True when the prompt already ends with the opening tag (DeepSeek-R1's
    template, Qwen3 "Thinking" models), so the output begins inside the reasoning. The caller decides it from the
    chat template and the request, never from re-rendering the prompt on another worker. A `<think>` met in the
    content opens reasoning again; a partial tag at a delta's end waits for the next delta, and `finish` gives it
    back to the side it was held on.
    """

    OPEN = "<think>"
    CLOSE = "</think>"

    __slots__ = ("in_reasoning", "held", "_implicit_close")

    def __init__(self, in_reasoning: bool = False, implicit_close: str = "") -> None:
        self.in_reasoning = in_reasoning  # read by ChatParser's hot path; written only here
        self.held = ""  # a partial tag waiting for the next delta
        # a marker that ends the reasoning too and stays in the content, for models that open a tool section
        # without closing their thinking (Kimi K2, Nemotron v3); like the tags, it starts with "<"
        if implicit_close and not implicit_close.startswith("<"):
            raise ValueError(f"an implicit close must start with '<' (ChatParser's hot path relies on it): "
                             f"{implicit_close!r}")
        self._implicit_close = implicit_close

    def feed(self, text: str) -> Delta:
        if self.held:
            text = self.held + text
            self.held = ""
        elif "<" not in text:  # the hot path: neither tag nor the start of one in this delta, none pending
            if not text:
                return EMPTY
            return new_delta(Delta, ("", text, ()) if self.in_reasoning else (text, "", ()))
        reasoning: list[str] = []
        content: list[str] = []
        implicit = self._implicit_close
        while text:
            marker = self.CLOSE if self.in_reasoning else self.OPEN
            side = reasoning if self.in_reasoning else content
            i = text.find(marker)
            skip = len(marker)
            if self.in_reasoning and implicit:
                j = text.find(implicit)
                if j != -1 and (i == -1 or j < i):
                    i, skip = j, 0  # the tool section ends the reasoning and goes on as content
            if i == -1:
                held = held_suffix(text, marker)
                if self.in_reasoning and implicit:
                    held = max(held, held_suffix(text, implicit))
                side.append(text[:len(text) - held])
                self.held = text[len(text) - held:]
                break
            side.append(text[:i])
            text = text[i + skip:]
            self.in_reasoning = not self.in_reasoning
        return Delta("".join(content), "".join(reasoning))

    def finish(self) -> Delta:
        held, self.held = self.held, ""
        if not held:
            return EMPTY
        return Delta("", held) if self.in_reasoning else Delta(held)

    @property
    def tool_calls_begun(self) -> int:
        return 0
