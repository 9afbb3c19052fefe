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
_ROLE_TOKENS = 8  # enough for `<|im_start|>ROLE\n` with any role the template writes


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
    # Only the first turn (where the tools are) and the last one are read: decoding a long prompt whole would
    # cost the simulated engine a millisecond per request.
    first = prompt_ids.index(start_id)
    tools: tuple[dict, ...] = ()
    choice, named, parallel = "auto", None, False
    if first < last and _role(prompt_ids, first, tokenizer) == "system":
        system = _body(prompt_ids[first:_turn_end(prompt_ids, first, last, tokenizer)], tokenizer)
        tools = _tools(system)
        if tools:
            choice = "none" if CHOICE_NONE in system else "required" if CHOICE_REQUIRED in system else "auto"
            match = _CHOICE_NAMED.search(system)
            if match is not None:
                choice, named = "function", match.group(1)
            parallel = PARALLEL_CALLS in system
    role, content = "", ""
    if first < last:
        previous = last - 1 - prompt_ids[last - 1::-1].index(start_id)
        role = _role(prompt_ids, previous, tokenizer)
        if role == "tool":  # its text is quoted in the answer
            content = _body(prompt_ids[previous:last], tokenizer)
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


def _role(ids: list[int], start: int, tokenizer: Tokenizer) -> str:
    """The role of the turn whose <|im_start|> is at `start` (its first line, read from a few tokens)."""
    head = tokenizer.decode(ids[start:start + _ROLE_TOKENS], skip_special_tokens=False).removeprefix(IM_START)
    role, newline, _ = head.partition("\n")
    return role if newline else ""


def _turn_end(ids: list[int], start: int, limit: int, tokenizer: Tokenizer) -> int:
    end_id = tokenizer.token_to_id(IM_END)
    try:
        return ids.index(end_id, start, limit) if end_id is not None else limit
    except ValueError:
        return limit


def _body(ids: list[int], tokenizer: Tokenizer) -> str:
    """A turn's text after its role line, without <|im_end|>."""
    text = tokenizer.decode(ids, skip_special_tokens=False).removeprefix(IM_START)
    return text.partition("\n")[2].split(IM_END, 1)[0]


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
