"""The decode stage's output side: engine events -> text deltas for the client.

`stream_output` reads a generation stream batch by batch (every event that has arrived),
detokenizes incrementally, honours stop strings, and reports the terminal event. A sink whose
`per_token` is true gets one delta per token (the default for SSE streams); otherwise a batch is
one delta (coalesced under load). It never decides about workers; the decode stage does.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import attrs
import trio

from orchestrator.engine import EngineError, Failed, Finished, GenerateStream, PrefillReady, Tokens
from orchestrator.engine.errors import ErrorCode
from orchestrator.engine.events import TokenLogprob
from orchestrator.tokenizer import IncrementalDetokenizer


Delta = tuple[str, Sequence[int], Sequence[TokenLogprob]]  # text, its token ids, their logprobs


class OutputSink(Protocol):
    per_token: bool  # one delta per token (given together to `deltas`), or one per batch of arrived tokens

    async def delta(self, text: str, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> None: ...

    async def deltas(self, items: Sequence[Delta]) -> None:
        """The per-token deltas of one batch: a sink may send them in one write (they arrived together)."""

    def ending(self) -> None:
        """The engine has finished: what is delivered from now on may be written together with the finish."""

    async def finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None: ...


@attrs.define
class StreamState:
    """What the coordinator needs to know about a generation stream, also after a cancellation."""

    first_token_at: float | None = None
    completion_tokens: int = 0
    token_ids: list[int] = attrs.Factory(list)  # what was streamed, for a continuation elsewhere (migration)
    resent_tokens: int = 0  # of those, how many a continuation sent back as prompt (not the client's prompt)
    prompt_tokens: int | None = None
    finished: Finished | None = None
    stopped_on: str | None = None

    @property
    def terminal(self) -> bool:
        return self.finished is not None or self.stopped_on is not None


async def stream_output(stream: GenerateStream, sink: OutputSink, detokenizer: IncrementalDetokenizer,
                        state: StreamState, *, worker: str, on_chunk=None) -> None:
    """Read until the engine finishes or a stop string matches; raises the engine's error."""
    while not state.terminal:
        batch = await stream.next_batch()
        if not batch:
            raise EngineError("the generation stream ended without a finished event", worker=worker,
                              rpc="Generate", code=ErrorCode.ERROR_CODE_INTERNAL)
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        for event in batch:
            if isinstance(event, Tokens):
                ids.extend(event.token_ids)
                logprobs.extend(event.logprobs)
            elif isinstance(event, Finished):
                state.finished = event
                if event.usage is not None:
                    state.prompt_tokens = event.usage.prompt_tokens
                break
            elif isinstance(event, Failed):
                raise event.error
            elif isinstance(event, PrefillReady):
                raise EngineError("a generation leg answered with prefill_ready", worker=worker, rpc="Generate")
        if state.finished is not None:
            sink.ending()  # one write for the last tokens, the finish and [DONE] (max_tokens 1: the only one)
        if ids:
            if state.first_token_at is None:
                state.first_token_at = trio.current_time()
            state.completion_tokens += len(ids)
            state.token_ids.extend(ids)
            if on_chunk is not None:
                on_chunk(len(ids))
            if sink.per_token and len(ids) > 1:
                await _deliver_per_token(ids, logprobs, sink, detokenizer)
            else:
                text = detokenizer.add(ids)
                if text or logprobs:
                    await sink.delta(text, ids, logprobs)
            if detokenizer.stopped_on is not None:
                state.stopped_on = detokenizer.stopped_on
    tail = detokenizer.finish()
    if tail:
        await sink.delta(tail, (), ())


async def _deliver_per_token(ids: list[int], logprobs: list[TokenLogprob], sink: OutputSink,
                             detokenizer: IncrementalDetokenizer) -> None:
    """One delta per token (what token-counting clients such as aiperf expect of a stream).

    A token whose bytes do not complete a character yet gives no text; its text goes out with the
    next token's delta. Tokens after a matched stop string are not delivered.
    """
    aligned = len(logprobs) == len(ids)
    items: list[Delta] = []
    for index, token in enumerate(ids):
        text = detokenizer.add((token,))
        token_logprobs = logprobs[index:index + 1] if aligned else (logprobs if index == 0 else ())
        if text or token_logprobs:
            items.append((text, (token,), token_logprobs))
        if detokenizer.stopped_on is not None:
            break
    if items:
        await sink.deltas(items)


def finish_reason(state: StreamState) -> str:
    if state.stopped_on is not None:
        return "stop"
    return state.finished.reason_name if state.finished is not None else "stop"


class ReplayedStream:
    """Events already received, read like a generate stream (the prefill leg's whole answer)."""

    def __init__(self, events) -> None:
        self._batches = [list(events)]

    async def next_batch(self) -> list:
        await trio.lowlevel.checkpoint()
        return self._batches.pop() if self._batches else []
