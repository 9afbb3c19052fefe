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
            hits = []
            for name in ("alpha", "beta", "gamma"):  # back to back: our finished requests no longer count there
                hits.append(cached(await http.post("/v1/chat/completions", json=chat(
                    SYSTEM[name], f"question {round_}", image=image if name == "gamma" else None))))
            if round_ == 0:
                assert hits == [0, 0, 0]
            else:  # the system prompt and, for gamma, the image after it: well over 18 blocks each
                assert all(hit >= 18 * 32 for hit in hits), (round_, hits)
        health = (await http.get("/health")).json()
        metrics = (await http.get("/metrics")).text
    assert [w["kv_index"]["mode"] for w in health["workers"]] == ["approximate"] * 3
    assert 'orchestrator_routing_decisions_total{model="tiny-chat",reason="prefix",role="aggregated"} 9.0' in metrics
    for worker in workers:
        assert (f'orchestrator_kv_index_mode{{mode="approximate",model="tiny-chat",worker="{worker.address}"}} 1.0'
                in metrics)
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
# kv_aware for a role this mode does not run sets up nothing either
@pytest.mark.parametrize("routing", [{"aggregated": "least_loaded"},
                                     {"aggregated": "least_loaded", "prefill": "kv_aware"}],
                         ids=["least_loaded", "kv_aware_prefill"])
async def test_without_kv_aware_no_index_exists_and_health_says_nothing_of_it(
        tmp_path, sim_workers, orchestrator_in_process, mode, routing):
    worker = sim_workers.start("aggregated", *FAST)
    config = write_config(tmp_path / "plain.yaml", mode, {"aggregated": [worker.address]}, routing=routing)
    async with orchestrator_in_process(config) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        assert (await http.post("/v1/chat/completions", json=chat(SYSTEM["alpha"], "hi"))).status_code == 200
        health = (await http.get("/health")).json()
        metrics = (await http.get("/metrics")).text
    assert "kv_index" not in health["workers"][0]
    # decisions are counted where a role routes kv_aware: no per-request cost here
    assert 'orchestrator_routing_decisions_total{model="tiny-chat",reason="single",role="aggregated"} 0.0' in metrics


EVENTS = ("--time-scale", "0.02", "--kv-events")  # revision 1: ZMQ publishers, one per attention-DP rank


async def health_of(http) -> dict:
    return {w["address"]: w["kv_index"] for w in (await http.get("/health")).json()["workers"]}


async def until(predicate, timeout=15.0):
    with trio.fail_after(timeout):
        while not await predicate():
            await trio.sleep(0.05)


async def test_two_replicas_fed_by_the_same_events_route_alike(tmp_path, sim_workers, orchestrator_in_process,
                                                              engine_client):
    """Two orchestrators, three workers publishing KV events: a family's first request goes through one
    replica, every later one through the other alternately, and each finds its prefix cached: the replica that
    did not route it learned where it is from the worker's events (approximate mode could not: docs)."""
    workers = [sim_workers.start("aggregated", *EVENTS) for _ in range(3)]
    configs = [kv_config(tmp_path, f"replica{i}", workers) for i in range(2)]
    async with orchestrator_in_process(configs[0]) as url_a, orchestrator_in_process(configs[1]) as url_b, \
            httpx.AsyncClient(base_url=url_a, timeout=30) as a, httpx.AsyncClient(base_url=url_b, timeout=30) as b:
        for http in (a, b):
            async def all_events(http=http):
                return [w["mode"] for w in (await health_of(http)).values()] == ["events"] * 3
            await until(all_events)
        for name in ("alpha", "beta", "gamma"):
            blocks_before = sum(w["blocks"] for w in (await health_of(b)).values())
            assert cached(await a.post("/v1/chat/completions", json=chat(SYSTEM[name], "first"))) == 0

            async def b_heard_of_it(blocks_before=blocks_before):
                return sum(w["blocks"] for w in (await health_of(b)).values()) >= blocks_before + 18
            await until(b_heard_of_it)
            for i, http in enumerate((b, a, b)):
                # Each replica reads the workers' load itself and knows only its own requests finished: let both
                # see the last request done (a fresh GetLoad comes with every health check, 0.2 s), or a stale "1
                # running" of the other replica's may outweigh the hit (docs/kv-routing.md, replicas).
                await trio.sleep(0.5)
                hit = cached(await http.post("/v1/chat/completions", json=chat(SYSTEM[name], f"next {i}")))
                assert hit >= 18 * 32, (name, i, hit)
        metrics_b = (await b.get("/metrics")).text
    assert 'orchestrator_routing_decisions_total{model="tiny-chat",reason="prefix",role="aggregated"} 6.0' in metrics_b
    counts = await served(engine_client, workers)
    assert sum(prompt - hit for prompt, hit in counts) < 3 * 1000 + 9 * 200, counts  # one cold prefill a family


LONG = {name: f"You are the {name} research assistant. " + " ".join(f"{name}-document-line-{i} reads on;"
                                                                    for i in range(120)) for name in ("doc", "fan")}


