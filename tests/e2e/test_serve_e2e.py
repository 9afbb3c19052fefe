"""`orchestrator serve` as a real process against sim-worker processes, through the openai SDK and httpx."""

import json
import random
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest
import trio

from orchestrator.testkit.plugin import write_config
from serve_helpers import Deployment, chat_body, sse_events

FAST = ("--time-scale", "0.02")


@pytest.fixture(scope="module")
def disagg(tmp_path_factory):
    deployment = Deployment(tmp_path_factory.mktemp("disagg"), "disaggregated",
                            {"prefill": [FAST], "decode": [FAST]})
    yield deployment
    deployment.close()


@pytest.fixture(scope="module")
def agg(tmp_path_factory):
    deployment = Deployment(tmp_path_factory.mktemp("agg"), "aggregated", {"aggregated": [FAST]})
    yield deployment
    deployment.close()


def _complete(deployment, **extra):
    return deployment.openai().chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Describe the river and the bridge"}], **extra)


def test_agg_and_disagg_give_identical_tokens_for_the_same_seed(agg, disagg):
    for seed in (1, 2, 3):
        a = _complete(agg, max_tokens=20, seed=seed)
        d = _complete(disagg, max_tokens=20, seed=seed)
        assert a.choices[0].message.content == d.choices[0].message.content
        assert a.choices[0].message.content.strip()
        assert a.usage.completion_tokens == d.usage.completion_tokens == 20
        assert a.choices[0].finish_reason == d.choices[0].finish_reason == "length"


def test_streaming_with_the_openai_sdk_equals_non_streaming(disagg):
    full = _complete(disagg, max_tokens=16, seed=9).choices[0].message.content
    chunks = list(_complete(disagg, max_tokens=16, seed=9, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices


def test_a_stream_sends_one_event_per_token(agg):
    """What aiperf and similar clients count: an SSE event per token, not per batch of arrived tokens.

    With logprobs every token has an event of its own (one logprob each); without, a token whose
    bytes do not complete a character yet has no event and its text rides with the next token's.
    """
    with_logprobs = [c for c in _complete(agg, max_tokens=64, seed=5, stream=True, logprobs=True)
                     if c.choices and c.choices[0].logprobs]
    assert len(with_logprobs) == 64
    assert all(len(c.choices[0].logprobs.content) == 1 for c in with_logprobs)
    plain = [c for c in _complete(agg, max_tokens=64, seed=5, stream=True) if c.choices and c.choices[0].delta.content]
    assert len(plain) == sum(1 for c in with_logprobs if c.choices[0].delta.content)
    assert "".join(c.choices[0].delta.content for c in plain) == \
        "".join(c.choices[0].delta.content or "" for c in with_logprobs)


def test_a_client_that_reads_slowly_gets_the_whole_stream_in_order(agg):
    """The socket to a client that does not keep up fills: what it cannot take waits in the server, the
    request waits for the client (backpressure, not an unbounded buffer), and nothing is lost or reordered."""
    full = _complete(agg, max_tokens=1500, seed=11).choices[0].message.content
    body = json.dumps(chat_body("Describe the river and the bridge", max_tokens=1500, seed=11, stream=True,
                                stream_options={"include_usage": True})).encode()
    host, port = agg.url.removeprefix("http://").rsplit(":", 1)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # a small window: the server's side fills
    client.connect((host, int(port)))
    client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\nconnection: close\r\n"
                   b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    time.sleep(1.0)  # meanwhile the engine has produced the whole answer
    received = b""
    client.settimeout(30)
    while chunk := client.recv(1024):
        received += chunk
        time.sleep(0.0005)
    client.close()
    head, _, chunked = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    events = sse_events(_dechunk(chunked).decode())
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 1500
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2]) == full


