"""API keys on the frontend: Bearer, several keys from a file and the environment, OpenAI-format 401s,
/health and /metrics open or protected as configured."""

import hmac

import httpx
import openai
import pytest
import trio

from orchestrator import config as config_module
from orchestrator.config import ApiKeyConfig, AuthConfig, ConfigError
from orchestrator.frontend.auth import ApiKey, ApiKeys, load_api_keys
from orchestrator.testkit.plugin import write_config
from sim_helpers import recent_requests

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
    assert answer.usage is not None
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


def test_two_authorization_headers_are_a_400_whichever_comes_first(protected):
    with httpx.Client(base_url=protected.url) as http:
        for pair in (["Bearer key-a", "Bearer nope"], ["Bearer nope", "Bearer key-a"]):
            answer = http.get("/v1/models", headers=[("authorization", pair[0]), ("authorization", pair[1])])
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["param"] == "authorization"
            assert "2 Authorization headers" in answer.json()["error"]["message"]


def keys_of(*secrets: str) -> ApiKeys:
    return ApiKeys([ApiKey(f"k{i}", secret.encode()) for i, secret in enumerate(secrets)])


def test_no_keys_means_no_authentication():
    assert not keys_of().enabled and not keys_of("", "").enabled


def test_every_key_is_compared_whichever_matches(monkeypatch):
    calls, compare = [], hmac.compare_digest

    def counting(a, b):
        calls.append(b)
        return compare(a, b)

    monkeypatch.setattr("orchestrator.frontend.auth.hmac.compare_digest", counting)
    keys = keys_of("first", "second", "third")
    first = keys.identify("Bearer first")
    assert first is not None
    assert first.name == "k0" and len(calls) == 3
    assert keys.identify("Bearer fourth") is None and len(calls) == 6
    assert keys.identify("Basic Zmlyc3Q=") is None and keys.identify(None) is None


def test_an_unreadable_key_file_is_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"auth\.api_keys_file"):
        load_api_keys(AuthConfig(api_keys_file="missing.txt"), file="x.yaml", base_dir=tmp_path)


# ---- named keys: identity, usage per name, limits -----------------------------------------------------

def test_named_keys_come_inline_from_the_environment_or_a_file_and_the_old_forms_get_names(tmp_path, monkeypatch):
    (tmp_path / "team-b.key").write_text("secret-b\n")
    (tmp_path / "keys.txt").write_text("# ops\nold-file-key\n")
    monkeypatch.setenv("TEAM_A_KEY", "secret-a")
    monkeypatch.setenv("OLD_KEYS", "old-env-key")
    auth = AuthConfig(keys=(ApiKeyConfig("team-a", key_env="TEAM_A_KEY"), ApiKeyConfig("team-b", key_file="team-b.key"),
                            ApiKeyConfig("ci", key="secret-ci")),
                      api_keys=("old-inline",), api_keys_file="keys.txt", api_keys_env="OLD_KEYS")
    keys = load_api_keys(auth, file="x.yaml", base_dir=tmp_path)
    named = {secret: key.name for secret in  # a secret identified as no key is missing here: the test fails
             ("secret-a", "secret-b", "secret-ci", "old-inline", "old-file-key", "old-env-key")
             if (key := keys.identify(f"Bearer {secret}")) is not None}
    assert named == {"secret-a": "team-a", "secret-b": "team-b", "secret-ci": "ci", "old-inline": "api_keys[0]",
                     "old-file-key": "api_keys_file:2", "old-env-key": "api_keys_env[0]"}
    assert all("secret" not in repr(key) for key in keys.keys)  # the secret stays out of logs


