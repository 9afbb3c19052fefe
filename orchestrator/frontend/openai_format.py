"""Render OpenAI response objects and SSE chunks. Pure functions over plain values, through one JSON encoder
(ChunkWriter says why a stream's events are spelled out instead)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from json.encoder import encode_basestring

from orchestrator.engine.events import TokenLogprob

DONE = b"data: [DONE]\n\n"


# One encoder for every call: json.dumps with arguments builds a new JSONEncoder each time (0.7 µs for a
# token's text against 0.08 here); the output is the same.
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
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


def chat_logprobs(logprobs: Sequence[TokenLogprob], token_text: Callable[[int], str], top: int) -> dict:
    """`top`: the candidates the client asked for (the engine is always asked for at least one)."""
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
        tops.append({token_text(tid): value for tid, value in lp.top[:top]})
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

    def __init__(self, kind: str, request_id: str, model: str, created: int):
        self.kind = kind
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        # {"id", "object", "created", "model"} as the encoder writes them, then the choices array opened
        self._head = (f'data: {{"id":{_json_string(request_id)},"object":"{obj}","created":{int(created)},'
                      f'"model":{_json_string(model)},"choices":[')
        self._role_sent = kind != "chat"  # only a chat stream's first delta carries the role
        # A streamed token's event, a text delta without logprobs, around its one variable part (its JSON string)
        self._text_head = self._head + ('{"index":0,"delta":{"content":' if kind == "chat" else '{"index":0,"text":')
        self._text_tail = ('}' if kind == "chat" else "") + ',"logprobs":null,"finish_reason":null}]}\n\n'
        self._text_head_bytes, self._text_tail_bytes = self._text_head.encode(), self._text_tail.encode()
        self._between = self._text_tail + self._text_head  # from one token's event to the next one's text

    def delta(self, text: str, logprobs: dict | None = None) -> bytes:
        if self._role_sent and logprobs is None:  # a streamed token, the hot path
            return self._text_head_bytes + _json_string(text).encode() + self._text_tail_bytes
        if self.kind == "chat":
            role = "" if self._role_sent else '"role":"assistant",'
            self._role_sent = True
            choice = '{"index":0,"delta":{' + role + '"content":' + _json_string(text) + "}"
        else:
            choice = '{"index":0,"text":' + _json_string(text)
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

    def finish(self, reason: str) -> bytes:
        if self.kind == "chat":
            choice = '{"index":0,"delta":' + ("{}" if self._role_sent else '{"role":"assistant","content":""}')
        else:
            choice = '{"index":0,"text":""'
        return (self._head + choice + ',"logprobs":null,"finish_reason":' + _json_string(reason)
                + "}]}\n\n").encode()

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> bytes:
        prompt, completion = int(prompt_tokens), int(completion_tokens)
        details = "" if cached_tokens is None else f',"prompt_tokens_details":{{"cached_tokens":{int(cached_tokens)}}}'
        return (f'{self._head}],"usage":{{"prompt_tokens":{prompt},"completion_tokens":{completion},'
                f'"total_tokens":{prompt + completion}{details}}}}}\n\n').encode()


def error_event(body: dict) -> bytes:
    return sse(body)


def full_response(kind: str, request_id: str, model: str, created: int, text: str, reason: str,
                  prompt_tokens: int, completion_tokens: int, logprobs: dict | None,
                  cached_tokens: int | None = None) -> dict:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
