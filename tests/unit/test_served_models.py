"""Which served model a request's `model` names (frontend/served_models.py): a name, an alias, an adapter's own
name or MODEL:ADAPTER; and /v1/models' listing with each model's state."""

from __future__ import annotations

from orchestrator.config import AdapterConfig, Config, ModelConfig
from orchestrator.frontend.served_models import Deployment, ServedModels


class FakePool:
    def __init__(self, ready: dict[str, int], registry_healthy: bool = True):
        self.ready, self.registry_healthy = ready, registry_healthy

    def ready_count(self, role: str) -> int:
        return self.ready.get(role, 0)


def deployment(name: str, mode: str = "aggregated", *, aliases=(), adapters=(), ready=1, healthy=True) -> Deployment:
    config = Config(mode=mode, model=ModelConfig(name=name, aliases=tuple(aliases), adapters=tuple(
        AdapterConfig(adapter, f"/adapters/{adapter}") for adapter in adapters)))
    pool = FakePool(dict.fromkeys(config.needed_roles, ready), healthy)
    coordinator = type("FakeCoordinator", (), {"tokenizer": None})()
    return Deployment(config, coordinator=coordinator, pool=pool, parsers=None, metrics=None)  # type: ignore[arg-type]


def test_a_model_resolves_by_name_alias_adapter_name_and_model_colon_adapter():
    chat = deployment("chat", aliases=["c"], adapters=["sql"])
    coder = deployment("qwen3:8b", adapters=["rust"])  # a name holding ':' itself
    served = ServedModels([chat, coder])
    assert served.resolve("chat").deployment is chat and served.resolve("chat").adapter is None  # type: ignore
    assert served.resolve("c").deployment is chat  # type: ignore[union-attr]
    assert (served.resolve("sql").deployment, served.resolve("sql").adapter) == (chat, "sql")  # type: ignore
    assert (served.resolve("chat:sql").deployment, served.resolve("chat:sql").adapter) == (chat, "sql")  # type: ignore
    assert served.resolve("qwen3:8b").deployment is coder  # type: ignore[union-attr]
    assert (served.resolve("qwen3:8b:rust").deployment, served.resolve("qwen3:8b:rust").adapter) == (  # type: ignore
        coder, "rust")


def test_names_that_are_not_served_resolve_to_nothing():
    served = ServedModels([deployment("chat", adapters=["sql"]), deployment("coder", adapters=["rust"])])
    for unknown in ("nope", "chat:rust", "coder:sql", "chat:", ":sql", "CHAT", "chat:sql:x"):
        assert served.resolve(unknown) is None, unknown
    assert served.ids() == ["chat", "coder", "sql", "rust"]


def test_the_listing_has_every_model_alias_and_adapter_with_its_state():
    served = ServedModels([deployment("chat", "disaggregated", aliases=["c"], adapters=["sql"]),
                           deployment("small", ready=0), deployment("etcd-fed", healthy=False)])
    listing = served.listing()
    assert [(m["id"], m["root"], m["parent"], m["state"]) for m in listing] == [
        ("chat", "chat", None, "ready"), ("c", "chat", None, "ready"), ("sql", "chat", "chat", "ready"),
        ("small", "small", None, "not_ready"), ("etcd-fed", "etcd-fed", None, "degraded")]
    assert all(m["object"] == "model" and m["owned_by"] == "orchestrator" for m in listing)
    assert served.entry("sql") == listing[2] and served.entry("chat:sql") is None
