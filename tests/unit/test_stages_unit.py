"""The two stages, the KV lease rule and the retry rule, against scripted fake workers on trio's MockClock.

No process, no gRPC: every test runs in milliseconds (the autojump_clock fixture skips the waits). Cancellation is
tried at every phase of each stage; afterwards the fakes tell which RPCs were cancelled, what was
aborted, and whether a session was pulled or released.
"""

from __future__ import annotations

import attrs
import pytest
import trio

from orchestrator.convert import parse_chat, serves_features
from orchestrator.decode import StreamProgress
from orchestrator.decode.stage import DecodeLeg, DecodeStage, MidStreamFailure
from orchestrator.engine import EngineError, Failed, Finished, PrefillReady, Tokens, WorkerUnavailable
from orchestrator.engine.events import FinishReason
from orchestrator.errors import NoWorkerAvailable, RequestTimedOut
from orchestrator.flow.plan import PlanPath, WholePlan
from orchestrator.kv import KvLease, generation_leg
from orchestrator.kv.release import KvReleaser
from orchestrator.metrics import Metrics
from orchestrator.models import TINY_CHAT
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.openengine.v1 import kv_pb2
from orchestrator.prefill.stage import PrefillStage
from orchestrator.testkit.plugin import Fail, FakeEngineClient, FakePool, Hang, Send, Wait, fake_worker
from orchestrator.tokenizer import IncrementalDetokenizer, ModelTokenizer
from orchestrator.workers.retry import with_retries

TOKENIZER = ModelTokenizer.from_dir(TINY_CHAT)
WORD = TOKENIZER.encode(" weather")[0]
SESSION = kv_pb2.KvSessionRef(session_id="7", endpoints=[kv_pb2.KvEndpoint(host="10.0.0.1", port=5601)])
DONE = Finished(FinishReason.FINISH_REASON_LENGTH)


def full(rid="r1", max_tokens=3) -> g.GenerateRequest:
    return g.GenerateRequest(request_id=rid, model="m", token_ids=g.TokenIds(ids=[1, 2, 3]),
                             stopping=g.StoppingOptions(max_tokens=max_tokens))


def prefill_script(*steps):
    return lambda request: list(steps)


def decode_tokens(n=3, gap=0.01):
    steps = []
    for _ in range(n):
        steps += [Wait(gap), Send(Tokens((WORD,)))]
    return steps + [Send(DONE)]


class Sink:
    per_token = False
    direct = None  # the fakes' streams hand nothing over directly

    def __init__(self):
        self.text, self.finished = "", None

    async def deltas(self, items):
        self.text += "".join(text for text, _, _ in items)

    def ending(self):
        pass

    async def finish(self, reason, prompt_tokens, completion_tokens, *, cached_tokens=None, stop_text=None):
        self.finished = (reason, completion_tokens)


def deployment(prefill_scripts=(), decode_scripts=(), abort_cleanup=False, retries=1):
    from orchestrator.testkit.fakes import capabilities

    prefills = [FakeEngineClient(f"p{i}", capabilities("prefill", abort_cleanup=abort_cleanup), script)
                for i, script in enumerate(prefill_scripts)]
    decodes = [FakeEngineClient(f"d{i}", capabilities("decode"), script) for i, script in enumerate(decode_scripts)]
    pool = FakePool([fake_worker("prefill", c) for c in prefills] + [fake_worker("decode", c) for c in decodes])
    metrics = Metrics()
    releaser = KvReleaser(pool, metrics, cleanup_timeout_s=5)
    prefill = PrefillStage(pool, metrics, releaser, retries=retries, cleanup_timeout_s=5)
    decode = DecodeStage(pool, metrics, releaser, retries=retries, cleanup_timeout_s=5)
    return pool, prefills, decodes, prefill, decode, releaser, metrics


def workers(pool, role):
    return [w for w in pool.workers if w.role == role]


# ---- the prefill stage --------------------------------------------------------------------------------

