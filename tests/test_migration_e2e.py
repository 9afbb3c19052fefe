"""Request migration: a decode worker SIGKILLed mid-stream loses no stream, and the text is what an undisturbed
run gives (the simulated engine, like greedy decoding, continues a sequence with the same tokens)."""

import json
import random

import httpx
import pytest
import trio

from orchestrator.testing import write_config
from serve_helpers import chat_body

STEP = ("--time-scale", "0.5")


def text_of(sse: str) -> tuple[str, str | None]:
    text, finish = "", None
    for block in sse.split("\n\n"):
        if block.startswith("data: {"):
            event = json.loads(block[6:])
            assert "error" not in event, event
            for choice in event.get("choices", []):
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
    return text, finish


@pytest.mark.parametrize("mode", ["disaggregated", "aggregated"])
async def test_a_worker_killed_mid_stream_loses_no_stream_and_changes_no_text(tmp_path, mode, sim_workers,
                                                                               orchestrator_servers):
    if mode == "disaggregated":
        prefill = sim_workers.start("prefill", *STEP)
        victim, survivor = sim_workers.start("decode", *STEP), sim_workers.start("decode", *STEP)
        workers = {"prefill": [prefill.address], "decode": [victim.address, survivor.address]}
        routing = {"decode": "round_robin"}
    else:
        victim, survivor = sim_workers.start("aggregated", *STEP), sim_workers.start("aggregated", *STEP)
        workers = {"aggregated": [victim.address, survivor.address]}
        routing = {"aggregated": "round_robin"}
    server = orchestrator_servers.start(write_config(tmp_path / "migrate.yaml", mode, workers, routing=routing))
    rng = random.Random(3)
    bodies = [chat_body("weather " * rng.randint(5, 60), max_tokens=120, seed=i, ignore_eos=True, stream=True)
              for i in range(24)]
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:
        async def run_all(kill_after: float | None) -> list[tuple[str, str | None]]:
            results = [None] * len(bodies)

            async def one(i):
                response = await http.post("/v1/chat/completions", json=bodies[i])
                assert response.status_code == 200, response.text
                results[i] = text_of(response.text)

            async with trio.open_nursery() as nursery:
                for i in range(len(bodies)):
                    nursery.start_soon(one, i)
                if kill_after is not None:
                    await trio.sleep(kill_after)
                    victim.process.process.kill()  # SIGKILL, mid-stream
            return results

        undisturbed = await run_all(None)
        disturbed = await run_all(kill_after=0.4)
        metrics = (await http.get("/metrics")).text
    assert all(finish == "length" for _, finish in disturbed)
    assert [text for text, _ in disturbed] == [text for text, _ in undisturbed]
    migrated = float(next(line.split()[-1] for line in metrics.splitlines()
                          if line.startswith(f'orchestrator_migrations_total{{mode="{mode}"}}')))
    print(f"{mode}: {migrated:.0f} of {len(bodies)} streams migrated, all {len(bodies)} complete, identical text")
    assert migrated >= 1, "the kill landed mid-stream on some requests"
