"""Render OpenAI response objects and SSE chunks. Pure functions over plain values, through one JSON encoder
(ChunkWriter says why a stream's events are spelled out instead)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from json.encoder import encode_basestring

from orchestrator.engine.events import TokenLogprob
from orchestrator.parsers import Delta, Message, ToolCallDelta

DONE = b"data: [DONE]\n\n"


# One encoder for every call: json.dumps with arguments builds a new JSONEncoder each time (0.7 µs for a
# token's text against 0.08 here); the output is the same. NaN and infinities are refused (ValueError): JSON
# has no such numbers, and a client's parser fails on the whole event (engine/events.py clamps logprobs).
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode
_json_string = encode_basestring  # what _dumps does with a str, without its checks


def sse(payload: dict) -> bytes:
    return b"data: " + _dumps(payload).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """`cached_tokens`: prompt tokens the engine found in its KV cache; left out when it did not say."""
    body: dict = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def unknown_logprobs(token_ids: Sequence[int]) -> tuple[TokenLogprob, ...]:
    """Placeholders for tokens the engine sent without logprobs though they were asked for: each token keeps
    an entry (its logprob null) instead of taking a neighbour's, or going missing from the list."""
    return tuple(TokenLogprob(token, None) for token in token_ids)


def chat_logprobs(logprobs: Sequence[TokenLogprob], token_text: Callable[[int], str], top: int) -> dict:
    """`top`: the candidates the client asked for (the engine is always asked for at least one). A token the
    engine gave no logprob for has `logprob` null (and no candidates)."""
    content = []
    for lp in logprobs:
        text = token_text(lp.token_id)
        content.append({
            "token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := token_text(tid)), "logprob": value, "bytes": list(t.encode())}
                             for tid, value in lp.top[:top]],
        })
    return {"content": content}


