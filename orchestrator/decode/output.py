"""The decode stage's output side: engine events -> text deltas for the client.

`stream_output` reads a generation stream batch by batch (every event that has arrived),
detokenizes incrementally, honours stop strings, and reports the terminal event. A sink whose
`per_token` is true gets one delta per token (the default for SSE streams); otherwise a batch is
one delta (coalesced under load). It never decides about workers; the decode stage does.
`finish_answer` is the one way an answer's end goes to the sink, whoever ends it (the stage, or the request
flow for an answer that ended without a decode leg's finish).
The sink and the stream state are in deltas.py, direct delivery in direct.py.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from orchestrator.decode.deltas import OutputSink, StreamState, add_tokens, count_tokens, fill_carried, token_deltas
from orchestrator.decode.direct import FLUSH, DirectHandler, DirectTokens, TokenStream
from orchestrator.engine import EngineError, Failed, Finished, PrefillReady, Tokens
from orchestrator.engine.errors import ErrorCode, engine_cancelled
from orchestrator.engine.events import Event, FinishReason, TokenLogprob
from orchestrator.tokenizer import IncrementalDetokenizer


async def stream_output(stream: TokenStream, sink: OutputSink, detokenizer: IncrementalDetokenizer,
                        state: StreamState, *, worker: str, on_chunk: Callable[[int], None] | None = None) -> None:
    """Read until the engine finishes or a stop string matches; raises the engine's error.

    Once the first tokens of this stream went out, later token events are delivered directly where the
    stream and the sink allow it (decode/direct.py; its delivery ends when this returns or is cancelled)."""
    direct = None
    may_arm = True  # after this stream's first tokens went out, once
    try:
        while not state.terminal:
            batch = await stream.next_batch()
            if not batch:
                raise EngineError("the generation stream ended without a finished event", worker=worker,
                                  rpc="Generate", code=ErrorCode.ERROR_CODE_INTERNAL)
            ids: list[int] = []
            logprobs: list[TokenLogprob] = []
            flush = False
            cancelled: Finished | None = None
            for event in batch:
                if isinstance(event, Tokens):
                    if event.logprobs or logprobs:
                        add_tokens(event, ids, logprobs)
                    else:  # no logprobs at all: the common case, without the call
                        ids.extend(event.token_ids)
                elif isinstance(event, Finished) and event.reason == FinishReason.FINISH_REASON_CANCELLED:
                    cancelled = event  # the engine's own cancel (we never read the stream of ours): a failure
                    break
                elif isinstance(event, Finished):
                    state.finished = event
                    if event.usage is not None:
                        state.prompt_tokens = event.usage.prompt_tokens
                        state.cached_tokens = event.usage.cached_prompt_tokens
                    break
                elif isinstance(event, Failed):
                    raise event.error
                elif isinstance(event, PrefillReady):
                    raise EngineError("a generation leg answered with prefill_ready", worker=worker, rpc="Generate")
                elif event is FLUSH:
                    flush = True
            if state.finished is not None:
                sink.ending()  # one write for the last tokens, the finish and [DONE] (max_tokens 1: the only one)
            if ids:
                if state.first_token_at is None:
                    state.first_token_at = trio.current_time()
                if state.carried_logprobs:
                    logprobs = fill_carried(ids, logprobs, state)
                count_tokens(ids, state, on_chunk)
                items = token_deltas(ids, logprobs, sink.per_token, detokenizer)
                if len(items) == 1:
                    await sink.delta(*items[0])
                elif items:  # several: only a per-token sink gets them (token_deltas)
                    await sink.deltas(items)
                if detokenizer.stopped_on is not None:
                    state.stopped_on = detokenizer.stopped_on
                elif may_arm and state.finished is None:  # (not for a stream that is over already)
                    may_arm = False
                    direct = DirectTokens.arm(stream, sink, detokenizer, state, on_chunk)
            if cancelled is not None:  # after the tokens that came before it: the client has them
                raise engine_cancelled(cancelled.message, worker=worker)
            if flush:
                # FLUSH comes through DirectTokens only: what the socket did not take from a direct delivery
                await sink.flush()  # (the client is slow)
    finally:
        # Every way out, trio.Cancelled included: from here on no token of this stream is written from the
        # reader task (the cancellation already took this task out of next_batch: none could run meanwhile).
        if direct is not None:
            stream.deliver_directly(None)
    tail = detokenizer.finish()
    if tail:
        await sink.delta(tail, (), ())


def finish_reason(state: StreamState) -> str:
    if state.stopped_on is not None:
        return "stop"
    return state.finished.reason_name if state.finished is not None else "stop"


async def finish_answer(sink: OutputSink, state: StreamState, prompt_tokens: int, reported_cached: int | None, *,
                        reason: str | None = None) -> None:
    """The answer's last call to `sink`: `reason` (else what the stream ended on), the usage, and the cached
    prompt tokens the engine reported, never more than the prompt (also kept in `state` for the metrics)."""
    state.cached_tokens = None if reported_cached is None else min(reported_cached, prompt_tokens)
    stop_text = state.stopped_on or (state.finished.stop_text if state.finished is not None else None)
    await sink.finish(finish_reason(state) if reason is None else reason, prompt_tokens, state.completion_tokens,
                      cached_tokens=state.cached_tokens, stop_text=stop_text if reason is None else None)


class ReplayedStream:
    """Events already received, read like a generate stream (the prefill leg's whole answer)."""

    def __init__(self, events) -> None:
        self._batches = [list(events)]

    async def next_batch(self) -> list[Event]:
        await trio.lowlevel.checkpoint()
        return self._batches.pop() if self._batches else []

    def deliver_directly(self, handler: DirectHandler | None) -> bool:
        return False  # everything has arrived: nothing to hand over
