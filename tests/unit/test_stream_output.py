"""The decode stage's output: how engine token batches become client deltas.

An SSE stream gets one event per token by default (aiperf and other clients count events as tokens
and time the gaps between them); `http.coalesce_tokens: true` sends the tokens that arrived together
as one event. Either way the text is the same, a character split over tokens goes out whole, and
nothing after a stop string is delivered.
"""

from __future__ import annotations

from functools import partial

import pytest
import trio
import trio.testing

from orchestrator.decode.output import ReplayedStream, stream_output
from orchestrator.decode.progress import StreamProgress
from orchestrator.engine import Finished, Tokens
from orchestrator.engine.client import GenerateStream
from orchestrator.engine.events import TokenLogprob
from orchestrator.models import TINY_CHAT
from orchestrator.openengine.v1.generation_pb2 import FinishReason
from orchestrator.tokenizer import IncrementalDetokenizer, ModelTokenizer
from orchestrator.transport.inbox import TrioInbox

TOKENIZER = ModelTokenizer.from_dir(TINY_CHAT)
WORDS = tuple(TOKENIZER.encode("the river and the bridge"))  # five tokens, one per word piece
BRIDGE_EMOJI = tuple(TOKENIZER.encode("🌉"))  # one character, three byte tokens
DONE = Finished(FinishReason.FINISH_REASON_LENGTH)


class RecordingSink:
    def __init__(self, per_token: bool):
        self.per_token = per_token
        self.received: list[tuple[str, tuple[int, ...], tuple]] = []
        self.writes = 0  # calls, as a streaming sink makes one socket write per call
        self.ended_after: int | None = None  # deltas received before ending() was called

    async def deltas(self, items):
        self.writes += 1
        self.received.extend((text, tuple(ids), tuple(logprobs)) for text, ids, logprobs in items)

    def ending(self):
        self.ended_after = len(self.received)

    async def finish(self, reason, prompt_tokens, completion_tokens, *, cached_tokens=None, stop_text=None):
        raise AssertionError("stream_output does not finish the response; the coordinator does")

    direct = None  # unless a test says otherwise (WritesNowSink)

    @property
    def text(self) -> str:
        return "".join(text for text, _, _ in self.received)


def progress_of(sink, stop=()) -> StreamProgress:
    return StreamProgress(sink, IncrementalDetokenizer(TOKENIZER, stop))


async def run(events, *, per_token: bool, stop=()) -> tuple[RecordingSink, StreamProgress]:
    sink = RecordingSink(per_token)
    state = progress_of(sink, stop)
    await stream_output(ReplayedStream(events), state, worker="w")
    return sink, state


async def test_a_batch_of_tokens_goes_out_as_one_delta_per_token():
    sink, state = await run([Tokens(WORDS), DONE], per_token=True)
    assert [ids for _, ids, _ in sink.received] == [(token,) for token in WORDS]
    assert sink.text == "the river and the bridge"
    assert sink.writes == 1  # they arrived together, so they may leave in one write
    assert state.completion_tokens == 5 and state.finished == DONE


async def test_coalescing_sends_the_batch_as_one_delta_with_the_same_text():
    sink, _ = await run([Tokens(WORDS), DONE], per_token=False)
    assert sink.received == [("the river and the bridge", WORDS, ())]


@pytest.mark.parametrize("per_token", [True, False])
async def test_a_character_split_over_tokens_goes_out_whole_with_its_last_byte(per_token):
    sink, _ = await run([Tokens(WORDS[:1] + BRIDGE_EMOJI + WORDS[1:2]), DONE], per_token=per_token)
    assert sink.text == "the🌉 river"
    assert all("\ufffd" not in text and text for text, _, _ in sink.received)
    if per_token:  # the first two byte tokens give no text yet, so no event of their own
        assert [ids for _, ids, _ in sink.received] == [WORDS[:1], BRIDGE_EMOJI[2:], WORDS[1:2]]


async def test_each_token_carries_its_own_logprob():
    logprobs = tuple(TokenLogprob(token, -0.5 * i) for i, token in enumerate(WORDS[:3]))
    sink, _ = await run([Tokens(WORDS[:3], logprobs), DONE], per_token=True)
    assert [lp for _, _, lp in sink.received] == [(logprob,) for logprob in logprobs]