def _dechunk(data: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out
        out, data = out + data[:size], data[size + 2:]


def test_completions_endpoint_streams_and_not(agg):
    client = agg.openai()
    plain = client.completions.create(model="tiny-chat", prompt="Hello", max_tokens=8, seed=4)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-chat", prompt="Hello", max_tokens=8, seed=4, stream=True))
    assert plain.choices[0].text == streamed and plain.usage.prompt_tokens > 0


def test_logprobs_stop_strings_and_request_ids(disagg):
    with disagg.http() as http:
        response = http.post("/v1/chat/completions", headers={"X-Request-Id": "trace-42"},
                             json=chat_body(max_tokens=6, seed=5, logprobs=True, top_logprobs=2))
        assert response.status_code == 200 and response.headers["x-request-id"] == "trace-42"
        body = response.json()
        assert body["id"] == "trace-42"
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == 6 and all(len(c["top_logprobs"]) == 2 for c in content)
        assert "".join(c["token"] for c in content) == body["choices"][0]["message"]["content"]
        text = body["choices"][0]["message"]["content"]
        word = text.split()[2]
        stopped = http.post("/v1/chat/completions", json=chat_body(max_tokens=6, seed=5, stop=[word])).json()
        assert stopped["choices"][0]["message"]["content"] == text[: text.index(word)]
        assert stopped["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"", 400, None),
    (json.dumps(chat_body(max_tokens="many")).encode(), 400, "max_tokens"),
    (json.dumps({**chat_body(), "model": "gpt-17"}).encode(), 404, "model"),
    (json.dumps({"model": "tiny-chat", "messages": []}).encode(), 400, "messages"),
    (json.dumps(chat_body(content="weather " * 9000)).encode(), 400, "messages"),
    (json.dumps(chat_body(n=17)).encode(), 400, "n"),
])
def test_bad_input_is_a_4xx_in_the_openai_format_and_the_server_keeps_serving(disagg, body, status, param):
    with disagg.http() as http:
        response = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["message"] and error["type"] and error["param"] == param
        assert http.post("/v1/chat/completions", json=chat_body(max_tokens=2)).status_code == 200


def test_max_tokens_beyond_the_window_is_clamped_to_the_room_left_as_trtllm_does(disagg):
    """TensorRT-LLM leaves ModelInfo.max_output_tokens unset (control.py) and its executor clamps a max_tokens past
    the window (UPSTREAM clamp in tests/e2e/test_trtllm_conformance.py)."""
    with disagg.http() as http:
        response = http.post("/v1/chat/completions", json=chat_body(max_tokens=90_000, seed=1, ignore_eos=True))
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 8192  # the window of the sim's default profile


def test_oversize_prompt_error_names_both_numbers(disagg):
    with disagg.http() as http:
        error = http.post("/v1/chat/completions", json=chat_body(content="weather " * 9000)).json()["error"]
    from orchestrator.models import TINY_CHAT
    from orchestrator.tokenizer import ModelTokenizer

    tokenizer = ModelTokenizer.from_dir(TINY_CHAT)
    expected = len(tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": "weather " * 9000}])))
    assert f"{expected} tokens" in error["message"] and "context window of 8192" in error["message"]


def test_openai_sdk_raises_typed_errors(disagg):
    with pytest.raises(openai.NotFoundError):
        disagg.openai().chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="n: must be <= 16"):
        _complete(disagg, n=17)


def test_models_health_and_metrics(disagg):
    with disagg.http() as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny-chat"]
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["ready_workers"] == {"prefill": 1, "decode": 1}
        http.post("/v1/chat/completions", json=chat_body(max_tokens=3))
        metrics = http.get("/metrics").text
    for name in ("orchestrator_requests_total", "orchestrator_time_to_first_token_seconds_bucket",
                 "orchestrator_inter_token_latency_seconds",
                 'orchestrator_stage_duration_seconds_count{model="tiny-chat",stage="prefill"}',
                 'stage="kv_handoff"', 'stage="decode"', "orchestrator_requests_in_flight",
                 'orchestrator_workers{model="tiny-chat",role="decode",state="ready"} 1.0'):
        assert name in metrics, name