def completion_logprobs(logprobs: Sequence[TokenLogprob], token_text: Callable[[int], str], offset: int,
                        top: int) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for lp in logprobs:
        text = token_text(lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append(None if lp.logprob is None else {token_text(tid): value for tid, value in lp.top[:top]})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


class ChunkWriter:
    """SSE chunks for one streamed response (chat or completion).

    The events of a stream differ from each other only in a few values, so they are spelled out as text
    around the request's head (id, object, created, model), JSON-encoded once when the stream starts, instead
    of built as dicts for the encoder: through the encoder, a one-token request's events (role, finish, usage)
    and a token's event cost several times more (benchmarks/instruction_cost.py; docs/benchmarks.md). Only a
    delta with logprobs goes through the encoder. tests/unit/test_openai_format.py holds every event to what
    the encoder gives for the same values.
    """

    def __init__(self, kind: str, request_id: str, model: str, created: int, index: int = 0):
        """`index`: the choice these events are of (a request with `n` > 1 has a writer per choice)."""
        self.kind = kind
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        # {"id", "object", "created", "model"} as the encoder writes them, then the choices array opened
        self._head = (f'data: {{"id":{_json_string(request_id)},"object":"{obj}","created":{int(created)},'
                      f'"model":{_json_string(model)},"choices":[')
        self._role_sent = kind != "chat"  # only a chat stream's first delta carries the role
        # A streamed token's event, a text delta without logprobs, around its one variable part (its JSON string)
        self._choice = f'{{"index":{int(index)},'  # each event's one choice opens with its index
        self._text_head = self._head + self._choice + ('"delta":{"content":' if kind == "chat" else '"text":')
        self._text_tail = ('}' if kind == "chat" else "") + ',"logprobs":null,"finish_reason":null}]}\n\n'
        self._text_head_bytes, self._text_tail_bytes = self._text_head.encode(), self._text_tail.encode()
        self._between = self._text_tail + self._text_head  # from one token's event to the next one's text

    def delta(self, text: str, logprobs: dict | None = None) -> bytes:
        if self._role_sent and logprobs is None:  # a streamed token, the hot path
            return self._text_head_bytes + _json_string(text).encode() + self._text_tail_bytes
        if self.kind == "chat":
            role = "" if self._role_sent else '"role":"assistant",'
            self._role_sent = True
            choice = self._choice + '"delta":{' + role + '"content":' + _json_string(text) + "}"
        else:
            choice = self._choice + '"text":' + _json_string(text)
        lp = "null" if logprobs is None else _dumps(logprobs)
        return (self._head + choice + ',"logprobs":' + lp + ',"finish_reason":null}]}\n\n').encode()

    def deltas(self, texts: Sequence[str]) -> bytes:
        """One event per text, without logprobs, as one buffer (written together: they arrived together)."""
        if not texts:
            return b""
        if not self._role_sent:  # the first carries the role
            first = self.delta(texts[0])
            return first + self.deltas(texts[1:]) if len(texts) > 1 else first
        return (self._text_head + self._between.join(map(_json_string, texts)) + self._text_tail).encode()

    def reasoning(self, text: str) -> bytes:
        """A chat delta of the model's reasoning (`reasoning_content`, as vLLM and DeepSeek name it)."""
        role = "" if self._role_sent else '"role":"assistant",'
        self._role_sent = True
        return (self._head + self._choice + '"delta":{' + role + '"reasoning_content":' + _json_string(text)
                + '},"logprobs":null,"finish_reason":null}]}\n\n').encode()

    def tool_calls(self, calls: Sequence[ToolCallDelta]) -> bytes:
        """A chat delta of tool-call pieces, as OpenAI streams them: a call's first piece carries its index, id,
        type and name (its arguments may start there), later pieces the index and more argument text."""
        role = "" if self._role_sent else '"role":"assistant",'
        self._role_sent = True
        pieces = []
        for call in calls:
            if call.name is not None:
                piece: dict = {"index": call.index, "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}}
            else:
                piece = {"index": call.index, "function": {"arguments": call.arguments}}
            pieces.append(piece)
        return (self._head + self._choice + '"delta":{' + role + '"tool_calls":' + _dumps(pieces)
                + '},"logprobs":null,"finish_reason":null}]}\n\n').encode()

    def parsed(self, delta: Delta, logprobs: dict | None = None) -> bytes:
        """A parser's delta as events in the order the model wrote them: reasoning, then content, then tool
        calls. `logprobs` ride on the content event (an event of its own when the delta has no content)."""
        data = b""
        if delta.reasoning:
            data += self.reasoning(delta.reasoning)
        if delta.content or logprobs is not None:
            data += self.delta(delta.content, logprobs)
        if delta.tool_calls:
            data += self.tool_calls(delta.tool_calls)
        return data

    def finish(self, reason: str) -> bytes:
        if self.kind == "chat":
            choice = self._choice + '"delta":' + ("{}" if self._role_sent else '{"role":"assistant","content":""}')
        else:
            choice = self._choice + '"text":""'
        return (self._head + choice + ',"logprobs":null,"finish_reason":' + _json_string(reason)
                + "}]}\n\n").encode()

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> bytes:
        prompt, completion = int(prompt_tokens), int(completion_tokens)
        details = "" if cached_tokens is None else f',"prompt_tokens_details":{{"cached_tokens":{int(cached_tokens)}}}'
        return (f'{self._head}],"usage":{{"prompt_tokens":{prompt},"completion_tokens":{completion},'
                f'"total_tokens":{prompt + completion}{details}}}}}\n\n').encode()


def error_event(body: dict) -> bytes:
    return sse(body)


def chat_message(message: Message) -> dict:
    """A parsed answer as OpenAI's `message`: `content` null when the answer is only tool calls (as OpenAI
    answers), `reasoning_content` and `tool_calls` only when there are some."""
    body: dict = {"role": "assistant",
                  "content": message.content if message.content or not message.tool_calls else None}
    if message.reasoning_content:
        body["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        body["tool_calls"] = [{"id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}}
                              for call in message.tool_calls]
    return body


def choice(kind: str, index: int, text: str | Message, reason: str, logprobs: dict | None) -> dict:
    """One choice of a whole answer. `text`: the answer, or for a chat answer read by an output parser, its parsed
    message."""
    if kind == "chat":
        message = (chat_message(text) if isinstance(text, Message)
                   else {"role": "assistant", "content": text})
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def full_response(kind: str, request_id: str, model: str, created: int, choices: list[dict],
                  prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """A whole answer: its choices (`choice`), and the usage of all of them (the prompt counted once)."""
    return {"id": request_id, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
