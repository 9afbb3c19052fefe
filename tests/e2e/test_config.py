"""Config loading: every shipped file passes, typos and wrong types are named by file and key."""

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from orchestrator import config as config_module
from orchestrator.config import ConfigError
from orchestrator.launch import check_sim_workers
from orchestrator.testkit.plugin import orchestrator_command
from orchestrator.tls import TlsMaterial

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_passes_check_config(path):
    result = subprocess.run(orchestrator_command("check-config", str(path)), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("ok:"), result.stdout + result.stderr


def test_real_trtllm_examples_pass_without_host_paths():
    config_module.load(CONFIGS / "trtllm" / "disagg.yaml", check_paths=False)
    documents = list(yaml.safe_load_all((CONFIGS / "trtllm" / "k8s" / "disagg.yaml").read_text()))
    embedded = next(d for d in documents if d["kind"] == "ConfigMap")["data"]["orchestrator.yaml"]
    config = config_module.from_dict(yaml.safe_load(embedded), file="k8s ConfigMap", check_paths=False)
    assert config.discovery.etcd is not None
    assert config.discovery.etcd.endpoints == ("http://etcd:2379",)
    for name in ("prefill-engine.yaml", "decode-engine.yaml"):
        engine = yaml.safe_load((CONFIGS / "trtllm" / name).read_text())
        assert engine["cache_transceiver_config"]["backend"] in ("DEFAULT", "UCX", "NIXL", "MPI")
    assert yaml.safe_load((CONFIGS / "trtllm" / "prefill-engine.yaml").read_text())["disable_overlap_scheduler"]


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_check_config_names_a_typoed_key(tmp_path):
    path = write(tmp_path, "mode: aggregated\nrouting:\n  decdoe: round_robin\n")
    result = subprocess.run(orchestrator_command("check-config", str(path)), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"{path}: routing.decdoe: expected one of the known keys" in result.stdout


@pytest.mark.parametrize("text, words", [
    ("", "(file): expected a configuration: the file is empty"),
    ("mode: disaggregated\ndiscovery:\n  static: {prefill: [], decode: [grpc://10.0.0.2:50051]}\n",
     "discovery.static.prefill: expected at least one prefill worker for disaggregated mode"),
    ("mode: aggregated\n", "discovery.static.aggregated: expected at least one aggregated worker"),
    ("launch:\n  workers:\n    - {role: decode, sim: {profle: x}}\n",
     "launch.workers[0].sim.profle: expected one of the known keys"),  # inside a nested section, by name
])
def test_check_config_refuses_configs_that_cannot_serve(tmp_path, text, words):
    path = write(tmp_path, text)
    result = subprocess.run(orchestrator_command("check-config", str(path)), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and f"error: {path}: {words}" in result.stdout, result.stdout


def test_log_levels_are_case_insensitive_and_their_choices_are_in_the_help():
    ok = subprocess.run(orchestrator_command("--log-level", "debug", "check-config", "configs/agg.yaml"),
                        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(orchestrator_command("--log-level", "loud", "--help"), capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'LOUD'" in bad.stderr
    assert "{DEBUG,INFO,WARNING,ERROR,CRITICAL}" in subprocess.run(orchestrator_command("--help"), capture_output=True,
                                                                   text=True, timeout=60).stdout


def test_a_busy_port_is_one_clear_line_naming_the_port_and_the_flag(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = write(tmp_path, "mode: aggregated\ndiscovery:\n  static: {aggregated: [grpc://127.0.0.1:9]}\n")
        result = subprocess.run(orchestrator_command("serve", "-c", str(config), "--port", str(port)),
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    # lines logged at ERROR, or a traceback (a worker's WARNING may name an ERROR_CODE_...: not an error line)
    errors = [line for line in result.stderr.splitlines() if re.search(r"\bERROR\b|Traceback", line)]
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{port}" in errors[0] and "--port" in errors[0]


def test_check_config_names_a_missing_model_directory(tmp_path):
    path = write(tmp_path, "model:\n  dir: ./no-such-model\n")
    with pytest.raises(ConfigError) as info:
        config_module.load(path)
    assert info.value.key == "model.dir" and "tokenizer.json" in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("text, key, words", [
    ("mode: hybrid\n", "mode", "aggregated or disaggregated or conditional"),
    ("limits:\n  request_timeout_s: soon\n", "limits.request_timeout_s", "a number"),
    ("limits:\n  max_images: -1\n", "limits.max_images", "> 0"),
    ("http:\n  max_connections: 0\n", "http.max_connections", "> 0"),
    ("limits:\n  prefill_retries: -1\n", "limits.prefill_retries", ">= 0"),
    ("discovery:\n  static:\n    decode: [localhost:5]\n", "discovery.static.decode[0]", "grpc://HOST:PORT"),
    ("discovery:\n  static: {}\n  etcd: {}\n", "discovery", "exactly one of static or etcd"),
    ("launch:\n  workers:\n    - role: decode\n", "launch.workers[0]", "exactly one of sim or command"),
    ("launch:\n  workers:\n    - {role: decode, sim: {profile: h200}}\n", "launch.workers[0].sim.profile",
     "llama3-8b-h100"),
    ("launch:\n  workers:\n    - sim: {}\n", "launch.workers[0].role", "required"),
    ("launch:\n  workers:\n    - {role: decode, sim: {tool_call_parser: qwen2}}\n",
     "launch.workers[0].sim.tool_call_parser", "qwen3_coder"),
    ("launch:\n  workers:\n    - {role: decode, sim: {guided_backend: outlines}}\n",
     "launch.workers[0].sim.guided_backend", "xgrammar"),
    ("launch:\n  workers:\n    - {role: decode, sim: {}, env: {CUDA_VISIBLE_DEVICES: 0}}\n",
     "launch.workers[0].env.CUDA_VISIBLE_DEVICES", "a string"),
    ("http:\n  port: '8000'\n", "http.port", "an integer"),
    ("http:\n  processes: 0\n", "http.processes", "> 0"),
    ("stream_transport: grpc\n", "stream_transport", "grpcio or h2"),
    ("keepalive:\n  interval_s: 0\n", "keepalive.interval_s", "> 0"),
    ("keepalive:\n  timeout_s: ten\n", "keepalive.timeout_s", "a number"),
    ("keepalive:\n  time_s: 30\n", "keepalive.time_s", "interval_s, timeout_s"),
    ("- a list\n", "(top level)", "a mapping"),
    ("mode: [unclosed\n", "(syntax)", "valid YAML"),
])
def test_config_errors_name_file_key_and_expectation(tmp_path, text, key, words):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        check_sim_workers(config_module.load(path), str(path))  # what `check-config` and `launch` run
    assert info.value.key == key and words in str(info.value) and str(path) in str(info.value)


def test_http_server_is_retired_native_still_loads_and_hypercorn_is_refused_by_name(tmp_path):
    """An upgraded deployment whose config spelled out the default keeps loading; one that asked for the removed
    hypercorn server learns it at load, with the file, the key and what to write instead."""
    assert config_module.load(write(tmp_path, "http:\n  server: native\n  processes: 2\n")).http.processes == 2
    path = write(tmp_path, "http:\n  server: hypercorn\n")
    with pytest.raises(ConfigError) as info:
        config_module.load(path)
    assert info.value.key == "http.server" and str(path) in str(info.value)
    assert "native, the only HTTP server since hypercorn was removed" in str(info.value)
    assert "got 'hypercorn'" in str(info.value)


def test_a_missing_file_is_a_config_error():
    with pytest.raises(ConfigError, match="readable YAML file"):
        config_module.load("/no/such/config.yaml")


@pytest.mark.parametrize("etcd, key, words", [
    ("{cert_file: client.pem}", "discovery.etcd", "both cert_file and key_file"),
    ("{ca_file: no-such-ca.pem}", "discovery.etcd.ca_file", "a readable PEM file"),
])
def test_etcd_tls_files_are_named_when_they_cannot_be_used(tmp_path, etcd, key, words):
    path = write(tmp_path, f"discovery:\n  etcd: {etcd}\n")
    config = config_module.load(path)
    assert config.discovery.etcd is not None
    with pytest.raises(ConfigError) as info:
        config.discovery.etcd.tls(config.base_dir, config.source)
    assert info.value.key == key and words in str(info.value) and str(path) in str(info.value)


def test_etcd_tls_files_are_read_relative_to_the_config(tmp_path):
    (tmp_path / "ca.pem").write_bytes(b"CA")
    path = write(tmp_path, "discovery:\n  etcd: {endpoints: ['https://etcd:2379'], ca_file: ca.pem}\n")
    config = config_module.load(path)
    assert config.discovery.etcd is not None
    assert config.discovery.etcd.tls(config.base_dir, config.source) == TlsMaterial(ca=b"CA")


def test_the_config_knows_the_stream_transports_the_engine_client_has():
    from orchestrator.engine.client import STREAM_TRANSPORTS

    assert config_module.STREAM_TRANSPORTS == STREAM_TRANSPORTS


def check_config(*paths, flags=()) -> subprocess.CompletedProcess:
    return subprocess.run(orchestrator_command("check-config", *flags, *map(str, paths)), capture_output=True,
                          text=True, timeout=60)


def test_check_config_reports_every_error_of_a_file_not_only_the_first(tmp_path):
    path = write(tmp_path, "mode: sideways\nrouting: {decdoe: round_robin, prefill: sometimes}\n"
                           "limits: {migration_limit: -1, max_images: many}\n"
                           "launch:\n  workers:\n    - {role: chef, sim: {}}\n    - {role: decode, count: 0}\n")
    result = check_config(path)
    assert result.returncode == 1
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    # The structure first (unknown keys, types, validators), all of them; then nothing else can be checked.
    for words in ("routing.decdoe: expected one of the known keys", "limits.max_images: expected an integer",
                  "launch.workers[1].count: expected a number > 0"):
        assert any(f"{path}: {words}" in line for line in errors), result.stdout
    fixed = write(tmp_path, "mode: sideways\nrouting: {prefill: sometimes}\nlimits: {migration_limit: -1}\n"
                            "launch:\n  workers:\n    - {role: chef, sim: {}, restart: sometimes}\n")
    result = check_config(fixed)
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    for words in ("mode: expected aggregated or disaggregated or conditional", "routing.prefill: expected",
                  "limits.migration_limit: expected an integer >= 0", "launch.workers[0].role: expected",
                  "launch.workers[0].restart: expected always or on-failure or never"):
        assert any(f"{fixed}: {words}" in line for line in errors), result.stdout
    assert len(errors) == 5, result.stdout


def test_check_config_reads_the_config_inside_a_kubernetes_manifest():
    manifest = CONFIGS / "trtllm" / "k8s" / "disagg.yaml"
    result = check_config(manifest)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"ok: {manifest} (document 1): ConfigMap orchestrator-config, orchestrator.yaml: disaggregated mode" \
        in result.stdout
    assert "prefill-engine.yaml: not an orchestrator config" in result.stdout  # TRT-LLM's options: skipped, said so


def test_check_config_names_the_document_and_entry_of_each_error(tmp_path):
    manifest = (CONFIGS / "trtllm" / "k8s" / "disagg.yaml").read_text()
    broken = manifest.replace("    mode: disaggregated\n", "    mode: disagregated\n    retries: 3\n")
    assert broken != manifest
    path = write(tmp_path, broken)
    result = check_config(path)
    assert result.returncode == 1
    where = f"error: {path} (document 1): ConfigMap orchestrator-config, orchestrator.yaml"
    assert f"{where}: retries: expected one of the known keys" in result.stdout, result.stdout
    plain = write(tmp_path, "mode: aggregated\ndiscovery: {static: {aggregated: [grpc://127.0.0.1:1]}}\n---\n"
                            "mode: conditional\nlaunch: {workers: [{role: decode}]}\n")
    result = check_config(plain)
    assert result.returncode == 1
    assert f"ok: {plain} (document 1): aggregated mode" in result.stdout, result.stdout
    assert f"error: {plain} (document 2): launch.workers[0]: expected exactly one of sim or command" in result.stdout
