"""LoRA adapters end to end: simulated sibling servers (revision 3, a LoRA registry each) and the orchestrator in
process. A request names an adapter by its own name or as "tiny-chat:adapter" (model.adapters in the config).

Which worker served an adapter shows in the workers' own records (GetLoad's recent_requests carry each request's
lora_name) and registries (ListLoras); an adapter's prefix-cache hits in usage.prompt_tokens_details."""

from __future__ import annotations

import json

import grpc
import httpx
import trio

from orchestrator.openengine.v1 import lora_pb2, openengine_pb2_grpc
from orchestrator.testkit.plugin import write_config
from sim_helpers import recent_requests

REVISION_3 = ("--time-scale", "0.02", "--schema-revision", "3")
REVISION_1 = ("--time-scale", "0.02")
# ~600 tokens: many full blocks of 32 to cache
LONG = "You are the reviewer. " + " ".join(f"rule-{i} applies;" for i in range(60))


def adapter_dir(tmp_path, name: str) -> str:
    """A directory the sibling server accepts as an adapter (adapter_config.json and weights)."""
    path = tmp_path / "adapters" / name
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    (path / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    return str(path)


def load_on(worker, name: str, path: str, lora_id: int = 41) -> None:
    """An operator's LoadLora, straight to the worker."""
    with grpc.insecure_channel(worker.target) as channel:
        openengine_pb2_grpc.ControlStub(channel).LoadLora(lora_pb2.LoadLoraRequest(
            adapter=lora_pb2.LoraAdapter(lora_id=lora_id, lora_name=name, source_path=path)))


def held_by(worker) -> list[str]:
    with grpc.insecure_channel(worker.target) as channel:
        listed = openengine_pb2_grpc.ControlStub(channel).ListLoras(lora_pb2.ListLorasRequest())
    return [adapter.lora_name for adapter in listed.adapters]


def lora_config(tmp_path, mode: str, workers: dict[str, list], adapters: dict[str, str], **sections):
    addresses = {role: [w.address for w in ws] for role, ws in workers.items()}
    return write_config(tmp_path / f"{mode}.yaml", mode, addresses,
                        model={"adapters": [{"name": n, "source_path": p} for n, p in adapters.items()]}, **sections)


def completion(model: str, prompt: str = "Describe the river", max_tokens: int = 8) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "seed": 3}


async def all_ready(http: httpx.AsyncClient) -> None:
    """Every worker ready (serving starts with one per role): where an adapter goes depends on all of them."""
    with trio.fail_after(15):
        while not all(w["state"] == "ready" for w in (await http.get("/health")).json()["workers"]):
            await trio.sleep(0.05)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


async def test_an_adapter_request_lands_only_on_the_worker_holding_that_adapter(
        tmp_path, sim_workers, orchestrator_in_process, engine_client):
    holder, other = (sim_workers.start("aggregated", *REVISION_3) for _ in range(2))
    sql = adapter_dir(tmp_path, "sql")
    load_on(holder, "sql", sql)
    config = lora_config(tmp_path, "aggregated", {"aggregated": [holder, other]}, {"sql": sql})
    async with orchestrator_in_process(config) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        await all_ready(http)
        texts = {ok(await http.post("/v1/completions", json=completion(model)))["choices"][0]["text"]
                 for model in ("sql", "tiny-chat:sql", "sql", "tiny-chat:sql", "sql", "sql")}
        base = {ok(await http.post("/v1/completions", json=completion("tiny-chat")))["choices"][0]["text"]
                for _ in range(4)}
        health = (await http.get("/health")).json()
    assert len(texts) == len(base) == 1 and texts != base  # the adapter wrote its own text, every time
    on_holder, on_other = [await recent_requests(engine_client, w) for w in (holder, other)]
    assert [r.get("lora_name") for r in on_holder].count("sql") == 6
    assert not [r for r in on_other if r.get("lora_name")]
    assert on_other, "base requests still go to both workers"
    assert held_by(other) == []  # nothing was loaded where it was not needed
    views = {w["address"]: w for w in health["workers"]}
    assert views[holder.address]["lora_adapters"] == ["sql"] and views[other.address]["lora_adapters"] == []
    assert views[holder.address]["engine"]["supports_lora"] and views[holder.address]["engine"]["max_loras"] == 4


