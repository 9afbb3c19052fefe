"""The simulated TRT-LLM worker, as real processes, through the real engine client.

Its default persona is TensorRT-LLM's revision-1 OpenEngine server; the behaviours that come from
upstream are cited in tests/e2e/test_trtllm_conformance.py. Here: the cost model, the KV store, faults.
"""

import signal

import grpc
import pytest
import trio

from orchestrator.engine import EngineError, ErrorCode, WorkerUnavailable
from orchestrator.engine.numbering import Health
from orchestrator.kv import generation_leg
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.openengine.v1 import lifecycle_pb2
from orchestrator.prefill import context_only_leg
from orchestrator.testkit.plugin import wait_for_load
from sim_helpers import (
    Failed,
    Finished,
    PrefillReady,
    Tokens,
    collect,
    data_uri,
    full_request,
    png_bytes,
    refusal,
    run_disaggregated,
    terminal,
    token_ids,
    with_placeholders,
)

FAST = ("--time-scale", "0")


def attr(load, name):
    return load.attributes.fields[name].number_value


@pytest.fixture
def trio_of_workers(sim_workers):
    return (sim_workers.start("aggregated", *FAST), sim_workers.start("prefill", *FAST),
            sim_workers.start("decode", *FAST))


async def test_disaggregated_output_equals_aggregated_token_for_token(trio_of_workers, engine_client):
    agg, pre, dec = trio_of_workers
    async with engine_client(agg.address) as a, engine_client(pre.address) as p, engine_client(dec.address) as d:
        for seed, ids in [(1, (11, 12, 13)), (2, (11, 12, 13)), (1, tuple(range(40, 90)))]:
            full = full_request(f"r{seed}-{len(ids)}", ids=ids, seed=seed, max_tokens=24)
            agg_events = await collect(a, full)
            ctx_events, gen_events = await run_disaggregated(p, d, full)
            assert [type(e) for e in ctx_events] == [Tokens, PrefillReady]  # the first token, held back by us
            assert token_ids(gen_events) == token_ids(agg_events) and len(token_ids(agg_events)) == 24
            assert terminal(gen_events).usage.completion_tokens == 24
        # a different seed gives different output
        first = token_ids(await collect(a, full_request("s1", seed=1)))
        assert first != token_ids(await collect(a, full_request("s2", seed=2)))


async def test_kv_session_is_held_until_pulled_then_released(trio_of_workers, engine_client):
    _, pre, dec = trio_of_workers
    async with engine_client(pre.address) as p, engine_client(dec.address) as d:

        full = full_request("held", max_tokens=4)
        ready = terminal(await collect(p, context_only_leg(full)))
        session = ready.kv_session
        assert session.session_id.isdigit() and session.endpoints[0].port > 0
        assert set(session.attributes_struct.fields) == {"ctx_info_endpoint", "ctx_dp_rank", "opaque_state",
                                                         "first_gen_tokens", "disagg_request_id", "ctx_usage",
                                                         "schedule_style"}
        load = await p.load()
        assert load.active_kv_sessions == 1 and load.used_kv_blocks > 0 and load.running_requests == 0
        events = await collect(d, generation_leg(full, session))
        assert isinstance(terminal(events), Finished)
        load = await p.load()
        assert load.active_kv_sessions == 0 and load.used_kv_blocks == 0 and attr(load, "kv_sessions_pulled") == 1
        # pulling the same session again: it is gone
        again = await collect(d, generation_leg(full_request("held-2", max_tokens=4), session))
        assert terminal(again).error.code == ErrorCode.ERROR_CODE_KV_SESSION_NOT_FOUND


async def test_an_unpulled_session_expires_after_the_transfer_timeout(sim_workers, engine_client):
    pre = sim_workers.start("prefill", *FAST, "--kv-transfer-timeout", "0.5")
    dec = sim_workers.start("decode", *FAST)
    async with engine_client(pre.address) as p, engine_client(dec.address) as d:

        full = full_request("late")
        ready = terminal(await collect(p, context_only_leg(full)))
        load = await wait_for_load(p, lambda info: info.active_kv_sessions == 0, timeout=5)
        assert load.used_kv_blocks == 0 and attr(load, "kv_sessions_expired") == 1
        events = await collect(d, generation_leg(full, ready.kv_session))
        assert terminal(events).error.code == ErrorCode.ERROR_CODE_KV_SESSION_NOT_FOUND