@pytest.mark.parametrize("per_token", [True, False])
async def test_nothing_after_a_stop_string_is_delivered(per_token):
    sink, state = await run([Tokens(WORDS), Tokens(WORDS), DONE], per_token=per_token, stop=("and",))
    assert sink.text == "the river "
    assert state.stopped_on == "and" and state.finish_reason == "stop"


@pytest.mark.parametrize("per_token, deltas", [(True, 2), (False, 1)])
async def test_engine_messages_that_arrived_together_merge_only_when_coalescing(per_token, deltas):
    # ReplayedStream hands over everything as one batch, as a busy stream's next_batch() does.
    sink, _ = await run([Tokens(WORDS[:1]), Tokens(WORDS[1:2]), DONE], per_token=per_token)
    assert len(sink.received) == deltas


async def test_the_sink_learns_before_the_last_tokens_that_the_engine_has_finished():
    """So a streaming sink writes them with the finish and [DONE]: a one-token answer is one write."""
    sink, _ = await run([Tokens(WORDS[:1]), DONE], per_token=True)
    assert sink.ended_after == 0 and len(sink.received) == 1


async def test_a_stream_still_running_is_not_ending():
    class OneBatchThenFinish:
        def __init__(self):
            self.batches = [[Tokens(WORDS[:2])], [DONE]]

        async def next_batch(self):
            return self.batches.pop(0)

    sink = RecordingSink(per_token=True)
    await stream_output(OneBatchThenFinish(), progress_of(sink), worker="w")  # type: ignore[arg-type]
    assert sink.ended_after == 2  # the two tokens went out as they came; only then did the engine finish


# ---- direct delivery (decode/progress.py): tokens written from the producing task while the request's task waits --

class WritesNowSink(RecordingSink):
    """A streaming sink that can also write from another task, as the SSE sink on the native server does: its own
    DirectWriter; `room` says how many deltas_now calls the socket takes whole (then one goes in part)."""

    def __init__(self, per_token: bool, room: int = 10**6):
        super().__init__(per_token)
        self.room = room
        self.written_now: list[tuple[str, tuple[int, ...], tuple]] = []
        self.flushes = 0

    @property
    def direct(self):  # type: ignore[override]  # a plain attribute in the parent
        return self

    can_write_now = True

    def deltas_now(self, items) -> bool:
        self.written_now.extend((text, tuple(ids), tuple(logprobs)) for text, ids, logprobs in items)
        self.received.extend((text, tuple(ids), tuple(logprobs)) for text, ids, logprobs in items)
        self.room -= 1
        return self.room >= 0

    async def flush(self):
        self.flushes += 1
        self.room = 10**6


async def run_handing_over(reads, sink, *, stop=()) -> StreamProgress:
    """stream_output on a real inbox fed like the HTTP/2 connection feeds it: each read's events handed
    over together once the request's task waits (engine/inbox.py)."""
    inbox, state = TrioInbox(), progress_of(sink, stop)
    stream = GenerateStream(inbox)  # type: ignore[arg-type]  # a bare inbox: no call whose end to let be
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(stream_output, stream, state, worker="w"))
        for read in reads:
            await trio.testing.wait_all_tasks_blocked()
            inbox._items.extend(read)
            inbox.hand_over()
        await trio.testing.wait_all_tasks_blocked()
        assert inbox.direct is None  # stream_output ended direct delivery as it returned
    return state


READS = [[Tokens(WORDS[:1])], [Tokens(WORDS[1:2]), Tokens(WORDS[2:3])], [Tokens(WORDS[3:4])],
         [Tokens(WORDS[4:]), DONE]]


