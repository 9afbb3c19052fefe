"""Hostile requests against a real `orchestrator serve` process: big bodies that fail, a malformed chunked
body, an oversized head. Each is refused with its status in the OpenAI format, read whole by the client, and
leaves nothing behind."""

import json

import httpx
import pytest
import trio

from h11_helpers import read_back_responses
from serve_helpers import Deployment, chat_body

LIMIT = 32 << 20  # limits.max_request_bytes here: the bodies below are tens of MB, not the default's 96 MB


@pytest.fixture(scope="module")
def agg(tmp_path_factory):
    deployment = Deployment(tmp_path_factory.mktemp("hostile"), "aggregated",
                            {"aggregated": [("--time-scale", "0.05")]}, limits={"max_request_bytes": LIMIT})
    yield deployment
    deployment.close()


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError("no VmRSS line")


def outcomes(metrics: str, route: str = "chat") -> dict[str, float]:
    """orchestrator_requests_total of `route` by outcome, summed over the models (a refused body names none)."""
    found: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("orchestrator_requests_total{") and f'route="{route}"' in line:
            labels, value = line.rsplit(" ", 1)
            outcome = labels.split('outcome="')[1].split('"')[0]
            found[outcome] = found.get(outcome, 0.0) + float(value)
    return found


async def test_big_failed_bodies_leave_memory_at_its_baseline_without_a_gc_pass(agg):
    """Four bodies above limits.max_request_bytes (413) and four below it that are not JSON (400), each tens of
    MB: the server's resident memory is back near its baseline right after them. The bodies used to be kept
    until a full GC pass by the error's traceback (a reference cycle through the request's frame)."""
    pid = agg.server.process.pid
    too_big = b"x" * (LIMIT + (8 << 20))  # 40 MB
    not_json = b'{"model": "tiny-chat", "messages": "' + b"a" * (30 << 20)  # 30 MB, never closed
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=agg.url, timeout=60) as http:
        assert (await http.post("/v1/chat/completions", json=chat_body(max_tokens=2))).status_code == 200
        await trio.sleep(0.3)
        baseline = rss_mb(pid)
        statuses, peaks = [], []
        for body in [too_big] * 4 + [not_json] * 4:
            async with httpx.AsyncClient(base_url=agg.url, timeout=60) as fresh:  # a 413 closes its connection
                response = await fresh.post("/v1/chat/completions", content=body, headers=headers)
            statuses.append((response.status_code, response.json()["error"]["code"]))
            peaks.append(round(rss_mb(pid)))
        await trio.sleep(0.3)  # the heap trim after a big body runs on a worker thread
        after = rss_mb(pid)
    print(f"RSS baseline {baseline:.0f} MB, after each body {peaks}, end {after:.0f} MB")
    assert statuses[:4] == [(413, "request_too_large")] * 4, statuses
    assert [status for status, _ in statuses[4:]] == [400] * 4, statuses
    assert after < baseline + 50, (baseline, peaks, after)


async def test_a_content_length_above_the_limit_is_a_413_before_any_body_arrives(agg):
    """200 MB announced, nothing sent: the answer does not wait for the body (nor for the 408)."""
    host, port = agg.url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n" % (200 << 20))
    answer = b""
    with trio.fail_after(5):
        while chunk := await stream.receive_some(65536):
            answer += chunk
            if answer.endswith(b"}}"):
                break
    await stream.aclose()
    [(response, body)] = read_back_responses(answer)
    assert response.status_code == 413 and json.loads(body)["error"]["code"] == "request_too_large"


async def test_a_malformed_chunked_body_is_a_400_counted_as_a_client_error(agg):
    async with httpx.AsyncClient(base_url=agg.url, timeout=10) as http:
        before = outcomes((await http.get("/metrics")).text)
    host, port = agg.url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"transfer-encoding: chunked\r\n\r\n5\r\n{\"mod\r\nzz-not-a-size\r\n")
    answer = b""
    with trio.fail_after(10):
        while chunk := await stream.receive_some(65536):
            answer += chunk
    await stream.aclose()
    [(response, body)] = read_back_responses(answer)
    error = json.loads(body)["error"]
    assert response.status_code == 400 and error["type"] == "invalid_request_error", (response, error)
    async with httpx.AsyncClient(base_url=agg.url, timeout=10) as http:
        after = outcomes((await http.get("/metrics")).text)
    assert after["client_error"] == before["client_error"] + 1
    assert after["disconnected"] == before["disconnected"] and after["error"] == before["error"]


async def test_an_oversized_head_gets_its_431_read_by_a_client_still_writing_it(agg):
    """16 MB of head, more than the socket buffers hold: the server refuses it after its first read. It then
    reads and drops the rest before it closes, so the client's writes all succeed and it reads the 431 (a
    close with unread bytes resets the connection: the client's write fails and it never reads the answer)."""
    host, port = agg.url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    with trio.fail_after(20):
        await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-padding: ")
        for _ in range(1024):
            await stream.send_all(b"p" * 16384)  # a reset connection raises BrokenResourceError here
        await stream.send_all(b"\r\ncontent-length: 2\r\n\r\n{}")
        answer = b""
        while chunk := await stream.receive_some(65536):
            answer += chunk
    await stream.aclose()
    [(response, body)] = read_back_responses(answer)
    assert response.status_code == 431
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"


async def test_requests_still_running_when_the_shutdown_grace_ends_get_a_503_or_a_final_error_event(
        tmp_path, sim_workers, orchestrator_servers):
    """SIGTERM with a 1 s grace while requests need several seconds more: a non-streamed request gets a 503
    with Retry-After, a started stream a final SSE error event and [DONE]; none is cut off bare."""
    import signal

    from orchestrator.testkit.plugin import write_config
    from serve_helpers import sse_events

    worker = sim_workers.start("aggregated", "--time-scale", "1")
    server = orchestrator_servers.start(write_config(tmp_path / "grace.yaml", "aggregated",
                                                     {"aggregated": [worker.address]},
                                                     limits={"shutdown_grace_s": 1.0}))
    long = chat_body(max_tokens=1500, ignore_eos=True)
    plain, streams = [], []
    streaming = trio.Event()
    async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=httpx.Limits(max_connections=16)) as http:
        async def one_plain():
            response = await http.post("/v1/chat/completions", json=long)
            plain.append((response.status_code, response.headers.get("retry-after"), response.json()))

        async def one_stream():
            text = ""
            async with http.stream("POST", "/v1/chat/completions", json={**long, "stream": True}) as response:
                async for chunk in response.aiter_text():
                    text += chunk
                    streaming.set()
            streams.append(sse_events(text))

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(one_plain)
                nursery.start_soon(one_stream)
            await streaming.wait()
            await trio.sleep(0.3)
            server.process.signal(signal.SIGTERM)
    assert len(plain) == 4 and len(streams) == 4
    for status, retry_after, body in plain:
        assert (status, retry_after, body["error"]["code"]) == (503, "1", "draining"), (status, retry_after, body)
    for events in streams:
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "draining", events[-3:]
        assert any("choices" in event for event in events[:-2])  # it had streamed before it was cut
    assert await trio.to_thread.run_sync(server.process.process.wait, 20) == 0