def test_metrics_count_tokens_not_chunks_and_every_series_starts_at_zero(agg):
    """The ITL histogram has an observation per streamed token after the first, whatever the batching;
    token counters add up to the usage the client saw; labelled series exist before their first event."""
    with agg.http() as http:
        before = http.get("/metrics").text
        assert _metric(before, 'orchestrator_requests_total{mode="aggregated",model="tiny-chat",outcome="client_error",'
                               'route="completions"}') == 0
        assert _metric(before, 'orchestrator_engine_errors_total{code="ERROR_CODE_OVERLOADED",model="tiny-chat"}') == 0
        assert _metric(before, "process_cpu_seconds_total") > 0
        usage = http.post("/v1/chat/completions", json=chat_body(max_tokens=40, stream=True, ignore_eos=True,
                                                                  stream_options={"include_usage": True}))
        after = http.get("/metrics").text
    assert '"completion_tokens":40' in usage.text
    grew = {name: _metric(after, name) - _metric(before, name) for name in (
        'orchestrator_output_tokens_total{mode="aggregated",model="tiny-chat"}',
        'orchestrator_inter_token_latency_seconds_count{mode="aggregated",model="tiny-chat"}',
        'orchestrator_time_to_first_token_seconds_count{mode="aggregated",model="tiny-chat"}')}
    assert grew == {'orchestrator_output_tokens_total{mode="aggregated",model="tiny-chat"}': 40,
                    'orchestrator_inter_token_latency_seconds_count{mode="aggregated",model="tiny-chat"}': 39,
                    'orchestrator_time_to_first_token_seconds_count{mode="aggregated",model="tiny-chat"}': 1}
    assert _metric(after, 'orchestrator_prompt_tokens_total{mode="aggregated",model="tiny-chat"}') > 0


def _metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.rsplit(" ", 1)[1])


def _load_attr(load, name):
    return load.attributes.fields[name].number_value


async def test_conditional_mode_sends_short_prompts_to_decode_only(tmp_path, sim_workers, orchestrator_servers,
                                                                     engine_client):
    prefill, decode = sim_workers.start("prefill", *FAST), sim_workers.start("decode", *FAST)
    config = write_config(tmp_path / "cond.yaml", "conditional",
                          {"prefill": [prefill.address], "decode": [decode.address]},
                          conditional={"max_local_prefill_length": 64})
    server = orchestrator_servers.start(config)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http, engine_client(prefill.address) as p:
        short = await http.post("/v1/chat/completions", json=chat_body("short", max_tokens=3))
        assert short.status_code == 200
        assert _load_attr(await p.load(), "steps") == 0  # the prefill worker never ran a step
        long = await http.post("/v1/chat/completions", json=chat_body("weather " * 100, max_tokens=3))
        assert long.status_code == 200
        assert _load_attr(await p.load(), "kv_sessions_pulled") == 1