@pytest.mark.parametrize("per_token", [True, False])
async def test_after_the_first_tokens_the_rest_go_out_from_the_producing_task_with_the_same_deltas(per_token):
    sink = WritesNowSink(per_token)
    state = await run_handing_over(READS, sink)
    expected = [("the", WORDS[:1], ())]
    expected += [(" river", WORDS[1:2], ()), (" and", WORDS[2:3], ())] if per_token else [
        (" river and", WORDS[1:3], ())]
    expected += [(" the", WORDS[3:4], ())]
    assert sink.received == expected + [(" bridge", WORDS[4:], ())]
    assert sink.written_now == expected[1:]  # the first read and the finishing one went through the task
    assert sink.ended_after == len(expected)  # the finish came through the task, before the last tokens
    assert state.completion_tokens == 5 and state.token_ids == list(WORDS) and state.finished == DONE


async def test_a_stop_string_met_in_a_direct_delivery_ends_the_stream_there():
    sink = WritesNowSink(per_token=True)
    state = await run_handing_over([[Tokens(WORDS[:1])], [Tokens(WORDS[1:])], [Tokens(WORDS)], [DONE]], sink,
                                   stop=("and",))
    assert sink.text == "the river " and state.stopped_on == "and" and state.finish_reason == "stop"
    assert "".join(text for text, _, _ in sink.written_now) == " river "  # the second read, up to the stop


async def test_what_the_socket_did_not_take_is_flushed_by_the_request_task_before_more_goes_out():
    """A slow client: the request's task awaits the rest (backpressure), then direct delivery goes on."""
    sink = WritesNowSink(per_token=True, room=1)
    reads = [[Tokens(WORDS[:1])], [Tokens(WORDS[1:2])], [Tokens(WORDS[2:3])], [Tokens(WORDS[3:4])], [DONE]]
    state = await run_handing_over(reads, sink)
    assert sink.flushes == 1  # after the second direct write, which went in part
    assert [text for text, _, _ in sink.written_now] == [" river", " and", " the"]
    assert sink.text == "the river and the" and state.finished == DONE


class WritesNowOnlyAtFirst(WritesNowSink):
    """Writable when direct delivery is armed, not any more when tokens come (e.g. the response is ending)."""
    checks = 0

    @property
    def can_write_now(self) -> bool:  # type: ignore[override]  # a plain attribute in the parent
        self.checks += 1
        return self.checks == 1


@pytest.mark.parametrize("sink_class", [WritesNowOnlyAtFirst, WritesNowSink])
async def test_tokens_wait_for_the_request_task_while_the_sink_cannot_write_from_elsewhere(sink_class):
    sink = sink_class(per_token=True)
    if sink_class is WritesNowSink:
        sink.can_write_now = False  # never: e.g. a response over TLS
    await run_handing_over(READS, sink)
    assert sink.written_now == [] and sink.text == "the river and the bridge"


async def test_a_cancelled_request_ends_direct_delivery():
    inbox = TrioInbox()
    sink = WritesNowSink(per_token=True)
    with trio.move_on_after(5) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(stream_output, GenerateStream(inbox),  # type: ignore[arg-type]
                                       progress_of(sink), worker="w"))
            await trio.testing.wait_all_tasks_blocked()
            inbox._items.append(Tokens(WORDS[:1]))
            inbox.hand_over()
            await trio.testing.wait_all_tasks_blocked()
            assert inbox.direct is not None
            nursery.cancel_scope.cancel()  # the client went: its request's nursery is cancelled
    assert not scope.cancelled_caught and inbox.direct is None
    inbox._items.append(Tokens(WORDS[1:2]))
    inbox.hand_over()  # nothing is written for a request that is over
    assert sink.text == "the"


def members_of(protocol) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")} | set(protocol.__annotations__)


