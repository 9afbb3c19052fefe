"""Soak: a few thousand mixed requests, then nothing may be left anywhere. Slow: `pytest -m slow`."""

import random

import httpx
import pytest
import trio

from orchestrator.testkit.plugin import wait_for_load, write_config

pytestmark = pytest.mark.slow
REQUESTS = 3000
CONCURRENCY = 48


async def test_soak_mixed_traffic_leaks_nothing(tmp_path, sim_workers, orchestrator_servers, engine_client):
    flags = ("--time-scale", "0.05", "--kv-transfer-timeout", "600")
    prefill = sim_workers.start("prefill", *flags)
    decodes = [sim_workers.start("decode", *flags) for _ in range(2)]
    server = orchestrator_servers.start(write_config(
        tmp_path / "soak.yaml", "disaggregated",
        {"prefill": [prefill.address], "decode": [d.address for d in decodes]}))
    rng = random.Random(11)
    counts = {"ok": 0, "cancelled": 0, "client_error": 0, "other": 0}

    async def one(http: httpx.AsyncClient) -> None:
        roll = rng.random()
        if roll < 0.05:
            response = await http.post("/v1/chat/completions", json={"model": "tiny-chat", "messages": []})
            counts["client_error" if response.status_code == 400 else "other"] += 1
            return
        body = {"model": "tiny-chat", "max_tokens": rng.randint(1, 40), "stream": roll < 0.6,
                "messages": [{"role": "user", "content": "soak " * rng.randint(1, 300)}]}
        with trio.move_on_after(rng.uniform(0.0, 0.3) if roll > 0.8 else 120) as scope:
            response = await http.post("/v1/chat/completions", json=body)
            counts["ok" if response.status_code == 200 else "other"] += 1
        if scope.cancelled_caught:
            counts["cancelled"] += 1

    async def user(http: httpx.AsyncClient, n: int) -> None:
        for _ in range(n):
            await one(http)

    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
        async with trio.open_nursery() as nursery:
            for _ in range(CONCURRENCY):
                nursery.start_soon(user, http, REQUESTS // CONCURRENCY)
    assert counts["other"] == 0 and counts["ok"] > REQUESTS // 2, counts
    for worker in (prefill, *decodes):
        async with engine_client(worker.address) as client:
            load = await wait_for_load(client, lambda info: info.running_requests == 0 and info.active_kv_sessions == 0
                                        and info.used_kv_blocks == 0, timeout=30)
            assert load.attributes.fields["kv_sessions_expired"].number_value == 0
    async with httpx.AsyncClient(base_url=server.url) as http:
        with trio.fail_after(10):
            while "orchestrator_requests_in_flight 0.0" not in (await http.get("/metrics")).text:
                await trio.sleep(0.1)
