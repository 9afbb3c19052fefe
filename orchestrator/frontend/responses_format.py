"""Responses API objects and stream events (`POST /v1/responses`). Pure functions over plain values.

An answer's blocks (answer_blocks.py) are its output items: a `reasoning` item (its text as `reasoning_text`
content), a `message` item (one `output_text` part), a `function_call` item per call. A stream is the Responses
event sequence: `response.created`, `response.in_progress`, then per item `response.output_item.added`, its
content part added, its deltas (`response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`), their `.done` events and `response.output_item.done`, and last
`response.completed` (or `response.incomplete` when `max_output_tokens` cut it, `response.failed` on a failure),
each with its `sequence_number`.
"""

from __future__ import annotations

import json
import secrets

from orchestrator.convert.responses import ResponsesRequest
from orchestrator.frontend.answer_blocks import Block, BlockEvent, Closed, Grew, Opened

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _item_id(block: Block, response_id: str) -> str:
    prefix = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}[block.kind]
    return f"{prefix}_{response_id.removeprefix('resp_')}_{block.index}"


def output_item(block: Block, response_id: str, status: str = "completed") -> dict:
    item_id = _item_id(block, response_id)
    if block.kind == "reasoning":
        return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": block.text}] if status == "completed" else []}
    if block.kind == "text":
        return {"type": "message", "id": item_id, "role": "assistant", "status": status,
                "content": [_text_part(block.text)] if status == "completed" else []}
    return {"type": "function_call", "id": item_id, "call_id": block.call_id, "name": block.name,
            "arguments": block.text if status == "completed" else "", "status": status}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None, reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens or 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + completion_tokens}


def response_object(request: ResponsesRequest, response_id: str, created_at: int, *, status: str,
                    output: list[dict], usage_body: dict | None = None, error: dict | None = None,
                    incomplete_reason: str | None = None) -> dict:
    """The Response object, echoing the request's settings as OpenAI does."""
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "model": request.api.model, "output": output, "error": error,
        "incomplete_details": None if incomplete_reason is None else {"reason": incomplete_reason},
        "instructions": request.instructions, "metadata": json.loads(request.metadata or "{}"),
        "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": request.reasoning_effort, "summary": None},
        "store": request.store, "temperature": request.temperature, "top_p": request.top_p,
        "max_output_tokens": request.max_output_tokens, "text": {"format": json.loads(request.text_format)},
        "tool_choice": json.loads(request.tool_choice), "tools": json.loads(request.tools),
        "truncation": "disabled", "usage": usage_body,
    }


def finish_status(reason: str) -> tuple[str, str | None]:
    """(status, incomplete reason) of an answer that finished with `reason`."""
    if reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


class EventWriter:
    """The events of one streamed response, numbered in order."""

    def __init__(self, request: ResponsesRequest, response_id: str, created_at: int) -> None:
        self.request, self.response_id, self.created_at = request, response_id, created_at
        self._sequence = 0
        self.started = False  # `response.created` and `response.in_progress` lead the first events written

    def _event(self, kind: str, body: dict) -> bytes:
        body = {"type": kind, "sequence_number": self._sequence, **body}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _dumps(body).encode() + b"\n\n"

    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        response = response_object(self.request, self.response_id, self.created_at, status="in_progress", output=[])
        return [self._event("response.created", {"response": response}),
                self._event("response.in_progress", {"response": response})]

    def blocks(self, events: list[BlockEvent]) -> bytes:
        out = self._start()
        for event in events:
            block = event.block
            item_id = _item_id(block, self.response_id)
            where = {"item_id": item_id, "output_index": block.index}
            if isinstance(event, Opened):
                out.append(self._event("response.output_item.added", {
                    "output_index": block.index, "item": output_item(block, self.response_id, "in_progress")}))
                if block.kind == "text":
                    out.append(self._event("response.content_part.added",
                                           {**where, "content_index": 0, "part": _text_part("")}))
                elif block.kind == "reasoning":
                    out.append(self._event("response.content_part.added", {
                        **where, "content_index": 0, "part": {"type": "reasoning_text", "text": ""}}))
            elif isinstance(event, Grew):
                if block.kind == "text":
                    out.append(self._event("response.output_text.delta",
                                           {**where, "content_index": 0, "delta": event.text, "logprobs": []}))
                elif block.kind == "reasoning":
                    out.append(self._event("response.reasoning_text.delta",
                                           {**where, "content_index": 0, "delta": event.text}))
                else:
                    out.append(self._event("response.function_call_arguments.delta", {**where, "delta": event.text}))
            elif isinstance(event, Closed):
                if block.kind == "text":
                    out.append(self._event("response.output_text.done",
                                           {**where, "content_index": 0, "text": block.text, "logprobs": []}))
                    out.append(self._event("response.content_part.done",
                                           {**where, "content_index": 0, "part": _text_part(block.text)}))
                elif block.kind == "reasoning":
                    out.append(self._event("response.reasoning_text.done",
                                           {**where, "content_index": 0, "text": block.text}))
                    out.append(self._event("response.content_part.done", {
                        **where, "content_index": 0, "part": {"type": "reasoning_text", "text": block.text}}))
                else:
                    out.append(self._event("response.function_call_arguments.done",
                                           {**where, "arguments": block.text, "name": block.name}))
                out.append(self._event("response.output_item.done",
                                       {"output_index": block.index, "item": output_item(block, self.response_id)}))
        return b"".join(out)

    def finish(self, response: dict) -> bytes:
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return b"".join(self._start()) + self._event(kind, {"response": response})

    def failed(self, response: dict) -> bytes:
        return b"".join(self._start()) + self._event("response.failed", {"response": response})