async def test_a_decode_whose_prompt_or_media_differ_from_the_prefill_is_refused(trio_of_workers, engine_client):
    _, pre, dec = trio_of_workers
    async with engine_client(pre.address) as p, engine_client(dec.address) as d:
        def other_prompt(leg):
            leg.token_ids.ids.append(99)

        def other_media(leg):
            leg.media.add(modality=g.MODALITY_IMAGE, data_uri=data_uri(png_bytes()), uuid="sneaky")

        def lost_first_token(leg):
            del leg.kv.session.attributes_struct["first_gen_tokens"]

        for name, mutate in [("prompt", other_prompt), ("first", lost_first_token)]:
            _, events = await run_disaggregated(p, d, full_request(f"mm-{name}"), mutate_decode=mutate)
            assert isinstance(terminal(events), Failed), name
            assert terminal(events).error.code == ErrorCode.ERROR_CODE_KV_TRANSFER_FAILED, name
        # media on a revision-1 worker: refused before anything else (TensorRT-LLM has no media there)
        full = full_request("mm-media")
        ready = terminal((await run_disaggregated(p, d, full))[0])
        leg = generation_leg(full, ready.kv_session)
        other_media(leg)
        assert (await refusal(d, leg)).code == ErrorCode.ERROR_CODE_UNSUPPORTED_FEATURE


async def test_strict_persona_roles_are_strict_and_decode_runs_whole_requests_locally(sim_workers, engine_client):
    strict = ("--persona", "strict", *FAST)
    agg, pre, dec = (sim_workers.start(role, *strict) for role in ("aggregated", "prefill", "decode"))
    async with engine_client(pre.address) as p, engine_client(dec.address) as d, engine_client(agg.address) as a:
        wrong = terminal(await collect(p, full_request("full-on-prefill")))
        assert wrong.error.code == ErrorCode.ERROR_CODE_ROLE_MISMATCH

        ctx_on_decode = terminal(await collect(d, context_only_leg(full_request("ctx-on-decode"))))
        assert ctx_on_decode.error.code == ErrorCode.ERROR_CODE_ROLE_MISMATCH
        # conditional disaggregation: no kv.session on a decode worker = prefill + decode locally
        local = await collect(d, full_request("local", max_tokens=6))
        assert token_ids(local) == token_ids(await collect(a, full_request("agg", max_tokens=6)))
        ctx_events, gen_events = await run_disaggregated(p, d, full_request("strict-disagg", max_tokens=6))
        assert [type(e) for e in ctx_events] == [PrefillReady] and token_ids(gen_events) == token_ids(local)