@pytest.mark.parametrize("revision", ["1", "3"], ids=["trtllm-r1-no-abort-by-session", "trtllm-r3-abort-by-session"])
async def test_200_streams_cancelled_at_random_points_leave_nothing_behind(tmp_path, sim_workers, revision,
                                                                             orchestrator_servers, engine_client):
    """Revision-1 TensorRT-LLM cannot abort by kv_session and holds an unpulled session until its process
    exits (tensorrt_llm/grpc/openengine/README.md @ 05d4fbd59093, control.py @ 06cb2191b0be): only a pull
    frees it. Revision 3 aborts by session (tensorrt_llm/openengine/server.py @ 01138754b3f4)."""
    slow = ("--time-scale", "1", "--schema-revision", revision)  # real GPU-time steps
    prefill = sim_workers.start("prefill", *slow)
    decode = sim_workers.start("decode", *slow)
    config = write_config(tmp_path / "cancel.yaml", "disaggregated",
                          {"prefill": [prefill.address], "decode": [decode.address]})  # keep_alive_s 15
    server = orchestrator_servers.start(config)
    rng = random.Random(7)
    outcomes = {"before_first_token": 0, "mid_stream": 0, "completed": 0}

    async def one(http, i):
        await trio.sleep(i * 0.005)  # staggered arrivals
        # a third cancel early (prefill or hand-off), a third after their k-th chunk (mid-decode),
        # a third at a random moment
        kind = i % 3
        delay = rng.uniform(0.0, 0.05) if kind == 0 else rng.uniform(0.0, 0.6) if kind == 2 else 60.0
        stop_after_chunks = rng.randint(1, 5) if kind == 1 else None
        got_content = 0
        with trio.move_on_after(delay) as scope:
            async with http.stream("POST", "/v1/chat/completions",
                                   json=chat_body("weather " * rng.randint(5, 150), max_tokens=60, stream=True)) as r:
                async for chunk in r.aiter_text():
                    got_content += chunk.count('"content"')
                    if stop_after_chunks is not None and got_content >= stop_after_chunks:
                        scope.cancel()
            outcomes["completed"] += 1
            return
        outcomes["mid_stream" if got_content else "before_first_token"] += 1

    limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:
        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(one, http, i)
    assert sum(outcomes.values()) == 200
    # Both kinds of cancellation were exercised (how many land before the first token depends on the machine's
    # speed: 29-40 of the 67 early ones were seen on 2 cores).
    assert outcomes["mid_stream"] >= 60 and outcomes["before_first_token"] >= 20, outcomes
    async with engine_client(prefill.address) as p, engine_client(decode.address) as d:
        from orchestrator.testkit.plugin import wait_for_load

        for client in (p, d):
            load = await wait_for_load(client, lambda info: info.running_requests == 0 and info.active_kv_sessions == 0
                                        and info.used_kv_blocks == 0 and info.queued_requests == 0, timeout=30)
            assert _load_attr(load, "kv_sessions_expired") == 0
    async with httpx.AsyncClient(base_url=server.url) as http:
        with trio.fail_after(10):
            while True:
                health = (await http.get("/health")).json()
                metrics = (await http.get("/metrics")).text
                if "orchestrator_requests_in_flight 0.0" in metrics and all(
                        w["inflight"] == 0 for w in health["workers"]):
                    break
                await trio.sleep(0.1)
        assert (await http.post("/v1/chat/completions", json=chat_body(max_tokens=2))).status_code == 200
    # No socket is left half-closed: a connection the client closed is closed when its FIN is read, not
    # when the keep-alive timer (15 s) runs out.
    port = int(server.url.rsplit(":", 1)[1])
    with trio.move_on_after(2):
        while sockets_in_close_wait(port):
            await trio.sleep(0.1)
    assert sockets_in_close_wait(port) == 0, "sockets still in CLOSE_WAIT 2 s after the last stream"