async def test_prefill_returns_a_lease_and_holds_back_the_context_token(autojump_clock):
    pool, (p,), _, prefill, *_ = deployment([prefill_script(Wait(0.05), Send(Tokens((WORD,))), Wait(0.01),
                                                              Send(PrefillReady(SESSION)))], [])
    result = await prefill.run(workers(pool, "prefill")[0], full())
    assert result.lease.session == SESSION and not result.lease.settled and not result.answer
    (leg,) = p.generated()
    assert leg.extra["request_type"] == "context_only" and leg.stopping.max_tokens == 1


async def test_a_prefill_that_stops_on_its_token_is_the_answer(autojump_clock):
    pool, _, _, prefill, *_ = deployment([prefill_script(Send(Tokens((WORD,))),
                                                         Send(Finished(FinishReason.FINISH_REASON_STOP)))], [])
    result = await prefill.run(workers(pool, "prefill")[0], full())
    assert result.lease is None and [type(e) for e in result.answer] == [Tokens, Finished]


async def test_a_retryable_prefill_failure_moves_to_another_prefill_worker(autojump_clock):
    busy = EngineError("overloaded", worker="p0", rpc="Generate", retryable=True)
    pool, (p0, p1), _, prefill, _, _, metrics = deployment(
        [prefill_script(Fail(busy)), prefill_script(Send(PrefillReady(SESSION)))], [])
    first = next(w for w in workers(pool, "prefill") if w.client is p0)
    result = await prefill.run(first, full())
    assert result.lease.prefill_worker.client is p1
    assert len(p0.generated()) == len(p1.generated()) == 1
    assert 'orchestrator_retries_total{model="",role="prefill"} 1.0' in metrics.render().decode()


async def test_a_non_retryable_prefill_failure_is_not_retried(autojump_clock):
    wrong = EngineError("bad", worker="p0", rpc="Generate", retryable=False)
    pool, (p0, p1), _, prefill, *_ = deployment([prefill_script(Fail(wrong)), prefill_script(Hang())], [])
    with pytest.raises(EngineError, match="bad"):
        await prefill.run(next(w for w in workers(pool, "prefill") if w.client is p0), full())
    assert p1.generated() == []


@pytest.mark.parametrize("cancel_at", [0.01, 0.06])  # before its token, and after it but before PrefillReady
async def test_a_prefill_cancelled_mid_flight_is_aborted_and_nothing_is_held(cancel_at, autojump_clock):
    pool, (p,), (d,), prefill, *_ = deployment([prefill_script(Wait(0.05), Send(Tokens((WORD,))), Hang())],
                                               [lambda request: decode_tokens(1)])
    with trio.move_on_after(cancel_at):
        await prefill.run(workers(pool, "prefill")[0], full())
    assert p.aborts == ["r1"] and p.cancelled == ["r1"], (p.aborts, p.cancelled, p.calls)
    assert d.generated() == []  # no session appeared, so nothing to release


@pytest.mark.parametrize("abort_cleanup", [False, True])
async def test_a_prefill_that_finishes_while_being_cancelled_releases_its_session(abort_cleanup, autojump_clock):
    """The abort raced the handoff: the session exists, and a release leg pulls it, even where the worker
    advertises abort by session (an answered abort is not proof the blocks were freed)."""
    def script(request):
        return [Wait(0.05), Send(PrefillReady(SESSION))]

    pool, (p,), (d,), prefill, *_ = deployment([script], [lambda request: decode_tokens(1)],
                                               abort_cleanup=abort_cleanup)
    with trio.move_on_after(0.01):
        await prefill.run(workers(pool, "prefill")[0], full())
    assert p.aborts == ["r1"]  # by request id only, never by session
    (release,) = d.generated()
    assert release.request_id == "r1-kv-release" and release.kv.session == SESSION
    assert release.stopping == g.StoppingOptions(max_tokens=1)


# ---- the decode stage ---------------------------------------------------------------------------------

async def run_decode(decode, worker, leg, lease=None):
    sink = Sink()
    progress = StreamProgress(sink, IncrementalDetokenizer(TOKENIZER))
    await decode.run(DecodeLeg(worker, leg, 3, on_chunk=lambda tokens: None, lease=lease), progress)
    return sink, progress


def lease_on(pool):
    return KvLease(workers(pool, "prefill")[0], SESSION)


