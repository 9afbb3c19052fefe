"""One request's output progress, `StreamProgress`: what was streamed to its sink and how its stream ended, written
by its methods only, from the request's task and, in direct delivery, from the engine connection's reader task.

Direct delivery: streamed tokens written to the client from the engine connection's reader task.

Why: without it, every socket read from a worker wakes the request's task to handle one token, and waking
a task and switching to it costs about as much as everything else a streamed token needs. While the
request's task waits for its next batch, the tokens are handled right where they arrived instead
(docs/benchmarks.md has the A/B figures that keep this here).

The contract, in one place. Three parties meet here and nowhere else:

- the stream: `GenerateStream.deliver_directly(handler)` (engine/client.py, over transport/inbox.py's
  `TrioInbox.hand_over`) calls `handler(batch)` in the task that produced the events -- the HTTP/2
  connection's reader task, right after a socket read -- and only while the request's task is parked in
  `next_batch()` with nothing queued. Only our h2 transport can (grpcio streams say False).
- the handler: `StreamProgress.deliver` (below), the only one.
- the sink's `DirectWriter` (`OutputSink.direct`: `can_write_now` / `deltas_now` / `flush`, decode/deltas.py),
  which writes through `ServerExtensions.send_now` (frontend/server_extensions.py); a sink that never can (a
  collected response, several choices on one stream, TLS) gives None, and nothing is delivered directly.

What runs in the reader task: `deliver` -- counting (the progress, the token meter through `on_chunk`),
incremental detokenizing and the stop strings, SSE formatting, and a write that does not block. It is a
plain call inside another task: it never awaits, and it must not raise (if it does, that one call fails:
transport/h2_channel.py abandons the stream and logs it; the connection and its other streams go on).

What it may touch: this request's `StreamProgress` (its state, detokenizer and sink) and its token meter;
nothing of the connection (the connection gives the worker back the flow-control credit of what `deliver` took
once it returns, transport/h2_channel.py `_act`; of what it left, when the request's task reads it). The
request's own task uses the same objects; they never interleave because trio runs one task at a time and
`deliver` runs only while that task is parked in `next_batch()`.

What it leaves to the request's task, by returning a batch instead of None: terminal events (finished,
failed, prefill_ready: `next_batch()` marks the stream ended), every batch while the sink cannot write from
here (the response is not started, or is ending), a stop-string match (after its tokens, so that the loop
ends), and what the socket did not take (`FLUSH`: the task awaits the writer's `flush()`, the backpressure from
a slow client).

How cancellation ends it: the request's task owns the delivery. `stream_output` arms it (`arm`) once its
stream's first tokens went out through the task (the response has started) and disarms it in its `finally`
(`disarm`: `stream.deliver_directly(None)`), which runs on every way out: the finish, an error, and trio.Cancelled
(the client went -- the server's `on_disconnect` cancels the request's nursery --, the deadline, shutdown).
A cancellation wakes the parked task first (the inbox forgets its reader), so no delivery runs between the
cancel and the disarm; later reads are queued for nobody and go with the stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import trio

from orchestrator.decode.deltas import Delta, DirectWriter, OutputSink, add_tokens, token_deltas
from orchestrator.engine import Finished, Tokens
from orchestrator.engine.events import Event, TokenLogprob
from orchestrator.tokenizer import IncrementalDetokenizer

DirectHandler = Callable[[list[Event]], list | None]


class _Flush:
    def __repr__(self) -> str:
        return "FLUSH"


FLUSH = _Flush()  # what a direct delivery leaves for the request's task when the client's socket did not take it all


class TokenStream(Protocol):
    """A generation stream as the decode stage reads it (engine.GenerateStream, or a replayed answer)."""

    async def next_batch(self) -> list[Event]: ...

    def deliver_directly(self, handler: DirectHandler | None) -> bool:
        """Hand each read's events to `handler` in the producing task while `next_batch()` waits (see the
        module docstring); None ends that. False when this stream cannot."""


class StreamProgress:
    """What was streamed of one request to its sink and how its stream ended, carried across its legs (a
    migration's too). Its methods are the only writers (the module docstring says from which task); the decode
    side calls them, the request flow reads the properties (a continuation's tokens, the KV handoff's timing,
    the answer's end, the metrics), also after a cancellation."""

    # (slots and plain attributes behind read-only properties: one is made per request, and `deliver` runs per
    # streamed token)
    __slots__ = ("_cached_tokens", "_carried_logprobs", "_completion_tokens", "_direct", "_finished",
                 "_first_token_at", "_on_chunk", "_per_token", "_prompt_tokens", "_resent_tokens", "_stopped_on",
                 "_token_ids", "detokenizer", "sink")

    def __init__(self, sink: OutputSink, detokenizer: IncrementalDetokenizer) -> None:
        self.sink, self.detokenizer = sink, detokenizer
        self._per_token = sink.per_token
        self._first_token_at: float | None = None
        self._completion_tokens = 0
        self._token_ids: list[int] = []  # what was streamed, for a continuation elsewhere (migration)
        self._resent_tokens = 0  # of those, how many a continuation sent back as prompt (not the client's prompt)
        self._prompt_tokens: int | None = None
        self._cached_tokens: int | None = None  # the engine's usage.cached_prompt_tokens (a decode leg's: the stage)
        self._finished: Finished | None = None
        self._stopped_on: str | None = None
        # logprobs of the stream's first token(s) from an earlier leg (the prefill's), for the tokens this stream
        # replays without one; used by the first tokens streamed, then dropped
        self._carried_logprobs: tuple[TokenLogprob, ...] = ()
        self._direct: DirectWriter | None = None  # while direct delivery is armed (`arm`)
        self._on_chunk: Callable[[int], None] | None = None  # the armed leg's token meter

    # ---- what the request flow and the stage read ----
    @property
    def first_token_at(self) -> float | None:
        return self._first_token_at

    @property
    def completion_tokens(self) -> int:
        return self._completion_tokens

    @property
    def token_ids(self) -> Sequence[int]:
        """The tokens streamed so far (the list itself, not a copy: copy it to keep it)."""
        return self._token_ids

    @property
    def cached_tokens(self) -> int | None:
        return self._cached_tokens

    @property
    def finished(self) -> Finished | None:
        return self._finished

    @property
    def stopped_on(self) -> str | None:
        return self._stopped_on

    @property
    def terminal(self) -> bool:
        return self._finished is not None or self._stopped_on is not None

    @property
    def finish_reason(self) -> str:
        """What the stream ended on, as the API names it."""
        if self._stopped_on is not None:
            return "stop"
        return self._finished.reason_name if self._finished is not None else "stop"

    # ---- the writers, from the request's task ----
    def carry_logprobs(self, logprobs: tuple[TokenLogprob, ...]) -> None:
        """The logprobs an earlier leg sampled for the first tokens (the prefill's), which the next stream replays
        without them; only before anything was streamed."""
        if self._completion_tokens == 0:
            self._carried_logprobs = logprobs

    def tokens(self, ids: Sequence[int], logprobs: Sequence[TokenLogprob],
               on_chunk: Callable[[int], None] | None) -> list[Delta]:
        """Tokens about to go to the client: counted, kept for a continuation, reported to `on_chunk` (the
        metrics), detokenized into the deltas for the sink; a stop string ends the stream."""
        if self._first_token_at is None:
            self._first_token_at = trio.current_time()
        if self._carried_logprobs:
            logprobs = self._fill_carried(ids, logprobs)
        self._completion_tokens += len(ids)
        self._token_ids.extend(ids)
        if on_chunk is not None:
            on_chunk(len(ids))
        detokenizer = self.detokenizer
        items = token_deltas(ids, logprobs, self._per_token, detokenizer)
        if detokenizer.stopped_on is not None:
            self._stopped_on = detokenizer.stopped_on
        return items

    def _fill_carried(self, ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> list[TokenLogprob]:
        """The logprobs of the stream's first tokens, completed from the carried ones where the engine sent a
        token without one and the carried one is of the same token (then dropped: only the first tokens)."""
        carried, self._carried_logprobs = self._carried_logprobs, ()
        logprobs = list(logprobs) if logprobs else [TokenLogprob(token, None) for token in ids]
        for index, known in enumerate(carried[:len(ids)]):
            if logprobs[index].logprob is None and logprobs[index].token_id == known.token_id:
                logprobs[index] = known
        return logprobs

    def finish_with(self, event: Finished) -> None:
        """The engine's finish, and the usage it reported."""
        self._finished = event
        if event.usage is not None:
            self._prompt_tokens = event.usage.prompt_tokens
            self._cached_tokens = event.usage.cached_prompt_tokens

    def token_after_cancel(self) -> None:
        """A token came after the client went (the KV rule's wait: decode/stage.py): nothing is sent, it only
        says the decode worker pulled the KV."""
        if self._first_token_at is None:
            self._first_token_at = trio.current_time()
        self._completion_tokens += 1

    def resending(self, tokens: int) -> None:
        """A continuation sends the first `tokens` streamed back as prompt (a migration)."""
        self._resent_tokens = tokens

    def text_tail(self) -> list[Delta]:
        """What the detokenizer held back (an incomplete character, a possible stop string): the delta the sink
        is owed once the stream is over (none, usually: a plain method, no coroutine made for nothing)."""
        tail = self.detokenizer.finish()
        return [(tail, (), ())] if tail else []

    def usage_prompt(self, planned: int) -> int:
        """The prompt the answer's usage reports: what the engine counted with its finish, less what a continuation
        sent back as prompt; else the `planned` one."""
        if self._prompt_tokens:
            return self._prompt_tokens - self._resent_tokens or planned
        return planned

    async def finish_answer(self, prompt_tokens: int, reported_cached: int | None, *,
                            reason: str | None = None) -> None:
        """The answer's last call to the sink, the one way an answer's end goes there, whoever ends it (the
        stage, or the request flow for an answer that ended without a decode leg's finish): `reason` (else
        what the stream ended on, and the stop string it ended on), the usage, and the cached prompt tokens
        the engine reported, never more than the prompt (also kept for the metrics)."""
        self._cached_tokens = None if reported_cached is None else min(reported_cached, prompt_tokens)
        stop_text = None
        if reason is None:
            stop_text = self._stopped_on or (self._finished.stop_text if self._finished is not None else None)
        await self.sink.finish(self.finish_reason if reason is None else reason, prompt_tokens,
                               self._completion_tokens, cached_tokens=self._cached_tokens, stop_text=stop_text)

    # ---- direct delivery (the module docstring is its contract) ----
    def arm(self, stream: TokenStream, on_chunk: Callable[[int], None] | None) -> bool:
        """Start direct delivery on `stream` if the sink can write from another task and the stream can hand
        events over; False if not. The caller ends it with `disarm`."""
        direct = self.sink.direct
        if direct is None or not direct.can_write_now:  # never (a collected response, TLS), or not now (ending)
            return False
        self._direct, self._on_chunk = direct, on_chunk
        # The bound method, not the instance: an instance's __call__ costs twice the call, on every read.
        if stream.deliver_directly(self.deliver):
            return True
        self._direct = self._on_chunk = None
        return False

    def disarm(self, stream: TokenStream) -> None:
        """End direct delivery on `stream`: nothing more is delivered from the reader task. What it held goes too:
        the token meter is the request flow's bound method, and kept here it would make the flow and its progress a
        reference cycle, freed only by the garbage collector."""
        stream.deliver_directly(None)
        self._direct = self._on_chunk = None

    def deliver(self, batch: list[Event]) -> list | None:
        """Runs in the reader task. None: the batch is dealt with; else what the request's task gets instead."""
        direct = self._direct
        if direct is None or not direct.can_write_now:
            return batch
        ids: list[int] | tuple[int, ...]
        logprobs: list[TokenLogprob] | tuple[TokenLogprob, ...]
        if len(batch) == 1:  # the usual case: one token event per stream and read
            event = batch[0]
            if type(event) is not Tokens:
                return batch
            ids, logprobs = event.token_ids, event.logprobs
        else:
            batch_ids: list[int] = []
            batch_logprobs: list[TokenLogprob] = []
            for event in batch:
                if type(event) is not Tokens:
                    return batch  # a terminal event among them: all of it goes to the request's task
                if event.logprobs or batch_logprobs:
                    add_tokens(event, batch_ids, batch_logprobs)
                else:
                    batch_ids.extend(event.token_ids)
            ids, logprobs = batch_ids, batch_logprobs
        items = self.tokens(ids, logprobs, self._on_chunk)
        written = direct.deltas_now(items) if items else True
        if self._stopped_on is not None:
            return [FLUSH]  # the request's task ends the stream
        return None if written else [FLUSH]