@pytest.mark.parametrize("auth, key, words", [
    ({"keys": [{"name": "a", "key": "x", "key_env": "X"}]}, "auth.keys[0]", "exactly one of key, key_env or key_file"),
    ({"keys": [{"name": "a"}]}, "auth.keys[0]", "exactly one of key, key_env or key_file (got none)"),
    ({"keys": [{"key": "x"}]}, "auth.keys[0].name", "required"),
    ({"keys": [{"name": "a b", "key": "x"}]}, "auth.keys[0].name", "letters, digits"),
    ({"keys": [{"name": "a", "key": "x"}, {"name": "a", "key": "y"}]}, "auth.keys[1].name", "a name no other key has"),
    ({"keys": [{"name": "a", "key": "x", "limits": {"requests_per_s": 0}}]}, "auth.keys[0].limits.requests_per_s",
     "> 0"),
    ({"keys": [{"name": "a", "key": "x", "limits": {"tokens_per_minute": 5}}]}, "auth.keys[0].limits.tokens_per_minute",
     "unknown key"),
])
def test_named_key_config_errors_name_the_key(tmp_path, auth, key, words):
    path = write_config(tmp_path / "c.yaml", "aggregated", {"aggregated": ["grpc://127.0.0.1:9"]}, auth=auth)
    with pytest.raises(ConfigError) as info:
        config_module.load(path)
    assert info.value.key == key and words in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("auth, key, words", [
    (AuthConfig(keys=(ApiKeyConfig("a", key_env="ORCH_TEST_UNSET"),)), "auth.keys[0].key_env", "unset or empty"),
    (AuthConfig(keys=(ApiKeyConfig("a", key_file="nope.key"),)), "auth.keys[0].key_file", "a readable file"),
    (AuthConfig(keys=(ApiKeyConfig("a", key="same"),), api_keys=("same",)), "auth",
     "api_keys[0] is the same key as a"),
])
def test_a_named_key_that_cannot_be_read_or_repeats_is_a_config_error(tmp_path, monkeypatch, auth, key, words):
    monkeypatch.delenv("ORCH_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError) as info:
        load_api_keys(auth, file="x.yaml", base_dir=tmp_path)
    assert info.value.key == key and words in str(info.value)


def metric(text: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, (name, [line for line in text.splitlines() if name.split("{")[0] in line])
    return values[0]


@pytest.fixture
def keyed(tmp_path, sim_workers, orchestrator_servers):
    """Three named keys: unlimited, one request per second with 40 tokens per minute, one request in flight.
    The worker stalls any request that asks for more than 3 tokens (a request held in flight)."""
    worker = sim_workers.start("aggregated", *FAST, "--stall-after-tokens", "3")
    config = write_config(tmp_path / "keys.yaml", "aggregated", {"aggregated": [worker.address]}, auth={"keys": [
        {"name": "team-a", "key_env": "ORCH_TEAM_A"},
        {"name": "slow-lane", "key": "secret-slow", "limits": {"requests_per_s": 1, "tokens_per_min": 40}},
        {"name": "one-at-a-time", "key": "secret-one", "limits": {"max_concurrency": 1}}]})
    server = orchestrator_servers.start(config, env={"ORCH_TEAM_A": "secret-team-a"})
    return server, worker


def chat(url: str, secret: str, content: str = "hi", **extra):
    client = openai.OpenAI(base_url=url + "/v1", api_key=secret, max_retries=0)
    return client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": content}], **extra)


async def test_usage_is_counted_per_key_name_and_never_shows_the_secret(keyed, engine_client):
    server, _ = keyed
    async with httpx.AsyncClient(base_url=server.url) as http:
        before = (await http.get("/metrics")).text
    assert metric(before, 'orchestrator_key_requests_total{key="one-at-a-time"}') == 0  # every key's series at 0
    long_prompt = "Tell me about the rivers and the mountains of the north " * 12  # whole KV blocks to reuse
    answers = [await trio.to_thread.run_sync(lambda: chat(server.url, "secret-team-a", long_prompt, max_tokens=2))
               for _ in range(2)]
    async with httpx.AsyncClient(base_url=server.url) as http:
        text = (await http.get("/metrics")).text
    assert metric(text, 'orchestrator_key_requests_total{key="team-a"}') == 2
    assert metric(text, 'orchestrator_key_prompt_tokens_total{key="team-a"}') == sum(
        a.usage.prompt_tokens for a in answers)
    assert metric(text, 'orchestrator_key_completion_tokens_total{key="team-a"}') == 4
    cached = sum((a.usage.prompt_tokens_details.cached_tokens or 0) if a.usage.prompt_tokens_details else 0
                 for a in answers)
    assert cached > 0  # the same prompt twice: the engine found it cached the second time
    assert metric(text, 'orchestrator_key_cached_prompt_tokens_total{key="team-a"}') == cached
    assert metric(text, 'orchestrator_key_requests_total{key="slow-lane"}') == 0
    assert "secret" not in text


async def test_a_key_over_its_request_rate_or_tokens_gets_a_429_with_retry_after_before_any_worker(
        keyed, engine_client):
    server, worker = keyed
    async with httpx.AsyncClient(base_url=server.url, headers={"authorization": "Bearer secret-slow"}) as http:
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "Tell me about rivers"}],
                "max_tokens": 2}
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        seen = len(await recent_requests(engine_client, worker))
        refused = await http.post("/v1/chat/completions", json=body)  # a second request within the same second
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert "slow-lane" in error["message"] and "1 requests per second" in error["message"]
        await trio.sleep(1.05)  # one request's worth back in the bucket: the rate lets it through
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        # two answered requests of ~20 prompt tokens each took the 40 tokens of the minute, and more
        await trio.sleep(1.05)
        over = await http.post("/v1/chat/completions", json=body)
        assert over.status_code == 429 and over.json()["error"]["code"] == "token_limit_exceeded", over.text
        assert int(over.headers["retry-after"]) >= 2  # the tokens refill at 40 a minute: seconds, not one
        assert len(await recent_requests(engine_client, worker)) == seen + 1  # the refused ones reached no worker
        metrics = (await http.get("/metrics")).text
    assert metric(metrics, 'orchestrator_key_rejections_total{code="rate_limit_exceeded",key="slow-lane"}') == 1
    assert metric(metrics, 'orchestrator_key_rejections_total{code="token_limit_exceeded",key="slow-lane"}') == 1
    assert metric(metrics, 'orchestrator_key_requests_total{key="slow-lane"}') == 2