def sockets_in_close_wait(port: int) -> int:
    """Server-side sockets on 127.0.0.1:`port` whose peer has closed but which are still open (/proc/net/tcp)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "08":  # 08: TCP_CLOSE_WAIT
            count += 1
    return count


async def test_engine_errors_map_to_statuses_and_prefill_retries_on_another_worker(tmp_path, sim_workers,
                                                                                   orchestrator_servers):
    flaky = sim_workers.start("prefill", *FAST, "--error-rate", "1", "--error-code", "ERROR_CODE_KV_TRANSFER_FAILED",
                              "--error-retryable")
    good = sim_workers.start("prefill", *FAST)
    decode = sim_workers.start("decode", *FAST)
    overloaded_decode = sim_workers.start("decode", *FAST, "--error-rate", "1", "--error-phase", "decode",
                                          "--error-code", "ERROR_CODE_OVERLOADED", "--error-retryable")
    retry = orchestrator_servers.start(write_config(
        tmp_path / "retry.yaml", "disaggregated", {"prefill": [flaky.address, good.address],
                                                   "decode": [decode.address]}, routing={"prefill": "round_robin"}))
    busy = orchestrator_servers.start(write_config(
        tmp_path / "busy.yaml", "disaggregated", {"prefill": [good.address], "decode": [overloaded_decode.address]}))
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(4):  # round robin sends some prefills to the flaky worker; each is retried once
            response = await http.post(retry.url + "/v1/chat/completions", json=chat_body(max_tokens=2))
            assert response.status_code == 200
        metrics = (await http.get(retry.url + "/metrics")).text
        retries = _metric(metrics, 'orchestrator_retries_total{model="tiny-chat",role="prefill"}')
        assert 1 <= retries <= 4
        transfer_failed = 'orchestrator_engine_errors_total{code="ERROR_CODE_KV_TRANSFER_FAILED",model="tiny-chat"}'
        assert _metric(metrics, transfer_failed) == retries
        # An in-stream OVERLOADED is TensorRT-LLM's stall watchdog, not load (tests/e2e/test_trtllm_conformance.py)
        refused = await http.post(busy.url + "/v1/chat/completions", json=chat_body(max_tokens=2))
        assert refused.status_code == 502 and "retry-after" not in refused.headers
        assert refused.json()["error"]["code"] == "stream_stalled"
        # a stream that fails before its first byte is a plain HTTP error too
        streamed = await http.post(busy.url + "/v1/chat/completions", json=chat_body(max_tokens=2, stream=True))
        assert streamed.status_code == 502 and streamed.json()["error"]["code"] == "stream_stalled"


async def test_an_error_after_streaming_began_is_a_final_sse_event(tmp_path, sim_workers, orchestrator_servers):
    # real step times (about 7 ms a token): the first tokens are on the wire well before the crash
    crashing = sim_workers.start("aggregated", "--time-scale", "1", "--crash-after-tokens", "10")
    server = orchestrator_servers.start(write_config(tmp_path / "crash.yaml", "aggregated",
                                                     {"aggregated": [crashing.address]}))
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=50, stream=True))
        events = sse_events(response.text)
        assert any(isinstance(e, dict) and e.get("choices") and e["choices"][0]["delta"].get("content")
                   for e in events)
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert events[-2]["error"]["code"] == "worker_unavailable"
        health = await http.get(server.url + "/health")
        assert health.status_code == 503


async def test_request_deadline_is_a_504(tmp_path, sim_workers, orchestrator_servers):
    stalling = sim_workers.start("aggregated", *FAST, "--stall-after-tokens", "2")
    server = orchestrator_servers.start(write_config(tmp_path / "stall.yaml", "aggregated",
                                                     {"aggregated": [stalling.address]},
                                                     limits={"request_timeout_s": 1.0}))
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=50))
    assert response.status_code == 504 and "1 s" in response.json()["error"]["message"]


async def test_sigterm_finishes_in_flight_streams_then_exits(tmp_path, sim_workers, orchestrator_servers):
    import signal

    worker = sim_workers.start("aggregated", "--time-scale", "1")
    server = orchestrator_servers.start(write_config(tmp_path / "term.yaml", "aggregated",
                                                     {"aggregated": [worker.address]}))
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        async with http.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=80, stream=True)) as r:
            chunks = r.aiter_text()
            first = await chunks.__anext__()
            server.process.signal(signal.SIGTERM)
            rest = "".join([c async for c in chunks])
    events = sse_events(first + rest)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert await trio.to_thread.run_sync(server.process.process.wait, 20) == 0


async def test_client_error_bodies_name_no_internal_address(tmp_path, sim_workers, orchestrator_servers):
    """Worker addresses and cause chains are for the log and the operator's /health view, not for clients."""
    dead = sim_workers.start("aggregated", *FAST)
    server = orchestrator_servers.start(write_config(tmp_path / "hush.yaml", "aggregated",
                                                     {"aggregated": [dead.address]}))
    dead.process.stop()
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=2))
    assert response.status_code == 503
    host_port = dead.address.removeprefix("grpc://")
    assert host_port not in response.text and "127.0.0.1" not in response.text, response.text
    assert host_port in server.process.tail(200)  # the operator's log has the whole story