def test_every_sink_of_the_frontend_implements_the_whole_narrow_output_sink_protocol():
    """One narrow protocol, no optional methods probed with getattr: what the request's task writes, and a direct
    writer for the part of direct delivery, which a sink that never writes from elsewhere gives as None (no
    method that exists only to raise)."""
    from orchestrator.decode.deltas import DirectWriter, OutputSink
    from orchestrator.frontend.app import _CollectingSink, _Response, _StreamingSink
    from orchestrator.frontend.block_sink import BlockSink

    members = members_of(OutputSink)
    assert members == {"per_token", "deltas", "ending", "finish", "direct"}
    assert members_of(DirectWriter) == {"can_write_now", "deltas_now", "flush"}
    streamed = _StreamingSink(_Response(None, [], send_now=lambda data: True), None, None, None,  # type: ignore[arg-type]
                              per_token=True)
    sinks: list[_StreamingSink | _CollectingSink | BlockSink] = [
        streamed, _StreamingSink(None, None, None, None, per_token=True),  # type: ignore[arg-type]  # members only
        _StreamingSink(_Response(None, []), None, None, None, per_token=True),  # type: ignore[arg-type]  # TLS
        _CollectingSink("chat", None, None), BlockSink(None)]
    for sink in sinks:
        missing = sorted(name for name in members if not hasattr(type(sink), name) and name not in vars(sink))
        assert missing == [], type(sink).__name__
    assert streamed.direct is not None and all(hasattr(streamed.direct, name) for name in members_of(DirectWriter))
    assert [sink.direct for sink in sinks[1:]] == [None] * 4


async def test_tokens_of_a_batch_without_logprobs_get_placeholders_not_their_neighbours():
    later = TokenLogprob(WORDS[1], -0.5)
    sink, _ = await run([Tokens(WORDS[:1]), Tokens(WORDS[1:2], (later,)), DONE], per_token=True)
    assert [lp for _, _, lp in sink.received] == [(TokenLogprob(WORDS[0], None),), (later,)]


@pytest.mark.parametrize(("message", "timed_out", "status"), [("", False, 502), ("generation timed out", True, 504)])
async def test_a_cancel_the_engine_made_is_a_failure_after_the_tokens_before_it(message, timed_out, status):
    """UPSTREAM engine-cancel: both servers map the engine's cancelled and timeout to FINISH_REASON_CANCELLED;
    no client is ever told "cancelled" as a finish reason."""
    from orchestrator.engine.errors import EngineCancelled
    from orchestrator.frontend.errors import to_api_error

    cancel = Finished(FinishReason.FINISH_REASON_CANCELLED, message=message)
    sink = RecordingSink(True)
    state = progress_of(sink)
    with pytest.raises(EngineCancelled) as failed:
        await stream_output(ReplayedStream([Tokens(WORDS[:2]), cancel]), state, worker="w")
    assert sink.text == "the river" and state.completion_tokens == 2 and state.finished is None
    assert failed.value.timed_out is timed_out and failed.value.retryable is not timed_out
    api = to_api_error(failed.value)
    assert api.status == status and "cancelled" in api.message and (not timed_out or "timed out" in api.message)
    assert cancel.reason_name != "cancelled"


class Flow:
    """What holds a request's progress, as the request flow does, with the token meter as its bound method."""

    def __init__(self, sink):
        self.progress = progress_of(sink)
        self.tokens = 0

    def on_chunk(self, tokens: int) -> None:
        self.tokens += tokens


async def test_a_streamed_request_leaves_no_reference_cycle_for_the_garbage_collector():
    """Its flow, progress and sink are freed as the request lets go of them, not at the next collection (a cycle
    per request made the collector's work grow with the requests)."""
    import gc
    import weakref

    from orchestrator.frontend.app import _Response, _StreamingSink

    inbox, sink = TrioInbox(), WritesNowSink(per_token=True)
    flow = Flow(sink)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(stream_output, GenerateStream(inbox), flow.progress,  # type: ignore[arg-type]
                                   worker="w", on_chunk=flow.on_chunk))
        for read in READS:
            await trio.testing.wait_all_tasks_blocked()
            inbox._items.extend(read)  # type: ignore[arg-type]  # (mypy joins the lists of READS to object)
            inbox.hand_over()
    assert flow.tokens == 5 and sink.written_now  # direct delivery ran, with the flow's token meter
    streaming = _StreamingSink(_Response(None, [], send_now=lambda data: True), None, None, None,  # type: ignore[arg-type]
                               per_token=True)
    assert streaming.direct is streaming
    # (a flow in a cycle with its progress would outlive this: StreamProgress, with its slots, takes no weak reference)
    gone: list[weakref.ref] = [weakref.ref(flow), weakref.ref(sink), weakref.ref(streaming)]
    gc.disable()
    try:
        del flow, sink, streaming, nursery
        assert [ref() for ref in gone] == [None, None, None]
    finally:
        gc.enable()
