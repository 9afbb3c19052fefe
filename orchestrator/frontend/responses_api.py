"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: the Responses API over the chat path.

A thin adapter: the body becomes the internal chat request (convert/responses.py), which is planned, routed and
run as any chat request (app.py: the same admission, limits, legs, migration, metrics under the route
`responses`, tracing); its answer comes back as output items (responses_format.py). A stored response keeps the
conversation it ends, so `previous_response_id` puts that conversation before the new input: the prompt then
shares its prefix with the one before, and KV-aware routing sends it where that prefix is cached.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable

from orchestrator.convert.media import MediaLimits
from orchestrator.convert.responses import ResponsesRequest, parse_responses, previous_response_id
from orchestrator.frontend import responses_format as rfmt
from orchestrator.frontend.answer_blocks import Block
from orchestrator.frontend.block_sink import BlockSink
from orchestrator.frontend.errors import ApiError
from orchestrator.frontend.response_store import ResponseStore, StoredResponse
from orchestrator.parsers import StreamParser
from orchestrator.tokenizer import ModelTokenizer

RESPONSE_PATH = "/v1/responses/"  # GET and DELETE /v1/responses/{id}


def not_found(response_id: str, param: str | None = "previous_response_id") -> ApiError:
    return ApiError(404, f"no stored response has the id {response_id!r} (never stored, deleted, or expired)",
                    param=param, code="response_not_found")


class ResponsesExchange:
    """One Responses request from its parsed body to its answer (and its record in the store)."""

    route = "responses"

    def __init__(self, request: ResponsesRequest, history: list[dict], request_id: str,
                 count_tokens: Callable[[str], int]) -> None:
        self.request, self.history, self.count_tokens = request, history, count_tokens
        self.api = request.api
        self.response_id = f"resp_{request_id.removeprefix('req-')}"
        self.created_at = int(time.time())
        self.writer = rfmt.EventWriter(request, self.response_id, self.created_at)
        self.sink: BlockSink | None = None

    @classmethod
    async def parse(cls, body, store: ResponseStore, request_id: str, limits: MediaLimits,
                    tokenizer: ModelTokenizer) -> ResponsesExchange:
        previous = previous_response_id(body)
        history: list[dict] = []
        if previous is not None:
            record = await store.get(previous)
            if record is None:
                raise not_found(previous)
            history = json.loads(record.conversation)
        return cls(parse_responses(body, history, limits), history, request_id,
                   lambda text: len(tokenizer.encode(text)))

    def adapt(self, response) -> None:
        """The request's response writes failures as the Responses API does: an OpenAI error body before the
        stream has started, a `response.failed` event once it has; a stream ends without `[DONE]`."""
        response.stream_failure = self.failed_event
        response.end_marker = b""

    def make_sink(self, parser: StreamParser | None, send: Callable[[bytes], Awaitable[None]],
                  prompt_tokens: int) -> BlockSink:
        self.sink = BlockSink(parser, self.writer if self.api.stream else None, send if self.api.stream else None)
        return self.sink

    def finish_event(self, answer: dict) -> bytes:
        return self.writer.finish(answer)

    def response(self, status: str | None = None, error: dict | None = None) -> dict:
        sink = self.sink
        if sink is None or error is not None:
            return rfmt.response_object(self.request, self.response_id, self.created_at, status=status or "failed",
                                        output=[], error=error)
        status, incomplete = rfmt.finish_status(sink.reason)
        reasoning = "".join(b.text for b in sink.answer.blocks if b.kind == "reasoning")
        usage = rfmt.usage(sink.prompt_tokens, sink.completion_tokens, sink.cached_tokens,
                           reasoning_tokens=min(self.count_tokens(reasoning), sink.completion_tokens)
                           if reasoning else 0)
        return rfmt.response_object(self.request, self.response_id, self.created_at, status=status,
                                    output=[rfmt.output_item(b, self.response_id) for b in sink.answer.blocks],
                                    usage_body=usage, incomplete_reason=incomplete)

    def failed_event(self, error: ApiError) -> bytes:
        return self.writer.failed(self.response(error={"code": error.code or error.type, "message": error.message}))

    async def keep(self, store: ResponseStore, response: dict) -> None:
        """Store the response (unless `store: false`) with the conversation it ends."""
        if not self.request.store or self.sink is None:
            return
        conversation = self.history + [json.loads(item) for item in self.request.input_items] + \
            [_as_input_item(block) for block in self.sink.answer.blocks]
        await store.put(StoredResponse(self.response_id, time.time(), json.dumps(response, ensure_ascii=False),
                                       json.dumps(conversation, ensure_ascii=False)))


def _as_input_item(block: Block) -> dict:
    """An output block as the input item a continuation sends back for it."""
    if block.kind == "reasoning":
        return {"type": "reasoning", "text": block.text}
    if block.kind == "text":
        return {"type": "message", "role": "assistant", "content": block.text}
    return {"type": "function_call", "call_id": block.call_id, "name": block.name, "arguments": block.text}