async def test_a_key_at_its_concurrency_limit_gets_a_429_until_its_request_ends(keyed):
    server, _ = keyed
    headers = {"authorization": "Bearer secret-one"}
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30) as http:
        async with http.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 50}) as held:
            assert held.status_code == 200
            async for _ in held.aiter_bytes():  # the first token came; the worker stalls after the third
                break
            refused = await http.post("/v1/chat/completions", json={**body, "max_tokens": 2})
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "concurrency_limit_exceeded"
        # the held stream was closed: the server sees the disconnect and the key's slot is free again
        with trio.fail_after(10):
            while (done := await http.post("/v1/chat/completions", json={**body, "max_tokens": 2})).status_code == 429:
                await trio.sleep(0.05)
        assert done.status_code == 200


@pytest.fixture
def tenants(tmp_path, sim_workers, orchestrator_servers):
    """Two tenants' keys, each with its own cache salt, on one worker; a third key without one."""
    worker = sim_workers.start("aggregated", *FAST)
    config = write_config(tmp_path / "tenants.yaml", "aggregated", {"aggregated": [worker.address]}, auth={"keys": [
        {"name": "tenant-a", "key": "secret-a", "cache_salt": "salt-of-a"},
        {"name": "tenant-b", "key": "secret-b", "cache_salt": "salt-of-b"},
        {"name": "shared", "key": "secret-shared"}]})
    return orchestrator_servers.start(config), worker


def cached_tokens(answer) -> int:
    details = answer.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


async def test_a_tenant_never_reuses_or_learns_of_another_tenants_cache(tenants, engine_client):
    """Per-key cache salts (auth.keys[i].cache_salt): tenant B's request reports 0 cached tokens for the prompt
    tenant A just sent, while A's own repeat finds it cached; the request's own cache_salt (as vLLM takes it)
    splits one key's cache too. UPSTREAM cache-salt."""
    server, worker = tenants
    prompt = "Tell me about the rivers and the mountains of the north " * 12  # whole KV blocks to reuse

    def ask(secret, **extra):
        return trio.to_thread.run_sync(lambda: chat(server.url, secret, prompt, max_tokens=2, **extra))

    await ask("secret-a")
    assert cached_tokens(await ask("secret-a")) > 0  # the same tenant: its prompt is cached
    assert cached_tokens(await ask("secret-b")) == 0  # another tenant: nothing, though the blocks are there
    assert cached_tokens(await ask("secret-shared")) == 0  # nor a key without a salt
    first = await ask("secret-shared", extra_body={"cache_salt": "conversation-1"})
    assert cached_tokens(first) == 0
    assert cached_tokens(await ask("secret-shared", extra_body={"cache_salt": "conversation-1"})) > 0
    assert cached_tokens(await ask("secret-shared", extra_body={"cache_salt": "conversation-2"})) == 0
    salts = [r.get("cache_salt") for r in await recent_requests(engine_client, worker)]
    assert "key:salt-of-a" in salts and "request:conversation-1" in salts


def test_a_key_with_an_empty_cache_salt_is_a_config_error(tmp_path):
    path = write_config(tmp_path / "salt.yaml", "aggregated", {"aggregated": ["grpc://127.0.0.1:1"]},
                        auth={"keys": [{"name": "a", "key": "k", "cache_salt": " "}]})
    with pytest.raises(ConfigError) as error:
        config_module.load(path)
    assert "auth.keys[0].cache_salt" in str(error.value)
