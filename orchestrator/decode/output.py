"""The decode stage's output side: engine events -> text deltas for the client.

`stream_output` reads a generation stream batch by batch (every event that has arrived),
detokenizes incrementally, honours stop strings, and reports the terminal event. A sink whose
`per_token` is true gets one delta per token (the default for SSE streams); otherwise a batch is
one delta (coalesced under load). It never decides about workers; the decode stage does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

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

    async def finish(self, reason: str, prompt_tokens: int, completion_tokens: int, *,
                     cached_tokens: int | None = None) -> None:
        """`cached_tokens`: of the prompt, how many the engine found cached (None: it did not say)."""


class DirectSink(OutputSink, Protocol):
    """A sink direct delivery (DirectTokens) can write to from another task: optional, probed by `arm`."""

    can_write_now: bool  # whether deltas_now may be called at this moment

    def deltas_now(self, items: Sequence[Delta]) -> bool:
        """`deltas` written at once; False when part waits for `await flush()`."""

    async def flush(self) -> None: ...


@attrs.define
class StreamState:
    """What the coordinator needs to know about a generation stream, also after a cancellation."""

    first_token_at: float | None = None
    completion_tokens: int = 0
    token_ids: list[int] = attrs.Factory(list)  # what was streamed, for a continuation elsewhere (migration)
    resent_tokens: int = 0  # of those, how many a continuation sent back as prompt (not the client's prompt)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # the engine's usage.cached_prompt_tokens (a decode leg's: see the stage)
    finished: Finished | None = None
    stopped_on: str | None = None

    @property
    def terminal(self) -> bool:
        return self.finished is not None or self.stopped_on is not None

    def settle_cached(self, prompt_tokens: int, reported: int | None) -> int | None:
        """Record what the client is told of cached prompt tokens: `reported`, never more than the prompt."""
        self.cached_tokens = None if reported is None else min(reported, prompt_tokens)
        return self.cached_tokens


async def stream_output(stream: GenerateStream | ReplayedStream, sink: OutputSink, detokenizer: IncrementalDetokenizer,
                        state: StreamState, *, worker: str, on_chunk=None) -> None:
    """Read until the engine finishes or a stop string matches; raises the engine's error.

    Once the first tokens of this stream went out, later token events are delivered directly
    (`DirectTokens`) where the stream and the sink allow it."""
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
            for event in batch:
                if isinstance(event, Tokens):
                    ids.extend(event.token_ids)
                    logprobs.extend(event.logprobs)
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
                _count(ids, state, on_chunk)
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
            if flush:
                # FLUSH comes through DirectTokens only: what the socket did not take from a direct delivery
                await cast(DirectSink, sink).flush()  # (the client is slow)
    finally:
        if direct is not None:
            stream.deliver_directly(None)
    tail = detokenizer.finish()
    if tail:
        await sink.delta(tail, (), ())


def _count(ids: Sequence[int], state: StreamState, on_chunk) -> None:
    state.completion_tokens += len(ids)
    state.token_ids.extend(ids)
    if on_chunk is not None:
        on_chunk(len(ids))


def token_deltas(ids: Sequence[int], logprobs: Sequence[TokenLogprob], per_token: bool,
                 detokenizer: IncrementalDetokenizer) -> list[Delta]:
    """The deltas of tokens that arrived together: one for all of them, or with `per_token` one per token
    (what token-counting clients such as aiperf expect of a stream).

    A token whose bytes do not complete a character yet gives no text; its text goes out with the
    next token's delta. Tokens after a matched stop string are not delivered.
    """
    if not per_token or len(ids) == 1:
        text = detokenizer.add(ids)
        return [(text, ids, logprobs)] if text or logprobs else []
    aligned = len(logprobs) == len(ids)
    items: list[Delta] = []
    for index, token in enumerate(ids):
        text = detokenizer.add((token,))
        token_logprobs = logprobs[index:index + 1] if aligned else (logprobs if index == 0 else ())
        if text or token_logprobs:
            items.append((text, (token,), token_logprobs))
        if detokenizer.stopped_on is not None:
            break
    return items


class _Flush:
    def __repr__(self) -> str:
        return "FLUSH"


FLUSH = _Flush()  # what a direct delivery leaves for the reader when the client's socket did not take it all


class DirectTokens:
    """Token events handled in the stream's producing task (the HTTP/2 connection's reader) while the
    request's own task waits for its next batch: detokenized, counted and written to the client there,
    without waking the request's task for every read (engine/inbox.py says why).

    The request's task still owns the request: it waits in next_batch(), and a cancellation (the client
    going, a deadline, shutdown) ends that wait and this delivery with it. Declined, and left to that
    task: the terminal events, anything while the response cannot be written from here, a stop string
    match (after its tokens are handled, so that the loop ends), and what the socket did not take
    (FLUSH: the task awaits the rest, which is the backpressure from a slow client).
    """

    __slots__ = ("sink", "detokenizer", "state", "on_chunk", "per_token")

    def __init__(self, sink, detokenizer: IncrementalDetokenizer, state: StreamState, on_chunk) -> None:
        self.sink, self.detokenizer, self.state, self.on_chunk = sink, detokenizer, state, on_chunk
        self.per_token = sink.per_token

    @classmethod
    def arm(cls, stream, sink, detokenizer, state, on_chunk) -> DirectTokens | None:
        """Start direct delivery on `stream` if it can hand events over and `sink` can write in place; the
        caller ends it with `stream.deliver_directly(None)`."""
        if not getattr(sink, "can_write_now", False) or getattr(stream, "deliver_directly", None) is None:
            return None  # e.g. a collecting sink, hypercorn, a replayed prefill answer, a test's stream
        direct = cls(sink, detokenizer, state, on_chunk)
        return direct if stream.deliver_directly(direct.deliver) else None

    def deliver(self, batch: list) -> list | None:
        """Deal with the token events that arrived together (None), or leave what the request's task gets."""
        if not self.sink.can_write_now:
            return batch
        ids: Sequence[int]
        logprobs: Sequence[TokenLogprob]
        if len(batch) == 1:  # the usual case: one token event per stream and read
            event = batch[0]
            if type(event) is not Tokens:
                return batch
            ids, logprobs = event.token_ids, event.logprobs
        else:
            all_ids: list[int] = []
            all_logprobs: list[TokenLogprob] = []
            for event in batch:
                if type(event) is not Tokens:
                    return batch
                all_ids.extend(event.token_ids)
                all_logprobs.extend(event.logprobs)
            ids, logprobs = all_ids, all_logprobs
        _count(ids, self.state, self.on_chunk)
        items = token_deltas(ids, logprobs, self.per_token, self.detokenizer)
        written = self.sink.deltas_now(items) if items else True
        if self.detokenizer.stopped_on is not None:
            self.state.stopped_on = self.detokenizer.stopped_on
            return [FLUSH]  # the request's task ends the stream
        return None if written else [FLUSH]


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

    def deliver_directly(self, handler) -> bool:
        return False  # every event is here already: none arrives later to be delivered
