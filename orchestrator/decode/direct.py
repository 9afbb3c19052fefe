"""Direct delivery: streamed tokens written to the client from the engine connection's reader task.

Why: without it, every socket read from a worker wakes the request's task to handle one token, and waking
a task and switching to it costs about as much as everything else a streamed token needs. While the
request's task waits for its next batch, the tokens are handled right where they arrived instead
(docs/benchmarks.md has the A/B figures that keep this here).

The contract, in one place. Three parties meet here and nowhere else:

- the stream: `GenerateStream.deliver_directly(handler)` (engine/client.py, over transport/inbox.py's
  `TrioInbox.hand_over`) calls `handler(batch)` in the task that produced the events -- the HTTP/2
  connection's reader task, right after a socket read -- and only while the request's task is parked in
  `next_batch()` with nothing queued. Only our h2 transport can (grpcio streams say False).
- the handler: `DirectTokens.deliver` (below), the only one.
- the sink: `OutputSink.can_write_now` / `deltas_now` / `flush` (decode/deltas.py), which write through
  `ServerExtensions.send_now` (frontend/server_extensions.py); over TLS `can_write_now` is False and
  nothing is delivered directly.

What runs in the reader task: `deliver` -- counting (StreamState, the token meter through `on_chunk`),
incremental detokenizing and the stop strings, SSE formatting, and a write that does not block. It is a
plain call inside another task: it never awaits, and it must not raise (if it does, that one call fails:
transport/h2_channel.py abandons the stream and logs it; the connection and its other streams go on).

What it may touch: this request's StreamState, detokenizer and sink, and its token meter; nothing of the
connection (the connection gives the worker back the flow-control credit of what `deliver` took once it
returns, transport/h2_channel.py `_hand_over`; of what it left, when the request's task reads it). The request's
own task uses the same objects; they never interleave because trio runs one task at a time and `deliver`
runs only while that task is parked in `next_batch()`.

What it leaves to the request's task, by returning a batch instead of None: terminal events (finished,
failed, prefill_ready: `next_batch()` marks the stream ended), every batch while the sink cannot write from
here (the response is not started, or is ending), a stop-string match (after its tokens, so that the loop
ends), and what the socket did not take (`FLUSH`: the task awaits `sink.flush()`, the backpressure from a
slow client).

How cancellation ends it: the request's task owns the delivery. `stream_output` arms it once its stream's
first tokens went out through the task (the response has started) and disarms it in its `finally`
(`stream.deliver_directly(None)`), which runs on every way out: the finish, an error, and trio.Cancelled
(the client went -- the server's `on_disconnect` cancels the request's nursery --, the deadline, shutdown).
A cancellation wakes the parked task first (the inbox forgets its reader), so no delivery runs between the
cancel and the disarm; later reads are queued for nobody and go with the stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from orchestrator.decode.deltas import OutputSink, StreamState, add_tokens, count_tokens, token_deltas
from orchestrator.engine import Tokens
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


class DirectTokens:
    """The direct handler of one stream of one request (the module docstring is its contract)."""

    __slots__ = ("sink", "detokenizer", "state", "on_chunk", "per_token")

    def __init__(self, sink: OutputSink, detokenizer: IncrementalDetokenizer, state: StreamState,
                 on_chunk: Callable[[int], None] | None) -> None:
        self.sink, self.detokenizer, self.state, self.on_chunk = sink, detokenizer, state, on_chunk
        self.per_token = sink.per_token

    @classmethod
    def arm(cls, stream: TokenStream, sink: OutputSink, detokenizer: IncrementalDetokenizer, state: StreamState,
            on_chunk: Callable[[int], None] | None) -> DirectTokens | None:
        """Start direct delivery on `stream` if `sink` can write from another task and the stream can hand
        events over; None if not. The caller ends it with `stream.deliver_directly(None)`."""
        if not sink.can_write_now:  # a collected response, TLS, a response that is ending
            return None
        direct = cls(sink, detokenizer, state, on_chunk)
        # The bound method, not the instance: an instance's __call__ costs twice the call, on every read.
        return direct if stream.deliver_directly(direct.deliver) else None

    def deliver(self, batch: list[Event]) -> list | None:
        """Runs in the reader task. None: the batch is dealt with; else what the request's task gets instead."""
        if not self.sink.can_write_now:
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
        count_tokens(ids, self.state, self.on_chunk)
        items = token_deltas(ids, logprobs, self.per_token, self.detokenizer)
        written = self.sink.deltas_now(items) if items else True
        if self.detokenizer.stopped_on is not None:
            self.state.stopped_on = self.detokenizer.stopped_on
            return [FLUSH]  # the request's task ends the stream
        return None if written else [FLUSH]