async def test_images_expand_into_prompt_tokens_and_count_against_the_window(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", *FAST, "--schema-revision", "3", "--max-context-length", "1100")
    image = g.MediaItem(modality=g.MODALITY_IMAGE, data_uri=data_uri(png_bytes()))
    ids = (11, 12, 13, 14)
    async with engine_client(worker.address) as client:
        one = terminal(await collect(client, full_request("img1", ids=with_placeholders(ids, 1), media=[image],
                                                          max_tokens=4)))
        assert one.usage.prompt_tokens == 5 + 576
        too_long = await refusal(client, full_request("img2", ids=with_placeholders(ids, 2), media=[image, image],
                                                      max_tokens=4))
        assert too_long.code == ErrorCode.ERROR_CODE_INVALID_ARGUMENT
        assert "1158 tokens" in too_long.message and "1100" in too_long.message
        not_an_image = g.MediaItem(modality=g.MODALITY_IMAGE, data_uri=data_uri(b"GIF? no, plain text"))
        bad = await refusal(client, full_request("img3", ids=with_placeholders(ids, 1), media=[not_an_image]))
        assert bad.code == ErrorCode.ERROR_CODE_INVALID_ARGUMENT and "PNG, JPEG" in bad.message
        unplaced = await refusal(client, full_request("img4", ids=ids, media=[image]))
        assert "0 image placeholder(s) (<|image|>) but the request carries 1 image(s)" in unplaced.message


async def test_stopping_options_min_tokens_stop_ids_eos_and_ignore_eos(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", *FAST, "--eos-probability", "0.3")
    async with engine_client(worker.address) as client:
        ends = [terminal(await collect(client, full_request(f"e{i}", seed=i, max_tokens=40))) for i in range(8)]
        eos = [e for e in ends if e.reason_name == "stop"]
        assert eos and all(e.stop_token_id is not None for e in eos)
        ignored = await collect(client, full_request("ign", seed=0, max_tokens=40, ignore_eos=True))
        assert len(token_ids(ignored)) == 40 and terminal(ignored).reason_name == "length"
        held = await collect(client, full_request("min", seed=0, max_tokens=40, min_tokens=30))
        assert len(token_ids(held)) >= 30
        first = token_ids(ignored)[3]
        stopped = await collect(client, full_request("stop", seed=0, max_tokens=40, ignore_eos=True,
                                                     conditions=[g.StopCondition(stop_token_id=first)]))
        assert terminal(stopped).stop_token_id == first and first not in token_ids(stopped)


async def test_get_load_is_truthful_while_running_and_after(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", "--time-scale", "1")
    async with engine_client(worker.address) as client:
        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(collect, client, full_request(f"load{i}", max_tokens=60))
            busy = await wait_for_load(client, lambda info: info.running_requests == 5)
            assert busy.used_kv_blocks > 0 and busy.decode_batch_size >= 1
        idle = await client.load()
        assert idle.running_requests == 0 and idle.queued_requests == 0
        assert idle.active_kv_sessions == 0 and idle.used_kv_blocks == 0


async def test_kv_capacity_queues_requests_until_blocks_come_back(sim_workers, engine_client):
    # 4 blocks of 32 tokens: one request of 5 + 100 tokens needs all of them, the next one waits. As TensorRT-LLM
    # reports it (UPSTREAM load-kv), running_requests counts the waiting one and queued_requests stays unset.
    worker = sim_workers.start("aggregated", "--time-scale", "0.5", "--total-kv-blocks", "4")
    async with engine_client(worker.address) as client:
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(collect, client, full_request(f"q{i}", max_tokens=100))
            load = await wait_for_load(client, lambda info: info.running_requests == 2 and info.decode_batch_size == 1)
            assert load.used_kv_blocks == 4 and not load.HasField("queued_requests")
        assert (await client.load()).used_kv_blocks == 0


async def test_fault_crash_after_tokens_kills_the_process(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", *FAST, "--crash-after-tokens", "5")
    async with engine_client(worker.address) as client:
        with pytest.raises(WorkerUnavailable):
            await collect(client, full_request("boom", max_tokens=50))
    worker.process.process.wait(10)
    assert worker.process.process.returncode == 3


async def test_fault_stall_hangs_the_stream_and_cancel_still_frees_it(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", *FAST, "--stall-after-tokens", "3")
    async with engine_client(worker.address) as client:
        got = []
        with trio.move_on_after(1.0) as scope:
            async with client.generate(full_request("stall", max_tokens=50)) as stream:
                async for event in stream:
                    got.append(event)
        assert scope.cancelled_caught and len(token_ids(got)) == 3
        load = await wait_for_load(client, lambda info: info.running_requests == 0)
        assert load.used_kv_blocks == 0


async def test_fault_drop_kv_sessions_gives_session_not_found(sim_workers, engine_client):
    pre = sim_workers.start("prefill", *FAST, "--drop-kv-sessions")
    dec = sim_workers.start("decode", *FAST)
    async with engine_client(pre.address) as p, engine_client(dec.address) as d:
        _, events = await run_disaggregated(p, d, full_request("dropped"))
        assert terminal(events).error.code == ErrorCode.ERROR_CODE_KV_SESSION_NOT_FOUND
        assert (await p.load()).used_kv_blocks == 0


async def test_fault_error_rate_applies_to_the_chosen_phase_only(sim_workers, engine_client):
    pre = sim_workers.start("prefill", *FAST)
    dec = sim_workers.start("decode", *FAST, "--error-rate", "1", "--error-phase", "decode",
                            "--error-code", "ERROR_CODE_KV_TRANSFER_FAILED")
    async with engine_client(pre.address) as p, engine_client(dec.address) as d:
        local = await collect(d, full_request("local-ok", max_tokens=3))  # aggregated phase: unaffected
        assert isinstance(terminal(local), Finished)
        _, events = await run_disaggregated(p, d, full_request("decode-fails"))
        assert terminal(events).error.code == ErrorCode.ERROR_CODE_KV_TRANSFER_FAILED


async def test_sigterm_drains_in_flight_work_then_exits_cleanly(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", "--time-scale", "1")
    async with engine_client(worker.address) as client:
        async with client.generate(full_request("inflight", max_tokens=120)) as stream:
            await stream.__anext__()
            worker.process.signal(signal.SIGTERM)
            with trio.fail_after(5):
                while await client.health() != Health.NOT_READY:  # v0.1.0: no DRAINING
                    await trio.sleep(0.02)
            refused = await refusal(client, full_request("late", max_tokens=3))
            assert refused.retryable and refused.grpc_status == grpc.StatusCode.UNAVAILABLE
            assert "draining" in refused.message
            rest = [e async for e in stream]
        assert isinstance(terminal(rest), Finished) and terminal(rest).reason_name == "length"
    assert await trio.to_thread.run_sync(worker.process.process.wait, 10) == 0


async def test_warmup_reports_starting_then_ready(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", *FAST, "--warmup", "0.6")
    async with engine_client(worker.address) as client:
        assert await client.health() == Health.STARTING
        refused = await refusal(client, full_request("early"))
        assert refused.retryable
        await client.wait_until_ready(deadline=10, retry_interval=0.1)
        assert await client.health() == Health.READY


async def test_lora_rpcs_answer_unimplemented_with_a_message(sim_workers):
    import grpc

    from orchestrator.openengine.v1 import lora_pb2, openengine_pb2_grpc

    worker = sim_workers.start("aggregated", *FAST)
    with grpc.insecure_channel(worker.target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            openengine_pb2_grpc.ControlStub(channel).ListLoras(lora_pb2.ListLorasRequest())
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and "LoRA" in (info.value.details() or "")


# ---- the TensorRT-LLM persona's behaviours of tests/e2e/test_trtllm_conformance.py (issue 27) ------------------

async def test_the_sibling_server_answers_a_late_abort_by_session_but_frees_nothing(sim_workers, engine_client):
    """UPSTREAM late-abort: after PrefillReady the context request is no longer active, so the abort only drops
    the servicer's handle; the blocks stay held until a decode pulls them."""
    pre = sim_workers.start("prefill", *FAST, "--schema-revision", "3")
    dec = sim_workers.start("decode", *FAST, "--schema-revision", "3")
    async with engine_client(pre.address) as p, engine_client(dec.address) as d:
        full = full_request("late-abort", max_tokens=3)
        session = terminal(await collect(p, context_only_leg(full))).kv_session
        answer = await p.abort(kv_session=session)
        assert answer.status == lifecycle_pb2.ABORT_STATUS_ABORTED and "Released KV session" in answer.message
        load = await p.load()
        assert load.active_kv_sessions == 1 and load.used_kv_blocks > 0 and attr(load, "late_session_aborts") == 1
        assert isinstance(terminal(await collect(d, generation_leg(full, session))), Finished)  # a pull frees it
        assert (await p.load()).active_kv_sessions == 0


@pytest.mark.parametrize("revision, status", [("1", grpc.StatusCode.ALREADY_EXISTS),
                                              ("3", grpc.StatusCode.INVALID_ARGUMENT)])
async def test_a_request_id_already_active_is_refused_as_each_server_does(revision, status, sim_workers,
                                                                          engine_client):
    """UPSTREAM already-exists."""
    worker = sim_workers.start("aggregated", "--time-scale", "1", "--schema-revision", revision)
    async with engine_client(worker.address) as client:
        async with client.generate(full_request("twice", max_tokens=200)) as first:
            await first.__anext__()
            refused = await refusal(client, full_request("twice"))
    assert refused.grpc_status == status and "already active" in refused.message


async def test_load_reports_follow_the_load_metrics_setting(sim_workers, engine_client):
    """UPSTREAM load-kv, control-unavailable: without load metrics only the requests in service; a stale sample
    is UNAVAILABLE."""
    off = sim_workers.start("aggregated", *FAST, "--load-metrics", "off")
    stale = sim_workers.start("aggregated", *FAST, "--load-metrics", "unavailable")
    async with engine_client(off.address) as a, engine_client(stale.address) as b:
        load = await a.load()
        assert load.HasField("running_requests") and not load.HasField("used_kv_blocks")
        assert not load.HasField("queued_requests") and not load.attributes.fields
        with pytest.raises(EngineError) as info:
            await b.load()
        assert info.value.grpc_status == grpc.StatusCode.UNAVAILABLE
        assert await b.health() == Health.READY  # the engine itself is fine


@pytest.mark.parametrize("revision, backend, outcome", [
    ("1", "none", "refused"),  # revision 1 refuses a mode its backend lacks (UNIMPLEMENTED)
    ("3", "none", "ignored"),  # the sibling server passes it on; the engine ignores it
    ("1", "xgrammar", "taken"), ("3", "llguidance", "taken"),
])
async def test_guides_and_the_guided_decoding_capability_follow_the_grammar_backend(revision, backend, outcome,
                                                                                   sim_workers, engine_client):
    """UPSTREAM guided-capability."""
    worker = sim_workers.start("aggregated", *FAST, "--schema-revision", revision, "--guided-backend", backend)
    guided = full_request("guided", max_tokens=2)
    guided.guided.json_object.SetInParent()
    async with engine_client(worker.address) as client:
        caps = await client.capabilities()
        if outcome == "refused":
            assert (await refusal(client, guided)).grpc_status == grpc.StatusCode.UNIMPLEMENTED
        else:
            assert isinstance(terminal(await collect(client, guided)), Finished)
    assert caps.guided_decoding.supported is (backend != "none")
    assert ("json_object" in caps.guided_decoding.modes) is (backend != "none")
    assert ("choice" in caps.guided_decoding.modes) is (backend != "none" and revision == "3")


async def test_a_stream_nobody_reads_is_aborted_by_the_stall_watchdog(sim_workers, engine_client):
    """UPSTREAM stall-watchdog: a raw HTTP/2 client that opens a Generate stream with a tiny flow-control window
    and never reads. Once the server cannot hand on responses, the watchdog aborts the request (its blocks
    come back) after the stall timeout; a slow engine alone never trips it."""
    import socket

    import h2.config
    import h2.connection
    import h2.settings

    worker = sim_workers.start("aggregated", "--time-scale", "0", "--stall-timeout", "1",
                               "--max-context-length", "60000")
    host, port = worker.address.removeprefix("grpc://").rsplit(":", 1)
    message = full_request("unread", max_tokens=50_000).SerializeToString()
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    connection.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 64})
    connection.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":authority", f"{host}:{port}"),
                                (":path", "/openengine.v1.Inference/Generate"), ("content-type", "application/grpc"),
                                ("te", "trailers")])
    connection.send_data(1, b"\x00" + len(message).to_bytes(4, "big") + message, end_stream=True)
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(connection.data_to_send())  # and never read or acknowledge anything after this
        async with engine_client(worker.address) as client:
            load = await wait_for_load(client, lambda info: attr(info, "stalled_requests") == 1, timeout=20)
            assert load.running_requests == 0 and load.used_kv_blocks == 0
            # its request id is released: the same id is taken again at once
            assert isinstance(terminal(await collect(client, full_request("unread", max_tokens=2))), Finished)
