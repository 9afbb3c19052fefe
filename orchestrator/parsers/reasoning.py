"""Reasoning parsers: split a model's text into reasoning and content before the tool parser sees the content."""

from __future__ import annotations

from orchestrator.parsers.text import held_suffix

ReasoningOutput = tuple[str, str]  # (reasoning, content)


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

    __slots__ = ("_in_reasoning", "_buf")

    def __init__(self, in_reasoning: bool = False) -> None:
        self._in_reasoning = in_reasoning
        self._buf = ""

    @property
    def in_reasoning(self) -> bool:
        return self._in_reasoning

    def feed(self, text: str) -> ReasoningOutput:
        if self._buf:
            text = self._buf + text
            self._buf = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            marker = self.CLOSE if self._in_reasoning else self.OPEN
            side = reasoning if self._in_reasoning else content
            i = text.find(marker)
            if i == -1:
                held = held_suffix(text, marker)
                side.append(text[:len(text) - held])
                self._buf = text[len(text) - held:]
                break
            side.append(text[:i])
            text = text[i + len(marker):]
            self._in_reasoning = not self._in_reasoning
        return "".join(reasoning), "".join(content)

    def finish(self) -> ReasoningOutput:
        held, self._buf = self._buf, ""
        return (held, "") if self._in_reasoning else ("", held)
