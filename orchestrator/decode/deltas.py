"""Engine tokens -> client deltas: the sink they go to, and how tokens become deltas.

`OutputSink` is the one interface the decode stage writes a response through; the frontend implements it
(frontend/app.py: an SSE stream, or a response collected whole; frontend/block_sink.py: an answer of blocks),
from the request's task. A sink that can also write from the engine connection's reader task (direct delivery:
decode/progress.py has the contract) says so by giving a `DirectWriter`; one that never can gives None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from orchestrator.engine import Tokens
from orchestrator.engine.events import TokenLogprob
from orchestrator.tokenizer import IncrementalDetokenizer

Delta = tuple[str, Sequence[int], Sequence[TokenLogprob]]  # text, its token ids, their logprobs


class DirectWriter(Protocol):
    """The part of a sink that writes from the engine connection's reader task (decode/progress.py's contract):
    `can_write_now` and `deltas_now` are called there only, `flush` is awaited by the request's task."""

    @property
    def can_write_now(self) -> bool:
        """Whether `deltas_now` may be called at this moment (not before the response started, nor once it is
        ending)."""

    def deltas_now(self, items: Sequence[Delta]) -> bool:
        """`OutputSink.deltas`, written at once by the calling task, without awaiting; False when part of them
        waits for `flush()`. Called only while `can_write_now` is true."""

    async def flush(self) -> None:
        """Wait until what `deltas_now` could not write has been written (a slow client: backpressure)."""


class OutputSink(Protocol):
    """Where one request's output goes, from the request's own task."""

    per_token: bool  # one delta per token (given together to `deltas`), or one per batch of arrived tokens

    async def deltas(self, items: Sequence[Delta]) -> None:
        """The deltas of one batch (one, or with `per_token` one per token; a delta's text may be empty when only
        logprobs are new): a sink may send them in one write (they arrived together)."""

    def ending(self) -> None:
        """The engine has finished: what is delivered from now on may be written together with the finish."""

    async def finish(self, reason: str, prompt_tokens: int, completion_tokens: int, *,
                     cached_tokens: int | None = None, stop_text: str | None = None) -> None:
        """The last call. `cached_tokens`: of the prompt, how many the engine found cached (None: it did not
        say). `stop_text`: the stop string the answer ended on, if it did (its text is not in the answer)."""

    @property
    def direct(self) -> DirectWriter | None:
        """How this sink writes from the engine connection's reader task; None: it never does (a collected
        response, several choices on one stream, TLS)."""


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
