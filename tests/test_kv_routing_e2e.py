"""kv_aware routing end to end: real sim workers (their own prefix caches), the orchestrator in process.

Which worker served a request shows in the simulated workers' own counters (GetLoad attributes
prompt_tokens_total, cached_prompt_tokens_total) and in the response's usage.prompt_tokens_details.
"""

import base64

import httpx
import pytest
import trio

from orchestrator.synthetic import solid_png
from orchestrator.testkit.plugin import write_config

FAST = ("--time-scale", "0.02", "--schema-revision", "3")  # revision 3: takes images
# ~600 tokens of tiny-chat's byte-level vocabulary: 18+ blocks of 32 behind every family's requests
SYSTEM = {name: f"You are the {name} assistant. " + " ".join(f"{name}-rule-{i} applies;" for i in range(60))
          for name in ("alpha", "beta", "gamma", "hot", "cold")}


def chat(system: str, user: str, *, image: str | None = None, max_tokens: int = 4) -> dict:
    content: list | str = user
    if image is not None:
        content = [{"type": "image_url", "image_url": {"url": image}, "uuid": None},
                   {"type": "text", "text": user}]
        del content[0]["uuid"]  # identified by its bytes
    return {"model": "tiny-chat", "max_tokens": max_tokens, "seed": 1,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}]}


async def served(engine_client, workers) -> list[tuple[int, int]]:
    """(prompt tokens, cached prompt tokens) each worker has prefilled so far."""
    counts = []
    for worker in workers:
        async with engine_client(worker.address) as client:
            fields = (await client.load()).attributes.fields
        counts.append((int(fields["prompt_tokens_total"].number_value),
                       int(fields["cached_prompt_tokens_total"].number_value)))
    return counts


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def kv_config(tmp_path, name, workers, **kv_aware):
    return write_config(tmp_path / f"{name}.yaml", "aggregated", {"aggregated": [w.address for w in workers]},
                        routing={"aggregated": "kv_aware", "kv_aware": kv_aware})


async def test_requests_sharing_a_prefix_land_on_one_worker_routed_approximately_without_events(
        tmp_path, sim_workers, orchestrator_in_process, engine_client):
    """Three workers without KV events (approximate mode): each family of requests (one system prompt, a new
    user message each time; one family with an image, the same bytes every time) stays on one worker, so
    every request after a family's first finds its prefix cached. Round robin would move each next request."""
    workers = [sim_workers.start("aggregated", *FAST) for _ in range(3)]
    image = "data:image/png;base64," + base64.b64encode(solid_png(4, 4, (10, 200, 30))).decode()
    config = kv_config(tmp_path, "families", workers)
    async with orchestrator_in_process(config) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        for round_ in range(4):
            hits = [cached(await http.post("/v1/chat/completions", json=chat(SYSTEM[name], f"question {round_}",
                                                                            image=image if name == "gamma" else None)))
                    for name in ("alpha", "beta", "gamma")]
            if round_ == 0:
                assert hits == [0, 0, 0]
            else:  # the system prompt and, for gamma, the image after it: well over 18 blocks each
                assert all(hit >= 18 * 32 for hit in hits), (round_, hits)
        health = (await http.get("/health")).json()
        metrics = (await http.get("/metrics")).text
    assert [w["kv_index"]["mode"] for w in health["workers"]] == ["approximate"] * 3
    assert 'orchestrator_routing_decisions_total{reason="prefix",role="aggregated"} 9.0' in metrics
    for worker in workers:
        assert f'orchestrator_kv_index_mode{{mode="approximate",worker="{worker.address}"}} 1.0' in metrics
    # each family on one worker: nobody prefilled a family's system prompt twice
    counts = await served(engine_client, workers)
    assert sum(prompt - hit for prompt, hit in counts) < 3 * 1000 + 9 * 200, counts


async def test_the_hot_prefix_guard_spreads_one_hot_system_prompt_over_the_workers(
        tmp_path, sim_workers, orchestrator_in_process, engine_client):
    """A burst behind one system prompt, with a cache hit worth more than any load (overlap_weight 100): with
    the guard (max_imbalance 1) every worker takes a share; without it (max_imbalance 1000) the holder takes
    them all, queueing."""

    async def burst(workers, name, **kv_aware) -> list[int]:
        config = kv_config(tmp_path, name, workers, overlap_weight=100, **kv_aware)
        async with orchestrator_in_process(config) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            first = await http.post("/v1/chat/completions", json=chat(SYSTEM[name], "warm up"))
            assert first.status_code == 200

            async def one(i):
                response = await http.post("/v1/chat/completions",
                                           json=chat(SYSTEM[name], f"user {i}", max_tokens=40))
                assert response.status_code == 200

            async with trio.open_nursery() as nursery:
                for i in range(9):
                    nursery.start_soon(one, i)
        return [prompt for prompt, _ in await served(engine_client, workers)]

    slow = ("--time-scale", "0.3", "--schema-revision", "3")
    guarded = await burst([sim_workers.start("aggregated", *slow) for _ in range(3)], "hot", max_imbalance=1)
    assert all(tokens > 0 for tokens in guarded), guarded
    unguarded = await burst([sim_workers.start("aggregated", *slow) for _ in range(3)], "cold", max_imbalance=1000)
    assert sorted(tokens > 0 for tokens in unguarded) == [False, False, True], unguarded


@pytest.mark.parametrize("mode", ["aggregated"])
async def test_without_kv_aware_no_index_exists_and_health_says_nothing_of_it(
        tmp_path, sim_workers, orchestrator_in_process, mode):
    worker = sim_workers.start("aggregated", *FAST)
    config = write_config(tmp_path / "plain.yaml", mode, {"aggregated": [worker.address]},
                          routing={"aggregated": "least_loaded"})
    async with orchestrator_in_process(config) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        assert (await http.post("/v1/chat/completions", json=chat(SYSTEM["alpha"], "hi"))).status_code == 200
        health = (await http.get("/health")).json()
        metrics = (await http.get("/metrics")).text
    assert "kv_index" not in health["workers"][0]
    assert 'orchestrator_routing_decisions_total{reason="single",role="aggregated"} 1.0' in metrics
