"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: the Anthropic Messages API over the chat path.

A thin adapter, as the Responses API's (responses_api.py): the body becomes the internal chat request
(convert/messages.py), run as any chat request (the route `messages` in the metrics); its answer comes back as
content blocks (messages_format.py), and every failure in Anthropic's error shape.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from orchestrator.convert.media import MediaLimits
from orchestrator.convert.messages import parse_messages
from orchestrator.frontend import messages_format as mfmt
from orchestrator.frontend.block_sink import BlockSink
from orchestrator.parsers import StreamParser

PATH = "/v1/messages"


class MessagesExchange:
    route = "messages"

    def __init__(self, body, request_id: str, limits: MediaLimits) -> None:
        self.api = parse_messages(body, limits)
        self.message_id = f"msg_{request_id.removeprefix('req-')}"
        self.sink: BlockSink | None = None
        self.writer: mfmt.EventWriter | None = None

    @staticmethod
    def adapt(response) -> None:
        """Failures in Anthropic's shape: an error body, or once the stream started an `error` event; a stream
        ends with `message_stop`, not `[DONE]`."""
        response.error_body = mfmt.error_body
        response.stream_failure = mfmt.error_event
        response.end_marker = b""

    def make_sink(self, parser: StreamParser | None, send: Callable[[bytes], Awaitable[None]],
                  prompt_tokens: int) -> BlockSink:
        writer = self.writer = mfmt.EventWriter(self.message_id, self.api.model, prompt_tokens)
        self.sink = BlockSink(parser, writer if self.api.stream else None, send if self.api.stream else None)
        return self.sink

    def _stop_and_usage(self) -> tuple[str, str | None, dict]:
        """The stop reason, the stop sequence it names (one of the request's `stop_sequences`), the usage."""
        sink = self.sink
        if sink is None:
            raise RuntimeError("the answer has no sink yet")
        usage = mfmt.usage(sink.prompt_tokens, sink.completion_tokens, sink.cached_tokens)
        if sink.reason == "stop" and sink.stop_text is not None and sink.stop_text in self.api.stop:
            return "stop_sequence", sink.stop_text, usage
        return mfmt.STOP_REASONS.get(sink.reason, "end_turn"), None, usage

    def response(self) -> dict:
        stop_reason, stop_sequence, usage = self._stop_and_usage()
        blocks = self.sink.answer.blocks if self.sink is not None else []
        return mfmt.message(self.message_id, self.api.model, blocks, stop_reason, usage, stop_sequence)

    def finish_event(self, answer: dict) -> bytes:
        writer = self.writer
        if writer is None:
            raise RuntimeError("the answer has no writer yet")
        stop_reason, stop_sequence, usage = self._stop_and_usage()
        return writer.finish(stop_reason, usage, stop_sequence)

    async def keep(self, store, answer: dict) -> None:
        """(Messages are not stored.)"""
