"""Engine tokens -> client deltas: the sink they go to, what was streamed so far, and how tokens become deltas.

`OutputSink` is the one interface the decode stage writes a response through; the frontend implements it
(frontend/app.py: an SSE stream, or a response collected whole), every sink all of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import attrs

from orchestrator.engine import Finished, Tokens
from orchestrator.engine.events import TokenLogprob
from orchestrator.tokenizer import IncrementalDetokenizer

Delta = tuple[str, Sequence[int], Sequence[TokenLogprob]]  # text, its token ids, their logprobs


class OutputSink(Protocol):
    """Where one request's output goes. Called from the request's own task, except `can_write_now` and
    `deltas_now`, which direct delivery calls from the engine connection's reader task (decode/direct.py)."""

    per_token: bool  # one delta per token (given together to `deltas`), or one per batch of arrived tokens

    async def delta(self, text: str, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> None:
        """One delta: its text (possibly empty when only logprobs are new), token ids and logprobs."""

    async def deltas(self, items: Sequence[Delta]) -> None:
        """The per-token deltas of one batch: a sink may send them in one write (they arrived together)."""

    def ending(self) -> None:
        """The engine has finished: what is delivered from now on may be written together with the finish."""

    async def finish(self, reason: str, prompt_tokens: int, completion_tokens: int, *,
                     cached_tokens: int | None = None, stop_text: str | None = None) -> None:
        """The last call. `cached_tokens`: of the prompt, how many the engine found cached (None: it did not
        say). `stop_text`: the stop string the answer ended on, if it did (its text is not in the answer)."""

    @property
    def can_write_now(self) -> bool:
        """Whether `deltas_now` may be called at this moment (a sink that never can says False)."""

    def deltas_now(self, items: Sequence[Delta]) -> bool:
        """`deltas`, written at once by the calling task, without awaiting; False when part of them waits
        for `flush()`. Called only while `can_write_now` is true."""

    async def flush(self) -> None:
        """Wait until what `deltas_now` could not write has been written (a slow client: backpressure)."""


@attrs.define
class StreamState:
    """What was streamed of one request and how its stream ended, carried across its legs (a migration's too):
    the decode side writes it (stream_output, direct delivery, the stage), the request flow reads it (a
    continuation's tokens, the KV handoff's timing, the answer's end, the metrics), also after a cancellation."""

    first_token_at: float | None = None
    completion_tokens: int = 0
    token_ids: list[int] = attrs.Factory(list)  # what was streamed, for a continuation elsewhere (migration)
    resent_tokens: int = 0  # of those, how many a continuation sent back as prompt (not the client's prompt)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # the engine's usage.cached_prompt_tokens (a decode leg's: see the stage)
    finished: Finished | None = None
    stopped_on: str | None = None
    # logprobs of the stream's first token(s) from an earlier leg (the prefill's), for the tokens this stream
    # replays without one; used by the first tokens streamed, then dropped
    carried_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def terminal(self) -> bool:
        return self.finished is not None or self.stopped_on is not None


def add_tokens(event: Tokens, ids: list[int], logprobs: list[TokenLogprob]) -> None:
    """Append a token event of a batch to its ids and logprobs, keeping each logprob at its token's place: once
    one event has logprobs, tokens of others without any get a placeholder (logprob None), never a neighbour's."""
    if event.logprobs:
        if len(logprobs) < len(ids):
            logprobs.extend(TokenLogprob(token, None) for token in ids[len(logprobs):])
        logprobs.extend(event.logprobs)
    elif logprobs:
        logprobs.extend(TokenLogprob(token, None) for token in event.token_ids)
    ids.extend(event.token_ids)


def fill_carried(ids: Sequence[int], logprobs: list[TokenLogprob], state: StreamState) -> list[TokenLogprob]:
    """The logprobs of the stream's first tokens, completed from `state.carried_logprobs` where the engine sent
    a token without one and the carried one is of the same token (then dropped: only the first tokens)."""
    carried, state.carried_logprobs = state.carried_logprobs, ()
    if not logprobs:
        logprobs = [TokenLogprob(token, None) for token in ids]
    for index, known in enumerate(carried[:len(ids)]):
        if logprobs[index].logprob is None and logprobs[index].token_id == known.token_id:
            logprobs[index] = known
    return logprobs


def count_tokens(ids: Sequence[int], state: StreamState, on_chunk: Callable[[int], None] | None) -> None:
    """Tokens about to go to the client: counted, kept for a continuation, reported to the metrics."""
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