async def test_decode_streams_the_text_and_marks_the_lease_pulled(autojump_clock):
    pool, _, (d,), _, decode, *_ = deployment([prefill_script()], [lambda request: decode_tokens(3)])
    lease = lease_on(pool)
    sink, _state = await run_decode(decode, workers(pool, "decode")[0], generation_leg(full(), SESSION), lease)
    assert sink.text == " weather weather weather" and sink.finished == ("length", 3)
    assert lease.pulled and d.cancelled == [] and d.aborts == []


async def test_a_retryable_decode_failure_before_the_first_token_moves_to_another_decode_worker(autojump_clock):
    gone = WorkerUnavailable("gone", worker="d0", rpc="Generate", retryable=True)
    pool, _, (d0, d1), _, decode, *_ = deployment([prefill_script()], [lambda r: [Fail(gone)],
                                                                        lambda r: decode_tokens(2)])
    first = next(w for w in workers(pool, "decode") if w.client is d0)
    sink, _ = await run_decode(decode, first, generation_leg(full(), SESSION), lease_on(pool))
    assert sink.finished == ("length", 2) and [w.client for w, _ in pool.unreachable] == [d0]
    assert d1.generated()[0].kv.session == SESSION  # the retry pulls the same session


async def test_a_retry_goes_only_to_a_worker_that_serves_the_requests_features(autojump_clock):
    """The planner checks the guide against the first workers; a retry must not land where it is ignored."""
    from orchestrator.engine.capabilities import FeatureSupport
    from orchestrator.testkit.fakes import capabilities

    gone = WorkerUnavailable("gone", worker="d0", rpc="Generate", retryable=True)
    pool, _, (d0, guided, plain), _, decode, *_ = deployment(
        [prefill_script()], [lambda r: [Fail(gone)], lambda r: decode_tokens(2), lambda r: decode_tokens(2)])
    guided.caps = attrs.evolve(capabilities("decode"), guided_decoding=FeatureSupport(True))
    api = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                      "response_format": {"type": "json_object"}})
    first = next(w for w in workers(pool, "decode") if w.client is d0)
    sink = Sink()
    await decode.run(DecodeLeg(first, generation_leg(full(), SESSION), 3, on_chunk=lambda tokens: None,
                               lease=lease_on(pool), accepts=lambda w: serves_features(api, w.client.caps)),
                     StreamProgress(sink, IncrementalDetokenizer(TOKENIZER)))
    assert sink.finished == ("length", 2) and plain.generated() == [] and len(guided.generated()) == 1


async def test_a_failure_after_tokens_were_streamed_is_not_retried_but_left_to_the_flow_to_migrate(autojump_clock):
    broken = EngineError("lost", worker="d0", rpc="Generate", retryable=True)
    pool, _, (d0, d1), _, decode, *_ = deployment([prefill_script()], [
        lambda r: [Send(Tokens((WORD,))), Fail(broken)], lambda r: decode_tokens(2)])
    first = next(w for w in workers(pool, "decode") if w.client is d0)
    with pytest.raises(MidStreamFailure, match="lost") as failure:
        await run_decode(decode, first, full())
    assert d1.generated() == []
    migrated = [(failure.value.error.message, failure.value.worker.client.name)]
    assert migrated == [("lost", "d0")]


@pytest.mark.parametrize("abort_cleanup", [False, True])
async def test_decode_cancelled_before_its_first_token_is_kept_until_it_pulled(abort_cleanup, autojump_clock):
    """Even where the prefill worker advertises supports_abort_cleanup: the sibling server answers an abort by
    session ABORTED without freeing anything once the context request finished, so only a pull is proof."""
    pool, (p,), (d,), _, decode, *_ = deployment([prefill_script()], [lambda r: [Wait(0.2), *decode_tokens(3)]],
                                                 abort_cleanup=abort_cleanup)
    lease = lease_on(pool)
    with trio.move_on_after(0.05):
        await run_decode(decode, workers(pool, "decode")[0], generation_leg(full(), SESSION), lease)
    assert p.aborts == [] and lease.pulled and not lease.released  # the decode worker holds the KV now
    assert d.aborts == ["r1-gen"] and d.cancelled == ["r1-gen"]  # and the decode leg itself is let go


