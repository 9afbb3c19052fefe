"""The simulated sibling server's LoRA registry and its prefix cache's adapter scopes, without processes
(UPSTREAM lora-registry and lora-reuse-scope in tests/e2e/test_trtllm_conformance.py)."""

from __future__ import annotations

import hashlib
import json

import pytest

from orchestrator.sim import output
from orchestrator.sim.lora import LoraRefused, LoraRegistry
from orchestrator.sim.prefix_cache import ROOT_KEY, BlockStored, PrefixCache, root_key


def adapter_dir(tmp_path, name: str, *, config: object = None, weights: bool = True):
    path = tmp_path / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": 8} if config is None else config))
    if weights:
        (path / "adapter_model.safetensors").write_bytes(b"\0")
    return str(path)


def test_load_checks_the_adapters_directory_as_the_sibling_server_does(tmp_path):
    registry = LoraRegistry()
    for path, why in ((str(tmp_path / "absent"), "not a directory"),
                      (adapter_dir(tmp_path, "noweights", weights=False), "missing adapter weights"),
                      (adapter_dir(tmp_path, "list", config=[1]), "must contain an object")):
        with pytest.raises(LoraRefused, match=why):
            registry.load(1, "x", path)
    with pytest.raises(LoraRefused, match="non-negative"):
        registry.load(-1, "x", adapter_dir(tmp_path, "ok"))
    assert registry.listed() == []


def test_a_name_is_bound_to_its_id_and_path_for_the_life_of_the_process(tmp_path):
    registry = LoraRegistry()
    sql, poet = adapter_dir(tmp_path, "sql"), adapter_dir(tmp_path, "poet")
    adapter, already = registry.load(5, "sql", sql)
    assert not already and (adapter.lora_id, adapter.name) == (5, "sql")
    assert registry.load(5, "sql", sql)[1]  # the same again: already_loaded
    with pytest.raises(LoraRefused, match="different attributes"):
        registry.load(6, "sql", sql)
    with pytest.raises(LoraRefused, match="ID 5 is permanently bound"):
        registry.load(5, "poet", poet)
    with pytest.raises(LoraRefused, match=r"path .* is permanently bound"):
        registry.load(6, "poet", sql)
    registry.unload("sql")
    with pytest.raises(KeyError):
        registry.unload("sql")
    assert registry.get("sql") is None
    assert registry.load(5, "sql", sql) == (adapter, False)  # loaded again after an unload: registered anew
    registry.load(6, "poet", poet)
    assert [a.name for a in registry.listed()] == ["poet", "sql"]  # by name


def test_an_adapters_blocks_are_cached_in_its_own_reuse_scope_and_reported_with_it():
    """ReuseScope(lora_id, salt).to_bytes(): mask bit 0 the adapter, bit 1 the salt, each value 8 bytes LE."""
    assert root_key(None, 7) == hashlib.sha256(b"\x01" + (7).to_bytes(8, "little")).digest()
    assert root_key("s", 7) == hashlib.sha256(b"\x03" + (7).to_bytes(8, "little")
                                              + hashlib.sha256(b"s").digest()[:8]).digest()
    assert len({ROOT_KEY, root_key(None, 7), root_key(None, 8), root_key("s"), root_key("s", 7)}) == 5
    cache = PrefixCache(4)
    tokens = list(range(1, 18))
    lease = cache.acquire(tokens, lora=(7, "sql"))
    cache.store(lease, tokens)
    cache.release(lease)
    (stored,) = cache.take_events()
    assert isinstance(stored, BlockStored) and stored.lora == (7, "sql") and len(stored.block_hashes) == 4
    assert cache.acquire(tokens, lora=(7, "sql")).cached_tokens == 16
    assert cache.acquire(tokens).cached_tokens == 0  # the base model reuses none of it
    assert cache.acquire(tokens, lora=(8, "poet")).cached_tokens == 0


def test_each_adapter_writes_its_own_text():
    base = output.request_key([1, 2, 3], [], 0)
    assert output.request_key([1, 2, 3], [], 0, "") == base
    assert len({base, output.request_key([1, 2, 3], [], 0, "sql"), output.request_key([1, 2, 3], [], 0, "poet")}) == 3