async def test_back_to_back_requests_sharing_a_long_prefix_hit_the_cache_in_real_time(
        tmp_path, sim_workers, orchestrator_in_process, engine_client):
    """Four workers publishing KV events, no pause between requests: each request after a prefix's first
    finds it cached, right after the first finished (its load sample may still show it running, its events may
    not have arrived: our finished request no longer counts, the routed prompt counts as being computed)."""
    workers = [sim_workers.start("aggregated", *EVENTS) for _ in range(4)]
    config = kv_config(tmp_path, "realtime", workers)
    async with orchestrator_in_process(config) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        async def all_events():
            return [w["mode"] for w in (await health_of(http)).values()] == ["events"] * 4
        await until(all_events)
        back_to_back = [cached(await http.post("/v1/chat/completions", json=chat(LONG["doc"], f"question {i}")))
                        for i in range(6)]
        assert back_to_back[0] == 0 and all(hit >= 40 * 32 for hit in back_to_back[1:]), back_to_back
    counts = await served(engine_client, workers)
    assert sum(prompt - hit for prompt, hit in counts) < 2500 + 5 * 200, counts  # one cold prefill


async def test_a_burst_sharing_a_long_prefix_waits_for_the_first_prefill_and_hits_the_cache(
        tmp_path, sim_workers, orchestrator_in_process, engine_client):
    """An agent's fan-out: requests sharing a long prefix sent at once follow the first to the worker computing
    it and wait for its prefill there instead of computing the prefix again (within the hot-prefix guard)."""
    workers = [sim_workers.start("aggregated", *EVENTS) for _ in range(4)]
    config = kv_config(tmp_path, "burst", workers)
    async with orchestrator_in_process(config) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        async def all_events():
            return [w["mode"] for w in (await health_of(http)).values()] == ["events"] * 4
        await until(all_events)
        burst: list[int] = []

        async def one(i):
            burst.append(cached(await http.post("/v1/chat/completions", json=chat(LONG["fan"], f"task {i}"))))

        async with trio.open_nursery() as nursery:
            for i in range(5):  # within the hot-prefix guard (max_imbalance 4): more spread deliberately
                nursery.start_soon(one, i)
        assert sorted(burst)[0] == 0 and all(hit >= 40 * 32 for hit in sorted(burst)[1:]), burst
    counts = await served(engine_client, workers)
    assert sum(prompt - hit for prompt, hit in counts) < 2500 + 4 * 200, counts  # one cold prefill


async def test_an_attention_dp_worker_is_asked_for_the_rank_holding_the_prefix(
        tmp_path, sim_workers, orchestrator_in_process, engine_client):
    """One worker with two attention-DP ranks (a cache each) that accepts openengine-target-dp-rank: each family
    of prompts gets a home rank, and every later request of it is sent there and hits."""
    from sim_helpers import recent_requests

    worker = sim_workers.start("aggregated", *EVENTS, "--attention-dp-size", "2")
    config = kv_config(tmp_path, "dp", [worker])
    names = ("alpha", "beta", "gamma", "hot", "cold")
    async with orchestrator_in_process(config) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        async def events():
            return (await health_of(http))[worker.address]["mode"] == "events"
        await until(events)
        for name in names:
            assert cached(await http.post("/v1/chat/completions", json=chat(SYSTEM[name], "first"))) == 0
        for name in names:
            assert cached(await http.post("/v1/chat/completions", json=chat(SYSTEM[name], "again"))) >= 18 * 32
    ranks = [r["target_dp_rank"] for r in (await recent_requests(engine_client, worker))[-2 * len(names):]]
    assert ranks[:len(names)] == ranks[len(names):], ranks  # each family's second request on its first's rank
    assert set(ranks) == {0, 1}, ranks  # the families spread over both ranks


async def test_conditional_mode_prefills_on_the_decode_worker_holding_the_prefix(
        tmp_path, sim_workers, orchestrator_in_process, engine_client):
    """Conditional disaggregation, prompts longer than max_local_prefill_length (64): the first goes prefill ->
    decode, and that decode worker (of two) keeps the pulled KV cached (its events say so); the next one with
    the same system prompt has only its new message left to compute, so it prefills on that decode worker."""
    prefill = sim_workers.start("prefill", *EVENTS)
    decodes = [sim_workers.start("decode", *EVENTS) for _ in range(2)]
    config = write_config(tmp_path / "conditional.yaml", "conditional",
                          {"prefill": [prefill.address], "decode": [d.address for d in decodes]},
                          routing={"prefill": "kv_aware"}, conditional={"max_local_prefill_length": 64})
    async with orchestrator_in_process(config) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        async def both_followed():
            return [w["mode"] for w in (await health_of(http)).values()] == ["events"] * 3
        await until(both_followed)
        assert cached(await http.post("/v1/chat/completions", json=chat(SYSTEM["alpha"], "first"))) == 0

        async def decode_holds_it():
            health = await health_of(http)
            return max(health[d.address]["blocks"] for d in decodes) >= 18
        await until(decode_holds_it)
        assert cached(await http.post("/v1/chat/completions", json=chat(SYSTEM["alpha"], "again"))) >= 18 * 32
        # a new system prompt is not cached anywhere: split as before
        assert cached(await http.post("/v1/chat/completions", json=chat(SYSTEM["beta"], "first"))) == 0
        metrics = (await http.get("/metrics")).text
    served_by = {path: float(line.split()[-1]) for line in metrics.splitlines() for path in ("local", "disaggregated")
                 if line.startswith(f'orchestrator_prompt_tokens_total{{mode="{path}",model="tiny-chat"}}')}
    assert served_by["local"] > 0 and served_by["disaggregated"] > served_by["local"], served_by  # 1 local, 2 split
    *by_decode, (prefill_prompt, _) = await served(engine_client, [*decodes, prefill])
    # the local request ran on the decode worker holding the prefix (of two), and found it there
    assert max(hit for _, hit in by_decode) >= 18 * 32 and sum(p for p, _ in by_decode) < prefill_prompt, by_decode