async def test_decode_cancelled_mid_stream_aborts_the_leg_and_leaves_the_lease_alone(autojump_clock):
    pool, (p,), (d,), _, decode, *_ = deployment([prefill_script()], [lambda r: decode_tokens(10, gap=0.05)])
    lease = lease_on(pool)
    with trio.move_on_after(0.12):
        await run_decode(decode, workers(pool, "decode")[0], generation_leg(full(max_tokens=10), SESSION), lease)
    assert lease.pulled and p.aborts == [] and d.aborts == ["r1-gen"] and d.cancelled == ["r1-gen"]


# ---- the releaser and the retry rule ------------------------------------------------------------------

async def test_the_releaser_tries_the_next_decode_worker_when_a_release_leg_fails(autojump_clock):
    failing = EngineError("injected", worker="d0", rpc="Generate")
    pool, (_p,), (d0, d1), _, _, releaser, metrics = deployment(
        [prefill_script()], [lambda r: [Send(Failed(failing))], lambda r: decode_tokens(1)])
    lease = lease_on(pool)
    await releaser.release_unpulled(lease, full(), next(w for w in workers(pool, "decode") if w.client is d0))
    assert lease.released and [r.request_id for r in d1.generated()] == ["r1-kv-release"]
    assert 'orchestrator_kv_cleanups_total{model="",way="decode_pull"} 1.0' in metrics.render().decode()


async def test_the_releaser_leaves_a_settled_lease_alone(autojump_clock):
    pool, (p,), (d,), _, _, releaser, _ = deployment([prefill_script()], [lambda r: decode_tokens(1)])
    lease = lease_on(pool)
    lease.pulled = True
    await releaser.release_unpulled(lease, full(), workers(pool, "decode")[0])
    assert d.generated() == [] and p.aborts == []


async def test_retries_stop_at_the_limit_and_keep_the_original_error_when_no_worker_is_left(autojump_clock):
    pool = FakePool([fake_worker("decode", FakeEngineClient(f"d{i}")) for i in range(3)])
    seen = []

    async def attempt(worker):
        seen.append(worker.address)
        raise EngineError(f"busy {worker.address}", worker=worker.address, rpc="Generate", retryable=True)

    with pytest.raises(EngineError, match="busy"):
        await with_retries(pool, pool.workers[0], attempt, retries=1, metrics=Metrics(), what="leg")
    assert len(seen) == 2 and len(set(seen)) == 2  # one retry, on another worker
    alone = FakePool([fake_worker("decode", FakeEngineClient("only"))])
    with pytest.raises(EngineError, match="busy grpc://only"):
        await with_retries(alone, alone.workers[0], attempt, retries=3, metrics=Metrics(), what="leg")
    with pytest.raises(NoWorkerAvailable):
        alone.pick("prefill")


# ---- the coordinator over the fakes ---------------------------------------------------------------------

def coordinator(tmp_path, mode, pool, **sections):
    from orchestrator import config as config_module
    from orchestrator.flow.coordinator import Coordinator
    from orchestrator.testkit.plugin import write_config

    config = config_module.load(write_config(tmp_path / "c.yaml", mode, {}, **sections))
    return Coordinator(config, pool, TOKENIZER, Metrics())


