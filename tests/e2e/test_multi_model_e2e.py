"""Several models behind one orchestrator (`models:`), with real sim-worker and orchestrator processes: each
model served by its own workers, an unknown model a 404 listing what is served, a model without workers a 503
for it alone, per-key model limits, and etcd discovery of two models beside one the config does not name."""

from __future__ import annotations

import httpx
import openai
import pytest
import trio
import yaml

from orchestrator.testkit.plugin import OrchestratorServers, SimWorkers
from sim_helpers import recent_requests

FAST = ("--time-scale", "0.02")
BIG, SMALL = "tiny-chat", "tiny-chat-small"
LIMITS = {"worker_startup_timeout_s": 30, "health_interval_s": 0.2}


def models_config(path, discovery: dict[str, dict], **sections) -> str:
    """A models: config: BIG disaggregated, SMALL (alias `small`) aggregated, each with its discovery."""
    data = {"mode": "disaggregated", "http": {"host": "127.0.0.1", "port": 0}, "limits": LIMITS,
            "models": [{"name": BIG, "dir": "builtin:tiny-chat", "discovery": discovery[BIG]},
                       {"name": SMALL, "aliases": ["small"], "dir": "builtin:tiny-chat", "mode": "aggregated",
                        "discovery": discovery[SMALL]}],
            **sections}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def chat(model: str, max_tokens: int = 3) -> dict:
    return {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def two_models(tmp_path):
    """BIG on a prefill and a decode worker, SMALL on one aggregated worker, API keys: `all-models` may use every
    model, `small-only` only SMALL."""
    workers, servers = SimWorkers(tmp_path), OrchestratorServers(tmp_path)
    try:
        big = {role: workers.start(role, *FAST, "--model", BIG) for role in ("prefill", "decode")}
        small = workers.start("aggregated", *FAST, "--model", SMALL)
        config = models_config(tmp_path / "models.yaml", {
            BIG: {"static": {"prefill": [big["prefill"].address], "decode": [big["decode"].address]}},
            SMALL: {"static": {"aggregated": [small.address]}}},
            auth={"keys": [{"name": "all-models", "key": "sk-all"},
                           {"name": "small-only", "key": "sk-small", "models": ["small"]}]})
        server = servers.start(config)
        yield server, big, small
    finally:
        servers.close()
        workers.close()


def client(server, key: str = "sk-all") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


SENT = ("to-big", "to-small", "to-alias")  # the X-Request-Ids of the first test's requests


async def served_ids(engine_client, worker) -> set[str]:
    """Which of SENT a worker ran (an engine request id is the X-Request-Id and suffixes)."""
    ran = [entry["id"] for entry in await recent_requests(engine_client, worker)]
    return {sent for sent in SENT if any(engine_id.startswith(sent + "-") for engine_id in ran)}


async def test_each_model_is_served_by_its_own_workers_and_an_unknown_one_is_a_404_listing_them(
        two_models, engine_client):
    server, big, small = two_models
    sdk = client(server)
    for model, request_id in ((BIG, "to-big"), (SMALL, "to-small"), ("small", "to-alias")):
        answer = await trio.to_thread.run_sync(lambda: sdk.chat.completions.create(
            **chat(model), extra_headers={"x-request-id": request_id}))  # noqa: B023 - run at once
        assert answer.model == model and answer.choices[0].message.content
    assert await served_ids(engine_client, big["prefill"]) == {"to-big"}
    assert await served_ids(engine_client, big["decode"]) == {"to-big"}
    assert await served_ids(engine_client, small) == {"to-small", "to-alias"}

    with pytest.raises(openai.NotFoundError) as unknown:
        await trio.to_thread.run_sync(lambda: sdk.chat.completions.create(**chat("no-such-model")))
    error: dict = unknown.value.body  # type: ignore[assignment]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert f"serves {BIG}, {SMALL}, small" in error["message"]
    async with httpx.AsyncClient(base_url=server.url, headers={"authorization": "Bearer sk-all"}) as http:
        messages = await http.post("/v1/messages", json=chat("no-such-model"))
    assert messages.status_code == 404 and messages.json()["type"] == "error"  # Anthropic's error shape
    assert messages.json()["error"]["type"] == "not_found_error"


async def test_v1_models_lists_every_model_and_alias_with_its_state_and_retrieves_one(two_models):
    server, _, _ = two_models
    sdk = client(server)
    listed = await trio.to_thread.run_sync(lambda: sdk.models.list().data)
    assert [(m.id, m.root, m.state) for m in listed] == [  # type: ignore[attr-defined]
        (BIG, BIG, "ready"), (SMALL, SMALL, "ready"), ("small", SMALL, "ready")]
    one = await trio.to_thread.run_sync(lambda: sdk.models.retrieve("small"))
    assert one.id == "small" and one.owned_by == "orchestrator"
    with pytest.raises(openai.NotFoundError):
        await trio.to_thread.run_sync(lambda: sdk.models.retrieve("org/no-such-model"))


async def test_an_api_key_limited_to_some_models_gets_a_403_for_the_others(two_models):
    server, _, _ = two_models
    limited = client(server, "sk-small")
    answer = await trio.to_thread.run_sync(lambda: limited.chat.completions.create(**chat(SMALL)))
    assert answer.choices[0].message.content
    with pytest.raises(openai.PermissionDeniedError) as denied:
        await trio.to_thread.run_sync(lambda: limited.chat.completions.create(**chat(BIG)))
    body: dict = denied.value.body  # type: ignore[assignment]
    assert body["code"] == "model_not_allowed" and SMALL in body["message"]
    async with httpx.AsyncClient(base_url=server.url, headers={"x-api-key": "sk-small"}) as http:
        messages = await http.post("/v1/messages", json=chat(BIG))
    assert messages.status_code == 403 and messages.json()["error"]["type"] == "permission_error"


async def test_metrics_carry_the_model_of_each_request(two_models):
    server, _, _ = two_models
    sdk = client(server)
    for model in (BIG, SMALL, SMALL):
        await trio.to_thread.run_sync(lambda: sdk.chat.completions.create(**chat(model)))  # noqa: B023
    async with httpx.AsyncClient(base_url=server.url) as http:
        metrics = (await http.get("/metrics")).text
    assert f'orchestrator_requests_total{{mode="disaggregated",model="{BIG}",outcome="ok",route="chat"}} 1.0' \
        in metrics
    assert f'orchestrator_requests_total{{mode="aggregated",model="{SMALL}",outcome="ok",route="chat"}} 2.0' \
        in metrics
    assert f'orchestrator_workers{{model="{SMALL}",role="aggregated",state="ready"}} 1.0' in metrics


async def test_a_model_whose_workers_are_all_gone_answers_503_alone_and_health_names_it(two_models):
    server, _, small = two_models
    sdk = client(server)
    small.process.process.kill()  # SIGKILL: no goodbye
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        with trio.fail_after(15):
            while (health := (await http.get("/health")).json())["models"][SMALL]["status"] != "not_ready":
                await trio.sleep(0.1)
        assert (await http.get("/health")).status_code == 503
        assert health["status"] == "not_ready" and health["models"][BIG]["status"] == "ready"
        assert health["models"][SMALL]["ready_workers"] == {"aggregated": 0}
    with pytest.raises(openai.APIStatusError) as gone:
        await trio.to_thread.run_sync(lambda: sdk.chat.completions.create(**chat(SMALL)))
    assert gone.value.status_code == 503 and f"no aggregated worker of {SMALL} is available" in gone.value.message
    answer = await trio.to_thread.run_sync(lambda: sdk.chat.completions.create(**chat(BIG)))
    assert answer.choices[0].message.content
    listed = await trio.to_thread.run_sync(lambda: sdk.models.list().data)
    assert {m.id: m.state for m in listed} == {BIG: "ready", SMALL: "not_ready", "small": "not_ready"}  # type: ignore


@pytest.mark.etcd
async def test_etcd_discovers_two_models_and_ignores_a_model_not_named_with_one_log_line(tmp_path, etcd_server):
    etcd = {"etcd": {"endpoints": [etcd_server.url], "namespace": "multi"}}
    config = models_config(tmp_path / "etcd.yaml", {BIG: etcd, SMALL: etcd}, mode="aggregated")
    register = ("--etcd", etcd_server.url, "--etcd-namespace", "multi", "--etcd-ttl", "3")
    workers, servers = SimWorkers(tmp_path), OrchestratorServers(tmp_path)
    try:
        strangers = [workers.start("aggregated", *FAST, *register, "--model", "stranger") for _ in range(2)]
        big = workers.start("aggregated", *FAST, *register, "--model", BIG)
        small = workers.start("aggregated", *FAST, *register, "--model", SMALL)
        server = servers.start(config)
        late_stranger = workers.start("aggregated", *FAST, *register, "--model", "stranger")  # a watch event
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            with trio.fail_after(15):
                while (await http.get("/health")).status_code != 200:
                    await trio.sleep(0.1)
            health = (await http.get("/health")).json()
            for model, worker in ((BIG, big), (SMALL, small)):
                assert [w["address"] for w in health["models"][model]["workers"]] == [worker.address]
                answer = await http.post("/v1/chat/completions", json=chat(model))
                assert answer.status_code == 200, answer.text
            foreign = {*(w.address for w in strangers), late_stranger.address}
            assert not foreign & {w["address"] for each in health["models"].values() for w in each["workers"]}
        log = server.process.log_path.read_text()  # type: ignore[union-attr]
        assert log.count("ignoring workers registered for model 'stranger'") == 1, log
    finally:
        servers.close()
        workers.close()
