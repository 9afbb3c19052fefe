"""Render OpenAI response objects and SSE chunks. Pure functions over plain values, through one JSON encoder
(ChunkWriter says where a streamed token's event skips it, and why)."""

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
_MARKER = "\x00text\x00"  # where a token's text goes in the template (any str would do: see ChunkWriter)


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

    Every chunk is a dict through the JSON encoder, except the one a streamed token costs: a text delta
    without logprobs. That one is the same event rendered once, at the start, around a marker, and split
    there: a token's event is then the two fragments around its JSON-encoded text. The encoder would cost
    ~20x more per token, a quarter of serve's CPU per streamed token (docs/benchmarks.md).
    """

    def __init__(self, kind: str, request_id: str, model: str, created: int):
        self.kind = kind
        self._head = {"id": request_id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                      "created": int(created), "model": model}
        self._role_sent = kind != "chat"  # only a chat stream's first delta carries the role
        # The usual event around its one variable part. The text comes after the head (id, model), so the
        # marker's last occurrence is the text's, whatever the head holds.
        marker = _json_string(_MARKER).encode()
        template = self._event(self._text_choice(_MARKER, None))
        self._text_head, found, self._text_tail = template.rpartition(marker)
        if not found:
            raise RuntimeError("the SSE text template lost its marker")

    def _text_choice(self, text: str, logprobs: dict | None) -> dict:
        if self.kind == "chat":
            return {"index": 0, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None}

    def _event(self, choice: dict) -> bytes:
        return sse({**self._head, "choices": [choice]})

    def delta(self, text: str, logprobs: dict | None = None) -> bytes:
        if self._role_sent and logprobs is None:  # a streamed token, the hot path: see the class docstring
            return self._text_head + _json_string(text).encode() + self._text_tail
        choice = self._text_choice(text, logprobs)
        if not self._role_sent:
            choice["delta"] = {"role": "assistant", "content": text}
            self._role_sent = True
        return self._event(choice)

    def deltas(self, texts: Sequence[str]) -> bytes:
        """One event per text, without logprobs, as one buffer (written together: they arrived together)."""
        return b"".join([self.delta(text) for text in texts])

    def finish(self, reason: str) -> bytes:
        if self.kind == "chat":
            delta = {} if self._role_sent else {"role": "assistant", "content": ""}
            return self._event({"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason})
        return self._event({"index": 0, "text": "", "logprobs": None, "finish_reason": reason})

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> bytes:
        return sse({**self._head, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)})


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
