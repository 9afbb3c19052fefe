"""Anthropic Messages API objects, stream events and errors (`POST /v1/messages`). Pure functions.

An answer's blocks (answer_blocks.py) are its content blocks: `thinking`, `text`, `tool_use` (its arguments
parsed into `input`). A stream is Anthropic's event sequence: `message_start`, a `ping`, per block
`content_block_start`, its deltas (`thinking_delta`, `text_delta`, `input_json_delta`) and
`content_block_stop`, then `message_delta` with the `stop_reason` and the usage, and `message_stop`; a failure
is an `error` event. Errors are Anthropic's shape, `{"type": "error", "error": {"type": ..., "message": ...}}`.
"""

from __future__ import annotations

import json

from orchestrator.frontend.answer_blocks import Block, BlockEvent, Closed, Grew, Opened
from orchestrator.frontend.errors import ApiError

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def error_body(error: ApiError) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status, "api_error"), "message": error.message}}


def event(kind: str, body: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _dumps({"type": kind, **body}).encode() + b"\n\n"


def error_event(error: ApiError) -> bytes:
    return event("error", {"error": error_body(error)["error"]})


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
    """Anthropic counts cache reads apart: input_tokens are the prompt tokens the cache did not hold."""
    cached = cached_tokens or 0
    return {"input_tokens": max(0, prompt_tokens - cached), "output_tokens": completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def content_block(block: Block, *, whole: bool = True) -> dict:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text if whole else "", "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text if whole else ""}
    return {"type": "tool_use", "id": block.call_id, "name": block.name,
            "input": tool_input(block.text) if whole else {}}


def tool_input(arguments: str) -> dict:
    """A call's arguments as the object `input` must be; arguments that are not a JSON object are kept whole
    under one key rather than lost."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def message(message_id: str, model: str, blocks: list[Block], stop_reason: str | None, usage_body: dict,
            stop_sequence: str | None = None) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [content_block(b) for b in blocks], "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage_body}


class EventWriter:
    def __init__(self, message_id: str, model: str, prompt_tokens: int) -> None:
        self.message_id, self.model, self.prompt_tokens = message_id, model, prompt_tokens
        self.started = False  # `message_start` and a `ping` lead the first events written

    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        start = message(self.message_id, self.model, [], None, usage(self.prompt_tokens, 0, None))
        return [event("message_start", {"message": start}), event("ping", {})]

    def blocks(self, events: list[BlockEvent]) -> bytes:
        out = self._start()
        for item in events:
            block = item.block
            if isinstance(item, Opened):
                out.append(event("content_block_start",
                                 {"index": block.index, "content_block": content_block(block, whole=False)}))
            elif isinstance(item, Grew):
                delta = ({"type": "thinking_delta", "thinking": item.text} if block.kind == "reasoning" else
                         {"type": "text_delta", "text": item.text} if block.kind == "text" else
                         {"type": "input_json_delta", "partial_json": item.text})
                out.append(event("content_block_delta", {"index": block.index, "delta": delta}))
            elif isinstance(item, Closed):
                if block.kind == "reasoning":  # (no signature: the reasoning is the model's own text)
                    signature = {"type": "signature_delta", "signature": ""}
                    out.append(event("content_block_delta", {"index": block.index, "delta": signature}))
                out.append(event("content_block_stop", {"index": block.index}))
        return b"".join(out)

    def finish(self, stop_reason: str, usage_body: dict, stop_sequence: str | None = None) -> bytes:
        delta = {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": usage_body}
        return b"".join(self._start()) + event("message_delta", delta) + event("message_stop", {})