async def test_a_body_that_never_arrives_whole_is_a_408_and_frees_the_connection(tmp_path, sim_workers,
                                                                                  orchestrator_servers):
    worker = sim_workers.start("aggregated", *FAST)
    server = orchestrator_servers.start(write_config(tmp_path / "slow.yaml", "aggregated",
                                                     {"aggregated": [worker.address]}, http={"body_timeout_s": 1.0}))
    host, port = server.url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: 100\r\n\r\n{\"model\": ")  # 10 of the 100 bytes promised
    answer = b""
    with trio.fail_after(10):
        while b"\r\n\r\n" not in answer or b"}}" not in answer:
            chunk = await stream.receive_some(4096)
            if not chunk:
                break
            answer += chunk
    await stream.aclose()
    assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer, answer[:300]


async def test_an_idle_least_loaded_worker_is_polled_at_the_health_interval_and_at_once_on_traffic(
        tmp_path, sim_workers, orchestrator_servers, engine_client):
    """Idle CPU: with nothing running, a decode worker's load is read right after each health check (1 s), not
    every load_staleness_ms / 2 (125 ms); a request wakes the poll, so routing under traffic stays fresh."""
    decode = sim_workers.start("decode", "--time-scale", "1")  # 60 tokens take about half a second
    prefill = sim_workers.start("prefill", *FAST)
    config = write_config(tmp_path / "idle.yaml", "disaggregated",
                          {"prefill": [prefill.address], "decode": [decode.address]},
                          limits={"health_interval_s": 1.0})
    server = orchestrator_servers.start(config)
    async with engine_client(decode.address) as d, httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        await trio.sleep(1.5)  # past start-up
        before = _load_attr(await d.load(), "load_calls")
        await trio.sleep(3.0)
        idle_polls = _load_attr(await d.load(), "load_calls") - before - 1  # less our own read
        assert 1 <= idle_polls <= 5, idle_polls  # polling every 125 ms would be 24
        busy_from = _load_attr(await d.load(), "load_calls")
        assert (await http.post("/v1/chat/completions", json=chat_body(max_tokens=60))).status_code == 200
        during = _load_attr(await d.load(), "load_calls") - busy_from - 1
        assert during >= 3, during  # at once, then every 125 ms while it ran


async def test_1000_cancelled_streams_leave_no_socket_half_closed(tmp_path, sim_workers, orchestrator_servers,
                                                                  engine_client):
    """Clients that hang up at random moments (before the headers, mid-stream): every connection is closed
    on the server side within a moment of the client's FIN, and the worker is left with nothing running."""
    worker = sim_workers.start("aggregated", "--time-scale", "0.2")
    server = orchestrator_servers.start(write_config(tmp_path / "hangups.yaml", "aggregated",
                                                     {"aggregated": [worker.address]}))
    port = int(server.url.rsplit(":", 1)[1])
    rng = random.Random(1)

    async def one():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            with trio.move_on_after(rng.uniform(0.0, 0.3)):
                async with http.stream("POST", "/v1/chat/completions",
                                       json=chat_body(max_tokens=200, stream=True)) as response:
                    async for _ in response.aiter_bytes():
                        pass

    for _ in range(10):
        async with trio.open_nursery() as nursery:
            for _ in range(100):
                nursery.start_soon(one)
    with trio.move_on_after(3):
        while sockets_in_close_wait(port):
            await trio.sleep(0.1)
    assert sockets_in_close_wait(port) == 0, "sockets still in CLOSE_WAIT 3 s after 1,000 hang-ups"
    async with engine_client(worker.address) as client:
        from orchestrator.testkit.plugin import wait_for_load

        await wait_for_load(client, lambda load: load.running_requests == 0 and load.queued_requests == 0,
                            timeout=10)
