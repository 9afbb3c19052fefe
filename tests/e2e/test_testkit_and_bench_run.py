"""The testkit's in-process orchestrator, least-loaded routing live, and `bench run` with Poisson arrivals."""

import json
import subprocess

import httpx
import pytest

from orchestrator.testkit.plugin import orchestrator_command, wait_for_load, write_config


async def test_orchestrator_runs_in_process_on_the_tests_trio_loop(tmp_path, sim_workers, orchestrator_in_process,
                                                                   engine_client):
    """And least-loaded routing sends a burst to the idle worker: round robin would split it evenly."""
    import trio

    busy, idle = (sim_workers.start("aggregated", "--time-scale", "1") for _ in range(2))
    config = write_config(tmp_path / "inproc.yaml", "aggregated", {"aggregated": [busy.address, idle.address]},
                          routing={"aggregated": "least_loaded", "load_staleness_ms": 3000})
    async with engine_client(busy.address) as direct:
        async with trio.open_nursery() as background:
            for i in range(6):  # six long requests keep `busy` busy, straight through the engine client
                background.start_soon(_collect, direct, f"hog{i}")
            await wait_for_load(direct, lambda info: info.running_requests == 6)
            async with orchestrator_in_process(config) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
                await trio.sleep(1.6)  # a GetLoad sample of each worker (one every 1.5 s), fresh for 3 s
                statuses = []

                async def one():
                    response = await http.post("/v1/chat/completions", json={
                        "model": "tiny-chat", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
                    statuses.append(response.status_code)

                async with trio.open_nursery() as nursery:
                    for _ in range(6):
                        nursery.start_soon(one)
                assert statuses == [200] * 6
                metrics = (await http.get("/metrics")).text
            background.cancel_scope.cancel()
    assert "orchestrator_requests_total" in metrics
    async with engine_client(idle.address) as client:
        served_by_idle = (await client.load()).attributes.fields["tokens_emitted"].number_value / 4
    assert served_by_idle >= 5, served_by_idle  # round robin: 3


async def _collect(client, rid):
    from orchestrator.openengine.v1 import generation_pb2 as g

    request = g.GenerateRequest(request_id=rid, model="tiny-chat", token_ids=g.TokenIds(ids=[5, 6, 7]),
                                stopping=g.StoppingOptions(max_tokens=4000, ignore_eos=True))
    async with client.generate(request) as stream:
        async for _ in stream:
            pass


def test_bench_run_with_poisson_arrivals_reports_every_metric(tmp_path, sim_workers, orchestrator_servers):
    worker = sim_workers.start("aggregated", "--time-scale", "0.02", "--schema-revision", "3")  # images
    server = orchestrator_servers.start(write_config(tmp_path / "b.yaml", "aggregated",
                                                     {"aggregated": [worker.address]}))
    out = tmp_path / "run.json"
    result = subprocess.run(orchestrator_command("bench", "run", "--url", server.url, "--rate", "20", "--requests",
                                                 "10", "--input-len", "50:80", "--output-len", "6", "--image-share",
                                                 "0.5", "--slo-ttft", "5", "--out", str(out)),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (point,) = json.loads(out.read_text())["points"]
    assert point["load_kind"] == "rate" and point["completed"] == 10 and point["errors"] == {}
    assert point["output_tokens_mean"] == 6 and 50 <= point["input_tokens_mean"]
    assert point["goodput"] > 0 and point["request_throughput"] > 0
    assert "10/10" in result.stderr  # the progress bar


def test_bench_run_counts_a_thinking_models_reasoning_as_its_output(tmp_path, sim_workers, orchestrator_servers):
    """The demo's model thinks first (reasoning_parser qwen3): its first tokens reach clients as
    reasoning_content. They are output (and the first of them the time to first token), not a missing answer."""
    worker = sim_workers.start("aggregated", "--time-scale", "0", "--reasoning-parser", "qwen3")
    server = orchestrator_servers.start(write_config(tmp_path / "think.yaml", "aggregated",
                                                     {"aggregated": [worker.address]}))
    out = tmp_path / "run.json"
    result = subprocess.run(orchestrator_command("bench", "run", "--url", server.url, "--concurrency", "1",
                                                 "--requests", "4", "--input-len", "40", "--output-len", "8",
                                                 "--out", str(out)), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (point,) = json.loads(out.read_text())["points"]
    assert point["completed"] == 4 and point["errors"] == {} and point["output_tokens_mean"] == 8


@pytest.mark.parametrize("time_scale", ["1", "0.1"])
def test_a_closed_loop_bench_run_reports_rates_its_latencies_allow_at_any_time_scale(
        tmp_path, sim_workers, orchestrator_servers, time_scale):
    """GPU-time figures must be self-consistent: N users cannot complete more than N / latency requests/s.

    By Little's law the bound is N / mean latency; the median is not a bound (a few fast requests under a
    busy CPU put the median above the mean)."""
    worker = sim_workers.start("aggregated", "--time-scale", time_scale, "--profile", "llama3-8b-h100")
    server = orchestrator_servers.start(write_config(tmp_path / "c.yaml", "aggregated",
                                                     {"aggregated": [worker.address]}))
    out = tmp_path / "closed.json"
    result = subprocess.run(orchestrator_command("bench", "run", "--url", server.url, "--concurrency", "2",
                                                 "--requests", "12", "--warmup", "1", "--input-len", "500",
                                                 "--output-len", "20", "--time-scale", time_scale, "--out", str(out)),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (point,) = json.loads(out.read_text())["points"]
    assert point["completed"] == 12
    assert point["request_throughput"] <= 2 / point["e2e_s"]["mean"] * 1.05
    assert point["output_tokens_per_s"] <= 2 * point["tokens_per_s_per_user"] * 1.05


def test_bench_run_help_shows_every_default_and_what_input_lengths_count():
    import os

    result = subprocess.run(orchestrator_command("bench", "run", "--help"), capture_output=True, text=True, timeout=60,
                            env={**os.environ, "COLUMNS": "300"})  # one line per option
    text = " ".join(result.stdout.split("options:", 1)[1].split())
    for option, default in (("--model MODEL", "(default: tiny-chat)"), ("--warmup WARMUP", "(default: 2)"),
                            ("--image-share IMAGE_SHARE", "(default: 0.0)"), ("--seed SEED", "(default: 0)"),
                            ("--timeout TIMEOUT", "(default: 600.0)"), ("--label LABEL", "(default: the URL)")):
        described = text.split(option, 1)[1].split(" --", 1)[0]
        assert default in described, (option, described)
    assert "requests sent before each load point" in text and "seconds a request may take" in text  # the units
    assert "counted before the chat template" in text


def test_bench_run_prints_the_servers_error_not_nan_figures_and_no_carriage_returns_in_a_log(
        tmp_path, sim_workers, orchestrator_servers):
    worker = sim_workers.start("aggregated", "--time-scale", "0")
    server = orchestrator_servers.start(write_config(tmp_path / "e.yaml", "aggregated",
                                                     {"aggregated": [worker.address]}))
    result = subprocess.run(orchestrator_command("bench", "run", "--url", server.url, "--model", "no-such-model",
                                                 "--concurrency", "2", "--requests", "4", "--warmup", "0",
                                                 "--input-len", "8", "--output-len", "2"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "nan" not in result.stdout, result.stdout
    assert "no request completed" in result.stdout
    assert "4 x http_404: the model 'no-such-model' does not exist" in result.stdout, result.stdout
    assert "\r" not in result.stderr and "4/4 requests, errors 4" in result.stderr  # stderr is no terminal here
