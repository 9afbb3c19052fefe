"""Render OpenAI response objects and SSE chunks. Pure functions over plain values.

Chunks are assembled from pre-serialised fragments: the per-request constant part is JSON-encoded
once, so a streamed token costs one JSON encoding of its text.
"""

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
    """SSE chunks for one streamed response (chat or completion)."""

    def __init__(self, kind: str, request_id: str, model: str, created: int):
        self.kind = kind
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        # _dumps of {"id", "object", "created", "model"} without its closing brace, spelled out (a dict
        # through the encoder costs several times its two strings)
        self._head = (f'data: {{"id":{_json_string(request_id)},"object":"{obj}","created":{int(created)},'
                      f'"model":{_json_string(model)},"choices":[{{"index":0,')
        self._role_sent = kind != "chat"  # only a chat stream's first delta carries the role
        # The usual event, a text delta without logprobs, around its one variable part (the JSON string).
        if kind == "chat":
            self._text_head = self._head + '"delta":{"content":'
            self._text_tail = '},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._text_head = self._head + '"text":'
            self._text_tail = ',"logprobs":null,"finish_reason":null}]}\n\n'
        # encoded once: one event is then two bytes joins around its JSON string (half the cost of encoding it all)
        self._text_head_bytes, self._text_tail_bytes = self._text_head.encode(), self._text_tail.encode()
        self._between = self._text_tail + self._text_head

    def delta(self, text: str, logprobs: dict | None = None) -> bytes:
        if self._role_sent and logprobs is None:
            return self._text_head_bytes + _json_string(text).encode() + self._text_tail_bytes
        if self.kind == "chat":
            if not self._role_sent:
                self._role_sent = True
                body = '"delta":{"role":"assistant","content":' + _dumps(text) + "}"
            else:
                body = '"delta":{"content":' + _dumps(text) + "}"
        else:
            body = '"text":' + _dumps(text)
        lp = "null" if logprobs is None else _dumps(logprobs)
        return (self._head + body + ',"logprobs":' + lp + ',"finish_reason":null}]}\n\n').encode()

    def deltas(self, texts: Sequence[str]) -> bytes:
        """One event per text, without logprobs, as one buffer (what `delta` gives for each, joined)."""
        first = b""
        if not self._role_sent:
            first, texts = self.delta(texts[0]), texts[1:]
            if not texts:
                return first
        if len(texts) == 1:
            return first + self.delta(texts[0])
        return first + (self._text_head + self._between.join(map(_json_string, texts)) + self._text_tail).encode()

    def finish(self, reason: str) -> bytes:
        body = ('"delta":{}' if self._role_sent else '"delta":{"role":"assistant","content":""}') \
            if self.kind == "chat" else '"text":""'
        return (self._head + body + ',"logprobs":null,"finish_reason":' + _json_string(reason) + "}]}\n\n").encode()

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> bytes:
        head = self._head[: -len('{"index":0,')]
        prompt, completion = int(prompt_tokens), int(completion_tokens)  # usage(), spelled out
        details = "" if cached_tokens is None else f',"prompt_tokens_details":{{"cached_tokens":{int(cached_tokens)}}}'
        return (f'{head}],"usage":{{"prompt_tokens":{prompt},"completion_tokens":{completion},'
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