async def test_an_adapter_no_worker_holds_is_loaded_on_a_worker_with_room(tmp_path, sim_workers,
                                                                           orchestrator_in_process):
    """Both workers cache one adapter at a time (--max-loras 1); the first holds another already."""
    full, empty = (sim_workers.start("aggregated", *REVISION_3, "--max-loras", "1") for _ in range(2))
    paths = {name: adapter_dir(tmp_path, name) for name in ("poet", "sql")}
    load_on(full, "poet", paths["poet"])
    config = lora_config(tmp_path, "aggregated", {"aggregated": [full, empty]}, paths)
    async with orchestrator_in_process(config) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        await all_ready(http)
        for _ in range(3):
            ok(await http.post("/v1/completions", json=completion("tiny-chat:sql")))
        ok(await http.post("/v1/completions", json=completion("poet")))
        health = (await http.get("/health")).json()
    assert held_by(empty) == ["sql"] and held_by(full) == ["poet"]
    assert {w["address"]: w["lora_adapters"] for w in health["workers"]} == {
        full.address: ["poet"], empty.address: ["sql"]}


async def test_both_legs_of_a_disaggregated_request_run_with_the_adapter(tmp_path, sim_workers,
                                                                         orchestrator_in_process, engine_client):
    """The KV the decode leg pulls was computed with the adapter: the adapter is loaded on a prefill and a decode
    worker, and both legs name it; the answer is the one an aggregated worker with the adapter gives."""
    prefill, decode = sim_workers.start("prefill", *REVISION_3), sim_workers.start("decode", *REVISION_3)
    alone = sim_workers.start("aggregated", *REVISION_3)
    sql = adapter_dir(tmp_path, "sql")
    config = lora_config(tmp_path, "disaggregated", {"prefill": [prefill], "decode": [decode]}, {"sql": sql})
    async with orchestrator_in_process(config) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        await all_ready(http)
        split = ok(await http.post("/v1/completions", json=completion("sql")))["choices"][0]["text"]
    assert held_by(prefill) == held_by(decode) == ["sql"]
    for worker in (prefill, decode):
        assert [r.get("lora_name") for r in await recent_requests(engine_client, worker)] == ["sql"]
    load_on(alone, "sql", sql)
    agg = lora_config(tmp_path, "aggregated", {"aggregated": [alone]}, {"sql": sql})
    async with orchestrator_in_process(agg) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        await all_ready(http)
        whole = ok(await http.post("/v1/completions", json=completion("sql")))["choices"][0]["text"]
    assert split == whole


async def test_an_adapters_prefix_cache_is_apart_from_the_base_models(tmp_path, sim_workers, orchestrator_in_process):
    """The same prompt: the base model's cached prefix is no hit for the adapter, the adapter's own is; and
    kv_aware routing (KV events on) finds the adapter's prefix on the worker that cached it."""
    workers = [sim_workers.start("aggregated", *REVISION_3, "--kv-events") for _ in range(2)]
    sql = adapter_dir(tmp_path, "sql")
    config = lora_config(tmp_path, "aggregated", {"aggregated": workers}, {"sql": sql},
                         routing={"aggregated": "kv_aware"})

    def cached(answer: dict) -> int:
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    async with orchestrator_in_process(config) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        await all_ready(http)
        first_base = ok(await http.post("/v1/completions", json=completion("tiny-chat", LONG, 2)))
        first_adapter = ok(await http.post("/v1/completions", json=completion("sql", LONG, 2)))
        again = [ok(await http.post("/v1/completions", json=completion("sql", LONG, 2))) for _ in range(3)]
        base_again = ok(await http.post("/v1/completions", json=completion("tiny-chat", LONG, 2)))
    assert cached(first_base) == 0
    assert cached(first_adapter) == 0  # the same tokens, cached for the base model only: no hit
    assert all(cached(answer) >= 16 * 32 for answer in again), [cached(a) for a in again]
    assert cached(base_again) >= 16 * 32


async def test_revision_1_workers_refuse_an_adapter_request_with_a_503_and_serve_the_base_model(
        tmp_path, sim_workers, orchestrator_in_process):
    """UPSTREAM lora-r1: TensorRT-LLM's merged server has no LoRA surface (UNIMPLEMENTED, supports_lora false)."""
    worker = sim_workers.start("aggregated", *REVISION_1)
    config = lora_config(tmp_path, "aggregated", {"aggregated": [worker]}, {"sql": adapter_dir(tmp_path, "sql")})
    async with orchestrator_in_process(config) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        await all_ready(http)
        refused = await http.post("/v1/completions", json=completion("sql"))
        base = await http.post("/v1/completions", json=completion("tiny-chat"))
        health = (await http.get("/health")).json()
    assert refused.status_code == 503, refused.text
    assert "'sql'" in refused.json()["error"]["message"] and refused.headers.get("retry-after")
    ok(base)
    assert "lora_adapters" not in health["workers"][0] and not health["workers"][0]["engine"]["supports_lora"]
