"""API keys on the frontend: Bearer, several keys from a file and the environment, OpenAI-format 401s,
/health and /metrics open or protected as configured."""

import hmac

import httpx
import openai
import pytest

from orchestrator.config import AuthConfig, ConfigError
from orchestrator.frontend.auth import ApiKeys, load_api_keys
from orchestrator.testing import write_config

FAST = ("--time-scale", "0")


@pytest.fixture
def protected(tmp_path, sim_workers, orchestrator_servers):
    worker = sim_workers.start("aggregated", *FAST)
    (tmp_path / "keys.txt").write_text("# operators\nkey-from-file\n\n")
    config = write_config(tmp_path / "auth.yaml", "aggregated", {"aggregated": [worker.address]},
                          auth={"api_keys_file": "keys.txt", "api_keys_env": "ORCH_TEST_KEYS",
                                "protect_metrics": True})
    return orchestrator_servers.start(config, env={"ORCH_TEST_KEYS": "key-a, key-b"})


@pytest.mark.parametrize("key", ["key-from-file", "key-a", "key-b"])
def test_every_configured_key_works_with_the_openai_sdk(protected, key):
    client = openai.OpenAI(base_url=protected.url + "/v1", api_key=key, max_retries=0)
    answer = client.chat.completions.create(model="tiny-chat", max_tokens=2,
                                            messages=[{"role": "user", "content": "hi"}])
    assert answer.usage.completion_tokens == 2


def test_a_wrong_or_missing_key_is_a_401_in_the_openai_format(protected):
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=protected.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    with httpx.Client(base_url=protected.url) as http:
        missing = http.post("/v1/chat/completions", json={"model": "tiny-chat", "messages": []})
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"]["type"] == "invalid_request_error"
        assert http.get("/health").status_code == 200  # open unless auth.protect_health
        assert http.get("/metrics").status_code == 401  # auth.protect_metrics
        assert http.get("/metrics", headers={"authorization": "Bearer key-a"}).status_code == 200


def test_no_keys_means_no_authentication():
    assert not ApiKeys([]).enabled and not ApiKeys(["", ""]).enabled


def test_every_key_is_compared_whichever_matches(monkeypatch):
    calls, compare = [], hmac.compare_digest

    def counting(a, b):
        calls.append(b)
        return compare(a, b)

    monkeypatch.setattr("orchestrator.frontend.auth.hmac.compare_digest", counting)
    keys = ApiKeys(["first", "second", "third"])
    assert keys.allows("Bearer first") and len(calls) == 3
    assert not keys.allows("Bearer fourth") and len(calls) == 6
    assert not keys.allows("Basic Zmlyc3Q=") and not keys.allows(None)


def test_an_unreadable_key_file_is_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="auth.api_keys_file"):
        load_api_keys(AuthConfig(api_keys_file="missing.txt"), file="x.yaml", base_dir=tmp_path)
