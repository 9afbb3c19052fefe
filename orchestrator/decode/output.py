"""The decode stage's output side: engine events -> text deltas for the client.

`stream_output` reads a generation stream batch by batch (every event that has arrived),
detokenizes incrementally, honours stop strings, and reports the terminal event. A sink whose
`per_token` is true gets one delta per token (the default for SSE streams); otherwise a batch is
one delta (coalesced under load). It never decides about workers; the decode stage does.
The sink is in deltas.py; the request's progress, the only writer of its state (and the one way an answer's
end goes to the sink, `StreamProgress.finish_answer`), and direct delivery are in progress.py.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from orchestrator.decode.deltas import add_tokens
from orchestrator.decode.progress import FLUSH, DirectHandler, StreamProgress, TokenStream
from orchestrator.engine import EngineError, Failed, Finished, PrefillReady, Tokens
from orchestrator.engine.errors import ErrorCode, engine_cancelled
from orchestrator.engine.events import Event, FinishReason, TokenLogprob


async def stream_output(stream: TokenStream, progress: StreamProgress, *, worker: str,
                        on_chunk: Callable[[int], None] | None = None) -> None:
    """Read until the engine finishes or a stop string matches; raises the engine's error. `on_chunk` is told
    the number of tokens of each batch that goes to the client (the token meter).

    Once the first tokens of this stream went out, later token events are delivered directly where the
    stream and the sink allow it (decode/progress.py; its delivery ends when this returns or is cancelled)."""
    sink = progress.sink
    armed = False
    may_arm = True  # after this stream's first tokens went out, once
    try:
        while not progress.terminal:
            batch = await stream.next_batch()
            if not batch:
                raise EngineError("the generation stream ended without a finished event", worker=worker,
                                  rpc="Generate", code=ErrorCode.ERROR_CODE_INTERNAL)
            ids: list[int] = []
            logprobs: list[TokenLogprob] = []
            flush = finished = False
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
                    progress.finish_with(event)
                    finished = True
                    break
                elif isinstance(event, Failed):
                    raise event.error
                elif isinstance(event, PrefillReady):
                    raise EngineError("a generation leg answered with prefill_ready", worker=worker, rpc="Generate")
                elif event is FLUSH:
                    flush = True
            if finished:
                sink.ending()  # one write for the last tokens, the finish and [DONE] (max_tokens 1: the only one)
            if ids:
                items = progress.tokens(ids, logprobs, on_chunk)
                if items:  # several only for a per-token sink (token_deltas)
                    await sink.deltas(items)
                if may_arm and not progress.terminal:  # (not for a stream that is over already)
                    may_arm = False
                    armed = progress.arm(stream, on_chunk)
            if cancelled is not None:  # after the tokens that came before it: the client has them
                raise engine_cancelled(cancelled.message, worker=worker)
            if flush:
                # FLUSH comes through direct delivery only: what the socket did not take from it
                direct = sink.direct
                if direct is not None:
                    await direct.flush()  # (the client is slow)
    finally:
        # Every way out, trio.Cancelled included: from here on no token of this stream is written from the
        # reader task (the cancellation already took this task out of next_batch: none could run meanwhile).
        if armed:
            progress.disarm(stream)
    if tail := progress.text_tail():
        await sink.deltas(tail)


class ReplayedStream:
    """Events already received, read like a generate stream (the prefill leg's whole answer)."""

    def __init__(self, events) -> None:
        self._batches = [list(events)]

    async def next_batch(self) -> list[Event]:
        await trio.lowlevel.checkpoint()
        return self._batches.pop() if self._batches else []

    def deliver_directly(self, handler: DirectHandler | None) -> bool:
        return False  # everything has arrived: nothing to hand over
