"""What a chat prompt asks of the simulated model, read back from its token ids. Pure: no I/O.

The engine sees only token ids, so the sim detokenizes the prompt and reads what the chat template rendered
(ChatML, as orchestrator/models/build_tiny_chat.py writes it; docs/simulator.md is the contract):

- the answer starts after the last `<|im_start|>assistant\\n` that no `<|im_end|>` closes; tokens after it are
  answer tokens already generated (a migrated request resends them), unless they are the empty thinking block
  `<think>\\n\\n</think>\\n\\n` the template closes when `enable_thinking` is false;
- the tools are the JSON objects, one per line, between `<tools>` and `</tools>` in the first (system) turn,
  each `{"type": "function", "function": {name, description, parameters}}`;
- `tool_choice` is the sentence the template adds after them: "Answer without calling a function." (none), "Call
  at least one function." (required) or "Call the function NAME." (a named function); none of them: auto;
- "You may call several functions at once." (`parallel_tool_calls` true) allows more than one call;
- the role and text of the last turn before the answer (`user`, `tool`, ...).

A prompt that is not such a chat (a completion, another template) reads as None: the sim answers it as before.
"""

from __future__ import annotations

import json
import re

import attrs
from tokenizers import Tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ANSWER_HEADER = IM_START + "assistant\n"
THINKING_OFF = "<think>\n\n</think>\n\n"
CHOICE_NONE = "Answer without calling a function."
CHOICE_REQUIRED = "Call at least one function."
PARALLEL_CALLS = "You may call several functions at once."
_CHOICE_NAMED = re.compile(r"Call the function (\S+?)\.(?:\n|$)")
_TOOLS = re.compile(r"<tools>\n(.*?)</tools>", re.DOTALL)
_MAX_HEADER_TOKENS = 32


@attrs.frozen
class ChatPrompt:
    tools: tuple[dict, ...]  # each a function: {name, description?, parameters?}
    tool_choice: str  # auto | none | required | function
    named_function: str | None
    parallel_calls: bool  # the template allowed several calls in one answer (parallel_tool_calls true)
    last_role: str
    last_content: str
    thinking_off: bool  # the template closed an empty thinking block (enable_thinking false)
    prefix_len: int  # prompt tokens before the answer
    answered: int  # answer tokens already in the prompt (a migrated request's)


def read(prompt_ids: list[int], tokenizer: Tokenizer) -> ChatPrompt | None:
    start_id = tokenizer.token_to_id(IM_START)
    if start_id is None or start_id not in prompt_ids:
        return None
    last = len(prompt_ids) - 1 - prompt_ids[::-1].index(start_id)
    tail = tokenizer.decode(prompt_ids[last:], skip_special_tokens=False)
    if not tail.startswith(ANSWER_HEADER) or IM_END in tail:
        return None
    thinking_off = tail[len(ANSWER_HEADER):].startswith(THINKING_OFF)
    header = _token_count(prompt_ids[last:], tokenizer, ANSWER_HEADER + (THINKING_OFF if thinking_off else ""))
    if header is None:
        return None
    turns = _turns(tokenizer.decode(prompt_ids[:last], skip_special_tokens=False))
    tools: tuple[dict, ...] = ()
    choice, named, parallel = "auto", None, False
    if turns and turns[0][0] == "system":
        tools = _tools(turns[0][1])
        if tools:
            system = turns[0][1]
            choice = "none" if CHOICE_NONE in system else "required" if CHOICE_REQUIRED in system else "auto"
            match = _CHOICE_NAMED.search(system)
            if match is not None:
                choice, named = "function", match.group(1)
            parallel = PARALLEL_CALLS in system
    role, content = turns[-1] if turns else ("", "")
    return ChatPrompt(tools=tools, tool_choice=choice, named_function=named, parallel_calls=parallel,
                      last_role=role, last_content=content, thinking_off=thinking_off, prefix_len=last + header,
                      answered=len(prompt_ids) - last - header)


def _token_count(ids: list[int], tokenizer: Tokenizer, text: str) -> int | None:
    """How many of `ids` spell exactly `text` (None: the tokens do not end where the text does)."""
    for count in range(1, min(len(ids), _MAX_HEADER_TOKENS) + 1):
        decoded = tokenizer.decode(ids[:count], skip_special_tokens=False)
        if decoded == text:
            return count
        if len(decoded) > len(text):
            return None
    return None


def _turns(text: str) -> list[tuple[str, str]]:
    turns = []
    for chunk in text.split(IM_START)[1:]:
        role, _, body = chunk.partition("\n")
        turns.append((role, body.split(IM_END, 1)[0]))
    return turns


def _tools(system: str) -> tuple[dict, ...]:
    match = _TOOLS.search(system)
    if match is None:
        return ()
    tools = []
    for line in match.group(1).splitlines():
        try:
            tool = json.loads(line)
        except ValueError:
            continue
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            tools.append(function)
    return tuple(tools)
