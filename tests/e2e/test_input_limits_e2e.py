"""One huge request is refused quickly and does not stall the other streams."""

import json
from typing import Any

import httpx
import pytest
import trio

from serve_helpers import Deployment, chat_body


@pytest.fixture(scope="module")
def agg(tmp_path_factory):
    deployment = Deployment(tmp_path_factory.mktemp("limits"), "aggregated", {"aggregated": [("--time-scale", "1")]})
    yield deployment
    deployment.close()


async def test_a_20_mb_prompt_is_refused_fast_while_a_concurrent_stream_keeps_streaming(agg):
    """Its length alone proves it cannot fit the window: it is refused without being tokenized, and the body
    is parsed off the event loop (a server that tokenized it on the loop froze every stream for 25 s)."""
    huge = json.dumps(chat_body("weather " * 2_600_000, max_tokens=2)).encode()  # about 20 MB
    gaps: list[float] = []
    refused: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=agg.url, timeout=60) as http:
        async def stream():
            last = None
            async with http.stream("POST", "/v1/chat/completions",
                                   json=chat_body(max_tokens=400, ignore_eos=True, stream=True)) as response:
                async for _ in response.aiter_lines():
                    now = trio.current_time()
                    if last is not None:
                        gaps.append(now - last)
                    last = now

        async def big():
            await trio.sleep(0.5)  # the stream is flowing
            started = trio.current_time()
            response = await http.post("/v1/chat/completions", content=huge,
                                       headers={"content-type": "application/json"})
            refused.update(status=response.status_code, seconds=trio.current_time() - started,
                           error=response.json()["error"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            nursery.start_soon(big)
    assert refused["status"] == 400 and refused["error"]["code"] == "context_length_exceeded", refused
    assert "at least" in refused["error"]["message"] and "8192" in refused["error"]["message"]
    assert refused["seconds"] < 5.0, refused
    print(f"refused in {refused['seconds']:.3f} s; the stream's longest gap {max(gaps) * 1e3:.0f} ms")
    assert len(gaps) > 300 and max(gaps) < 1.0, max(gaps)  # the stream never stalled for the big request


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError("no VmRSS line")


async def test_memory_returns_near_its_baseline_after_big_requests(agg):
    """Five 20 MB bodies (one a 413-sized image, four over-long prompts) leave the server's resident
    memory where it was, give or take the allocator's slack: nothing of them is kept."""
    pid = agg.server.process.pid
    huge = json.dumps(chat_body("weather " * 2_600_000, max_tokens=2)).encode()
    async with httpx.AsyncClient(base_url=agg.url, timeout=60) as http:
        assert (await http.post("/v1/chat/completions", json=chat_body(max_tokens=2))).status_code == 200
        baseline = rss_mb(pid)
        peaks = []
        for _ in range(5):
            response = await http.post("/v1/chat/completions", content=huge,
                                       headers={"content-type": "application/json"})
            assert response.status_code == 400
            peaks.append(rss_mb(pid))
    # The connection that carried them is closed (its receive buffer grew to 20 MB); a new one is served.
    async with httpx.AsyncClient(base_url=agg.url, timeout=60) as http:
        assert (await http.post("/v1/chat/completions", json=chat_body(max_tokens=2))).status_code == 200
        await trio.sleep(0.5)
        after = rss_mb(pid)
    print(f"RSS baseline {baseline:.0f} MB, after each big request {[round(p) for p in peaks]}, end {after:.0f} MB")
    assert after < baseline + 15, (baseline, peaks, after)  # without the fixes: +40 to +60 MB