def chat(**extra):
    from orchestrator.convert import parse_chat

    return parse_chat({"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                       **extra})


async def test_a_disaggregated_request_through_the_coordinator(tmp_path, autojump_clock):
    from orchestrator.testkit.fakes import capabilities

    prefill = FakeEngineClient("p0", capabilities(), lambda r: [Wait(0.02), Send(Tokens((WORD,))),
                                                                Send(PrefillReady(SESSION))])
    decode = FakeEngineClient("d0", capabilities(), lambda r: decode_tokens(3))
    pool = FakePool([fake_worker("prefill", prefill), fake_worker("decode", decode)])
    c = coordinator(tmp_path, "disaggregated", pool)
    plan = await c.plan(chat(conversation_id="conv-1"), "e1")
    sink = Sink()
    await c.execute(plan, sink)
    assert sink.text == " weather weather weather" and sink.finished == ("length", 3)
    (ctx,), (gen,) = prefill.generated(), decode.generated()
    assert ctx.extra["request_type"] == "context_only" and gen.kv.session == SESSION
    assert ctx.extra["conversation_id"] == gen.extra["conversation_id"] == "conv-1"
    assert prefill.cancelled == decode.cancelled == []


async def test_a_disaggregated_request_whose_decode_fails_releases_its_session(tmp_path, autojump_clock):
    from orchestrator.testkit.fakes import capabilities

    wrong = EngineError("bad", worker="d0", rpc="Generate")
    prefill = FakeEngineClient("p0", capabilities(), lambda r: [Send(PrefillReady(SESSION))])
    broken = FakeEngineClient("d0", capabilities(), lambda r: [Fail(wrong)])
    healthy = FakeEngineClient("d1", capabilities(), lambda r: decode_tokens(1))
    pool = FakePool([fake_worker("prefill", prefill), fake_worker("decode", broken), fake_worker("decode", healthy)])
    c = coordinator(tmp_path, "disaggregated", pool)
    plan = await c.plan(chat(), "e2")
    plan = attrs.evolve(plan, decode=pool.workers[1])  # route to the broken decode worker
    with pytest.raises(EngineError, match="bad"):
        await c.execute(plan, Sink())
    releases = [r.request_id for r in broken.generated() + healthy.generated() if r.request_id.endswith("release")]
    assert releases == ["e2-kv-release", "e2-kv-release"]  # the broken one first, then the healthy one pulled


async def test_a_decode_worker_lost_after_the_last_token_ends_the_answer_without_a_migration(tmp_path,
                                                                                             autojump_clock):
    """Found by test_migration_e2e: a worker SIGKILLed between its last token and its finish made the continuation
    ask for max(1, 0) tokens, so the client got max_tokens + 1."""
    from orchestrator.testkit.fakes import capabilities

    lost = WorkerUnavailable("gone", worker="d0", rpc="Generate", retryable=True)
    prefill = FakeEngineClient("p0", capabilities(), lambda r: [Send(Tokens((WORD,))), Send(PrefillReady(SESSION))])
    dying = FakeEngineClient("d0", capabilities(), lambda r: [Send(Tokens((WORD,)))] * 3 + [Fail(lost)])
    spare = FakeEngineClient("d1", capabilities(), lambda r: decode_tokens(3))
    pool = FakePool([fake_worker("prefill", prefill), fake_worker("decode", dying), fake_worker("decode", spare)])
    c = coordinator(tmp_path, "disaggregated", pool)
    plan = await c.plan(chat(), "e3")
    plan = attrs.evolve(plan, decode=pool.workers[1])  # route to the dying decode worker
    sink = Sink()
    await c.execute(plan, sink)
    assert sink.text == " weather weather weather" and sink.finished == ("length", 3)
    assert spare.generated() == [] and len(prefill.generated()) == 1  # no continuation anywhere


async def test_an_answer_finished_here_after_a_lost_worker_keeps_the_text_held_back_for_a_stop_string(
        tmp_path, autojump_clock):
    """The last " weather" could begin the stop string, so the detokenizer held it back; the worker was lost
    before its finish, and the answer finished here without it."""
    from orchestrator.testkit.fakes import capabilities

    lost = WorkerUnavailable("gone", worker="d0", rpc="Generate", retryable=True)
    prefill = FakeEngineClient("p0", capabilities(), lambda r: [Send(Tokens((WORD,))), Send(PrefillReady(SESSION))])
    dying = FakeEngineClient("d0", capabilities(), lambda r: [Send(Tokens((WORD,)))] * 3 + [Fail(lost)])
    pool = FakePool([fake_worker("prefill", prefill), fake_worker("decode", dying)])
    c = coordinator(tmp_path, "disaggregated", pool)
    plan = await c.plan(chat(stop=[" weatherman"]), "e4")
    sink = Sink()
    await c.execute(plan, sink)
    assert sink.text == " weather weather weather" and sink.finished == ("length", 3)


@pytest.mark.parametrize("revision", [1, 3])
async def test_conditional_mode_prefills_on_a_prefill_worker_when_decode_is_the_sibling_server(
        tmp_path, revision, autojump_clock):
    """A declared decode role that packs its handoff under a named profile (TensorRT-LLM's sibling server)
    refuses a request without a KV session. Gated on those fields, whatever schema_revision says: upstream
    relabelled the sibling server's fields revision 1."""
    from orchestrator.kv import TRTLLM_HANDOFF_PROFILE
    from orchestrator.testkit.fakes import capabilities

    sibling = {"schema_revision": revision, "handoff_profile": TRTLLM_HANDOFF_PROFILE}
    prefill = FakeEngineClient("p0", capabilities("prefill", **sibling), lambda r: [Send(PrefillReady(SESSION))])
    decode = FakeEngineClient("d0", capabilities("decode", **sibling), lambda r: decode_tokens(1))
    pool = FakePool([fake_worker("prefill", prefill), fake_worker("decode", decode)])
    c = coordinator(tmp_path, "conditional", pool, conditional={"max_local_prefill_length": 4096})
    assert (await c.plan(chat(), "e3")).path == "disaggregated"
    decode.caps = capabilities("unspecified")
    assert (await c.plan(chat(), "e4")).path == "local"
    decode.caps = capabilities("decode", schema_revision=3)  # a declared decode role without the profile
    assert (await c.plan(chat(), "e5")).path == "local"


async def timed_request(tmp_path, script, request_id):
    """One aggregated worker running `script`, a coordinator whose request_timeout_s is 2, and a planned chat."""
    from orchestrator.testkit.fakes import capabilities

    worker = FakeEngineClient("d0", capabilities(), script)
    c = coordinator(tmp_path, "aggregated", FakePool([fake_worker("aggregated", worker)]),
                    limits={"request_timeout_s": 2.0})
    return worker, c, await c.plan(chat(), request_id)


async def test_a_request_past_request_timeout_s_is_a_timeout_and_its_leg_is_left(tmp_path, autojump_clock):
    decode, c, plan = await timed_request(tmp_path, lambda r: [Send(Tokens((WORD,))), Hang()], "e4")
    sink = Sink()
    started = trio.current_time()
    with pytest.raises(RequestTimedOut, match="within 2 s"):
        await c.execute(plan, sink)
    assert trio.current_time() - started == pytest.approx(2.0)
    assert sink.text == " weather" and decode.cancelled == ["e4"]


async def test_a_request_cancelled_by_its_watch_is_not_a_timeout(tmp_path, autojump_clock):
    """The client went: execute returns (the caller knows it was the watch) and the leg is left."""
    decode, c, plan = await timed_request(tmp_path, lambda r: [Send(Tokens((WORD,))), Hang()], "e5")

    def watch(request: trio.Nursery) -> None:
        async def client_goes() -> None:
            await trio.sleep(0.5)
            request.cancel_scope.cancel()

        request.start_soon(client_goes)

    await c.execute(plan, Sink(), watch=watch)
    assert decode.cancelled == ["e5"]


async def test_a_request_that_ends_in_time_leaves_no_deadline_or_watcher_behind(tmp_path, autojump_clock):
    decode, c, plan = await timed_request(tmp_path, lambda r: decode_tokens(3, gap=0.5), "e6")
    watching: list[trio.Nursery] = []
    sink = Sink()

    def watch(request: trio.Nursery) -> None:
        watching.append(request)
        request.start_soon(trio.sleep_forever)

    await c.execute(plan, sink, watch=watch)
    assert sink.finished == ("length", 3) and decode.cancelled == []
    assert watching[0].child_tasks == frozenset()  # the watcher was stopped when the flow ended
    await trio.sleep(5)  # past the request's deadline: nothing of it is left to fire


async def test_a_cancellation_from_outside_propagates_and_is_not_a_timeout(tmp_path, autojump_clock):
    decode, c, plan = await timed_request(tmp_path, lambda r: [Send(Tokens((WORD,))), Hang()], "e7")
    with trio.move_on_after(0.5) as outside:
        await c.execute(plan, Sink())
    assert outside.cancelled_caught and decode.cancelled == ["e7"]


async def test_a_request_whose_answer_completes_after_its_deadline_passed_is_not_a_timeout(tmp_path, autojump_clock):
    """The deadline passed while the answer's end was being written under a shield: the answer is whole,
    though a watcher task (plain ASGI) is cancelled after it, in the nursery whose deadline has passed."""

    class SlowFinish(Sink):
        async def finish(self, reason, prompt_tokens, completion_tokens, *, cached_tokens=None, stop_text=None):
            with trio.CancelScope(shield=True):
                await trio.sleep(3)
            await super().finish(reason, prompt_tokens, completion_tokens, cached_tokens=cached_tokens)

    _, c, plan = await timed_request(tmp_path, lambda r: decode_tokens(3), "e8")
    sink = SlowFinish()
    await c.execute(plan, sink, watch=lambda request: request.start_soon(trio.sleep_forever))
    assert sink.finished == ("length", 3) and trio.current_time() > 2.0


# ---- migration: a loop in the request flow ----------------------------------------------------------------

def aggregated_workers(*scripts):
    from orchestrator.testkit.fakes import capabilities

    clients = [FakeEngineClient(f"a{i}", capabilities(), script) for i, script in enumerate(scripts)]
    return clients, FakePool([fake_worker("aggregated", client) for client in clients])


def breaks_after(tokens: int, name: str):
    lost = WorkerUnavailable("gone", worker=name, rpc="Generate", retryable=True)
    return lambda r: [Send(Tokens((WORD,)))] * tokens + [Fail(lost)]


async def test_a_request_migrates_again_when_its_continuation_breaks_too_up_to_the_limit(tmp_path, autojump_clock):
    (_, a1, a2), pool = aggregated_workers(breaks_after(1, "a0"), breaks_after(1, "a1"), lambda r: decode_tokens(1))
    c = coordinator(tmp_path, "aggregated", pool, limits={"migration_limit": 2})
    plan = attrs.evolve(await c.plan(chat(), "e7"), worker=pool.workers[0])
    sink = Sink()
    await c.execute(plan, sink)
    assert sink.text == " weather weather weather" and sink.finished == ("length", 3)
    assert [r.request_id for r in a1.generated() + a2.generated()] == ["e7-m1", "e7-m2"]
    assert list(a2.generated()[0].token_ids.ids[-2:]) == [WORD, WORD]  # the prompt plus both tokens sent

    (_, b1, b2), pool = aggregated_workers(breaks_after(1, "b0"), breaks_after(1, "b1"), lambda r: decode_tokens(1))
    c = coordinator(tmp_path, "aggregated", pool, limits={"migration_limit": 1})
    plan = attrs.evolve(await c.plan(chat(), "e8"), worker=pool.workers[0])
    with pytest.raises(WorkerUnavailable, match="gone"):
        await c.execute(plan, Sink())
    assert len(b1.generated()) + len(b2.generated()) == 1  # one migration, then the error stands


async def test_a_migrated_request_counts_its_decode_stage_once(tmp_path, autojump_clock):
    """Its stage durations are the request's, observed once when it ends, not once per pass of the loop."""
    _, pool = aggregated_workers(breaks_after(1, "a0"), lambda r: decode_tokens(2))
    c = coordinator(tmp_path, "aggregated", pool)
    plan = attrs.evolve(await c.plan(chat(), "e9"), worker=pool.workers[0])
    await c.execute(plan, Sink())
    rendered = c.metrics.render().decode()
    assert 'orchestrator_stage_duration_seconds_count{model="",stage="decode"} 1.0' in rendered


# ---- conditional mode's local path: a replacement must run the whole request on decode -------------------

def sibling_decode(name: str) -> FakeEngineClient:
    """A declared decode role with the handoff profile (TensorRT-LLM's sibling server): it refuses a request
    without a KV session, as the real one does (and as the simulated worker in that role does)."""
    from orchestrator.engine.errors import ErrorCode
    from orchestrator.kv import TRTLLM_HANDOFF_PROFILE
    from orchestrator.testkit.fakes import capabilities

    refused = EngineError("Decode requests require a prefill KV session", worker=name, rpc="Generate",
                          code=ErrorCode.ERROR_CODE_INVALID_ARGUMENT)
    return FakeEngineClient(name, capabilities("decode", handoff_profile=TRTLLM_HANDOFF_PROFILE),
                            lambda r: decode_tokens(3) if r.kv.HasField("session") else [Fail(refused)])


def local_request_pool(*decodes: FakeEngineClient) -> FakePool:
    from orchestrator.testkit.fakes import capabilities

    prefill = FakeEngineClient("p0", capabilities("prefill"), lambda r: [Send(PrefillReady(SESSION))])
    return FakePool([fake_worker("prefill", prefill), *[fake_worker("decode", client) for client in decodes]])


def local_on(plan, worker) -> WholePlan:
    """The planned request on conditional mode's local path, on `worker`, whichever path the planner chose."""
    return WholePlan(request_id=plan.request_id, api=plan.api, full=plan.full, prompt_tokens=plan.prompt_tokens,
                     path=PlanPath.LOCAL, worker=worker)


class Undiscovered(FakeEngineClient):
    """A worker routable while its capabilities are not known (its discovery failed after it was READY)."""

    @property
    def cached_capabilities(self):
        return None


@pytest.mark.parametrize("left", ["sibling", "undiscovered"])
@pytest.mark.parametrize("tokens_sent", [0, 1], ids=["retry", "migration"])
async def test_a_local_request_never_moves_to_a_decode_worker_that_cannot_run_it_whole(tmp_path, tokens_sent, left,
                                                                                         autojump_clock):
    """A local request whose decode worker fails, before its first token (a retry) or after it (a migration),
    with only a decode worker left that refuses a request without a KV session (the sibling server), or that
    is not known not to: the original error stands, that worker is not asked, the client gets no finish
    besides the error, and no worker is left leased."""
    from orchestrator.testkit.fakes import capabilities

    dying = FakeEngineClient("d0", capabilities(), breaks_after(tokens_sent, "d0"))
    other = sibling_decode("d1") if left == "sibling" else Undiscovered("d1", script=lambda r: decode_tokens(3))
    pool = local_request_pool(dying, other)
    c = coordinator(tmp_path, "conditional", pool, conditional={"max_local_prefill_length": 4096})
    # local, on the dying worker (the planner may have picked the other one and split the request)
    plan = local_on(await c.plan(chat(), "e10"), pool.workers[1])
    sink = Sink()
    with pytest.raises(WorkerUnavailable, match="gone"):
        await c.execute(plan, sink)
    assert other.generated() == [] and sink.finished is None
    assert sink.text == " weather" * tokens_sent
    assert [w.inflight for w in pool.workers] == [0, 0, 0]


@pytest.mark.parametrize("tokens_sent", [0, 1], ids=["retry", "migration"])
async def test_a_local_request_moves_past_a_sibling_decode_worker_to_one_that_runs_it_whole(tmp_path, tokens_sent,
                                                                                             autojump_clock):
    from orchestrator.testkit.fakes import capabilities

    dying = FakeEngineClient("d0", capabilities(), breaks_after(tokens_sent, "d0"))
    spare = FakeEngineClient("d1", capabilities(), lambda r: decode_tokens(3 - tokens_sent))
    siblings = [sibling_decode(f"d{i}") for i in (2, 3, 4)]
    pool = local_request_pool(dying, spare, *siblings)
    c = coordinator(tmp_path, "conditional", pool, conditional={"max_local_prefill_length": 4096},
                    limits={"decode_retries": 1, "migration_limit": 1})
    plan = local_on(await c.plan(chat(), "e11"), pool.workers[1])
    sink = Sink()
    await c.execute(plan, sink)
    assert sink.text == " weather weather weather" and sink.finished == ("length", 3)
    assert [s.generated() for s in siblings] == [[], [], []]
    assert [r.request_id for r in spare.generated()] == ["e11" if tokens_sent == 0 else "e11-m1"]
