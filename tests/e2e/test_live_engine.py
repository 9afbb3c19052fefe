"""The live TRT-LLM lane: the same requests against real OpenEngine endpoints.

    ORCH_LIVE_PREFILL=grpc://gpu1:50051 ORCH_LIVE_DECODE=grpc://gpu2:50051 \
    ORCH_LIVE_MODEL_DIR=/models/Llama-3.1-8B-Instruct ORCH_REQUIRE_LIVE_ENGINE=1 \
    .venv/bin/python -m pytest -m live_engine

Without the endpoints these tests skip; with ORCH_REQUIRE_LIVE_ENGINE=1 a missing or unreachable
endpoint fails them, so a required lane cannot go green without exercising an engine.
"""

import os

import httpx
import pytest

from orchestrator.testkit.plugin import write_config

pytestmark = pytest.mark.live_engine
CONNECT_DEADLINE = float(os.environ.get("ORCH_LIVE_TIMEOUT", "60"))


@pytest.fixture
def live():
    prefill, decode = os.environ.get("ORCH_LIVE_PREFILL"), os.environ.get("ORCH_LIVE_DECODE")
    if not (prefill and decode):
        message = "ORCH_LIVE_PREFILL and ORCH_LIVE_DECODE are not both set"
        if os.environ.get("ORCH_REQUIRE_LIVE_ENGINE") == "1":
            pytest.fail(f"ORCH_REQUIRE_LIVE_ENGINE=1 but {message}")
        pytest.skip(message)
    return {"prefill": prefill, "decode": decode, "model_dir": os.environ.get("ORCH_LIVE_MODEL_DIR",
                                                                              "builtin:tiny-chat")}


async def test_live_workers_are_compatible_and_have_the_roles_they_claim(live, engine_client):
    for role in ("prefill", "decode"):
        async with engine_client(live[role]) as client:
            caps = await client.wait_until_ready(deadline=CONNECT_DEADLINE)  # unreachable: WorkerNotReady, a failure
        # Revision-1 TensorRT-LLM reports ENGINE_ROLE_UNSPECIFIED (the role is per request); revision 3 declares it.
        assert caps.serves_role(role), f"{live[role]} reports engine_role {caps.role}"


async def test_live_disaggregated_request_streams_tokens(live, engine_client, tmp_path, orchestrator_servers):
    async with engine_client(live["decode"]) as client:
        caps = await client.wait_until_ready(deadline=CONNECT_DEADLINE)
    config = write_config(tmp_path / "live.yaml", "disaggregated",
                          {"prefill": [live["prefill"]], "decode": [live["decode"]]},
                          model={"name": caps.model_id, "dir": live["model_dir"]},
                          limits={"worker_startup_timeout_s": CONNECT_DEADLINE})
    server = orchestrator_servers.start(config, timeout=CONNECT_DEADLINE + 30)
    body = {"model": caps.model_id, "max_tokens": 16, "seed": 1,
            "messages": [{"role": "user", "content": "Say hello in five words."}]}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        plain = await http.post("/v1/chat/completions", json=body)
        assert plain.status_code == 200, plain.text
        assert plain.json()["usage"]["completion_tokens"] > 0
        streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        assert '"content"' in streamed.text
