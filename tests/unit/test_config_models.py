"""`models:` in the config: each entry a single-model view inheriting the top level key by key; errors named
per model; names unique across models; launched workers, API keys and --worker overrides naming models."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator import config_check
from orchestrator.config import ConfigError, from_dict, serving_problem
from orchestrator.serve import apply_etcd_overrides, apply_worker_overrides

STATIC = {"static": {"prefill": ["grpc://10.0.0.1:1"], "decode": ["grpc://10.0.0.2:1"]}}


def two_models(**top) -> dict:
    return {"mode": "disaggregated", "routing": {"prefill": "round_robin", "decode": "round_robin"},
            "discovery": STATIC, **top,
            "models": [{"name": "chat", "aliases": ["c"]},
                       {"name": "small", "mode": "aggregated", "routing": {"aggregated": "kv_aware"},
                        "discovery": {"static": {"aggregated": ["grpc://10.0.0.3:1"]}},
                        "adapters": [{"name": "sql", "source_path": "adapters/sql"}]}]}


def keys_of(error: ConfigError) -> list[str]:
    return [each.key for each in error.errors]


def test_the_single_model_form_is_a_list_of_one():
    config = from_dict({"mode": "aggregated", "model": {"name": "m"}, "discovery": {"static": {}}})
    assert config.models == (config,) and config.model.name == "m"


def test_each_entry_inherits_what_it_does_not_set_key_by_key():
    config = from_dict(two_models(limits={"request_timeout_s": 7}), base_dir=Path("/srv/conf"))
    chat, small = config.models
    assert config.model.name == "chat" and config.mode == "disaggregated"  # the top level is the first model
    assert (chat.mode, small.mode) == ("disaggregated", "aggregated")
    assert chat.discovery == small.discovery.__class__(static=chat.discovery.static)
    assert small.discovery.static is not None and small.discovery.static.aggregated == ("grpc://10.0.0.3:1",)
    assert small.discovery.static.prefill == ()  # an entry's static lists are its own
    # routing.aggregated set by the entry; the top level's prefill and decode kept
    assert (small.routing.aggregated, small.routing.prefill, small.routing.decode) == (
        "kv_aware", "round_robin", "round_robin")
    assert chat.limits.request_timeout_s == small.limits.request_timeout_s == 7
    assert small.model.adapters[0].resolved_source_path(config.base_dir) == "/srv/conf/adapters/sql"


def test_an_entry_naming_etcd_drops_the_top_levels_static_lists():
    data = two_models()
    data["models"][0]["discovery"] = {"etcd": {"namespace": "prod"}}
    chat = from_dict(data).models[0]
    assert chat.discovery.static is None and chat.discovery.etcd is not None
    assert chat.discovery.etcd.namespace == "prod"


def test_errors_name_the_entrys_key_and_an_inherited_one_once_at_its_own_key():
    data = two_models(routing={"decode": "sideways"})
    data["models"][0]["routing"] = {"prefill": "bogus"}
    data["models"][1]["colour"] = "blue"
    data["models"][1]["context_window"] = -1
    with pytest.raises(ConfigError) as error:
        from_dict(data)
    assert sorted(keys_of(error.value)) == sorted([
        "routing.decode", "models[0].routing.prefill", "models[1].colour", "models[1].context_window"])


def test_model_and_models_together_are_refused():
    with pytest.raises(ConfigError) as error:
        from_dict({**two_models(), "model": {"name": "x"}})
    assert keys_of(error.value) == ["model"]


def test_names_aliases_and_adapters_are_unique_across_models_naming_both_entries():
    data = two_models()
    data["models"][1]["aliases"] = ["c"]
    data["models"][1]["adapters"] = [{"name": "chat", "source_path": "x"}]
    with pytest.raises(ConfigError) as error:
        from_dict(data)
    assert keys_of(error.value) == ["models[1].aliases[0]", "models[1].adapters[0].name"]
    assert "models[0].aliases[0] has it" in str(error.value) and "models[0].name has it" in str(error.value)


def test_a_model_or_adapter_needs_a_name():
    data = two_models()
    data["models"][1]["adapters"] = [{"name": " ", "source_path": "x"}]
    with pytest.raises(ConfigError) as error:
        from_dict(data)
    assert keys_of(error.value) == ["models[1].adapters[0].name"]


def test_launched_workers_name_their_model_when_there_are_several():
    data = two_models(launch={"workers": [{"role": "decode", "sim": {}}, {"role": "aggregated", "model": "nope",
                                                                          "sim": {}}]})
    with pytest.raises(ConfigError) as error:
        from_dict(data)
    assert keys_of(error.value) == ["launch.workers[0].model", "launch.workers[1].model"]
    data = two_models(launch={"workers": [{"role": "aggregated", "model": "small", "sim": {}}]})
    data["models"][1]["discovery"] = {"static": {"aggregated": []}}
    config = from_dict(data)
    assert serving_problem(config, "f") is None  # the launched worker serves small
    data["launch"]["workers"][0]["model"] = "chat"
    problem = serving_problem(from_dict(data), "f")
    assert problem is not None and problem.key == "models[1].discovery.static.aggregated"


def test_an_api_key_names_models_that_are_served():
    data = two_models(auth={"keys": [{"name": "k", "key": "s", "models": ["c", "nope"]}]})
    with pytest.raises(ConfigError) as error:
        from_dict(data)
    assert keys_of(error.value) == ["auth.keys[0].models[1]"]


def test_worker_overrides_name_the_model_when_there_are_several():
    config = from_dict(two_models())
    changed = apply_worker_overrides(config, ["small:aggregated=grpc://h:1", "c:prefill=grpc://h:2"])
    chat, small = changed.models
    assert small.discovery.static is not None and small.discovery.static.aggregated == ("grpc://h:1",)
    assert chat.discovery.static is not None and chat.discovery.static.prefill == ("grpc://h:2",)
    assert chat.discovery.static.decode == ("grpc://10.0.0.2:1",)
    assert changed.discovery == chat.discovery  # the top level is still the first model
    with pytest.raises(ConfigError):
        apply_worker_overrides(config, ["aggregated=grpc://h:1"])  # which model's?
    with pytest.raises(ConfigError):
        apply_worker_overrides(config, ["other:aggregated=grpc://h:1"])
    single = from_dict({"mode": "aggregated", "discovery": {"static": {}}})
    static = apply_worker_overrides(single, ["aggregated=grpc://h:1"]).discovery.static
    assert static is not None and static.aggregated == ("grpc://h:1",)


def test_etcd_endpoint_overrides_reach_every_model_with_etcd_discovery():
    data = two_models()
    data["models"][0]["discovery"] = {"etcd": {"namespace": "prod"}}
    chat, small = apply_etcd_overrides(from_dict(data), ["http://e:2379"]).models
    assert chat.discovery.etcd is not None and chat.discovery.etcd.endpoints == ("http://e:2379",)
    assert small.discovery.etcd is None and small.discovery.static is not None


def test_check_config_prints_one_ok_line_per_model(tmp_path, capsys):
    import yaml

    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(two_models(launch={"workers": [
        {"role": "aggregated", "model": "small", "count": 2, "sim": {}}]})))
    assert config_check.run(type("Args", (), {"config": [path], "no_path_checks": False})()) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert "disaggregated mode, model chat" in lines[0] and "0 launched workers" in lines[0]
    assert "aggregated mode, model small" in lines[1] and "2 launched workers" in lines[1]


def test_check_config_counts_one_launched_worker_in_the_singular(tmp_path, capsys):
    path = tmp_path / "one.yaml"
    path.write_text("mode: aggregated\nlaunch:\n  workers:\n    - {role: aggregated, sim: {time_scale: 0}}\n")
    assert config_check.run(type("Args", (), {"config": [path], "no_path_checks": False})()) == 0
    out = capsys.readouterr().out
    assert "1 launched worker" in out and "1 launched workers" not in out
