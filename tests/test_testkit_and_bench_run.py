"""The testkit's in-process orchestrator, least-loaded routing live, and `bench run` with Poisson arrivals."""

import json
import subprocess

import httpx
import pytest

from orchestrator.testing import python_command, write_config


async def test_orchestrator_runs_in_process_on_the_tests_trio_loop(tmp_path, sim_workers, orchestrator_in_process):
    workers = [sim_workers.start("aggregated", "--time-scale", "0.05") for _ in range(2)]
    config = write_config(tmp_path / "inproc.yaml", "aggregated", {"aggregated": [w.address for w in workers]},
                          routing={"aggregated": "least_loaded", "load_staleness_ms": 100})
    async with orchestrator_in_process(config) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            import trio

            statuses = []

            async def one():
                response = await http.post("/v1/chat/completions", json={
                    "model": "tiny-chat", "max_tokens": 30, "messages": [{"role": "user", "content": "hi"}]})
                statuses.append(response.status_code)

            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(one)
            assert statuses == [200] * 8
            metrics = (await http.get("/metrics")).text
    assert "orchestrator_requests_total" in metrics
    # least loaded spread the burst over both workers
    from orchestrator.engine import EngineClient, LoopThread

    async with LoopThread.open() as loop_thread:
        for worker in workers:
            async with EngineClient.open(worker.address, loop_thread) as client:
                load = await client.load()
                assert load.attributes.fields["tokens_emitted"].number_value >= 30


def test_bench_run_with_poisson_arrivals_reports_every_metric(tmp_path, sim_workers, orchestrator_servers):
    worker = sim_workers.start("aggregated", "--time-scale", "0.02", "--schema-revision", "3")  # images
    server = orchestrator_servers.start(write_config(tmp_path / "b.yaml", "aggregated",
                                                     {"aggregated": [worker.address]}))
    out = tmp_path / "run.json"
    result = subprocess.run(python_command("bench", "run", "--url", server.url, "--rate", "20", "--requests", "10",
                                           "--input-len", "50:80", "--output-len", "6", "--image-share", "0.5",
                                           "--slo-ttft", "5", "--out", str(out)),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (point,) = json.loads(out.read_text())["points"]
    assert point["load_kind"] == "rate" and point["completed"] == 10 and point["errors"] == {}
    assert point["output_tokens_mean"] == 6 and 50 <= point["input_tokens_mean"]
    assert point["goodput"] > 0 and point["request_throughput"] > 0
    assert "10/10" in result.stderr  # the progress bar


@pytest.mark.parametrize("time_scale", ["1", "0.1"])
def test_a_closed_loop_bench_run_reports_rates_its_latencies_allow_at_any_time_scale(
        tmp_path, sim_workers, orchestrator_servers, time_scale):
    """GPU-time figures must be self-consistent: N users cannot complete more than N / latency requests/s."""
    worker = sim_workers.start("aggregated", "--time-scale", time_scale, "--profile", "llama3-8b-h100")
    server = orchestrator_servers.start(write_config(tmp_path / "c.yaml", "aggregated",
                                                     {"aggregated": [worker.address]}))
    out = tmp_path / "closed.json"
    result = subprocess.run(python_command("bench", "run", "--url", server.url, "--concurrency", "2", "--requests",
                                           "12", "--warmup", "1", "--input-len", "500", "--output-len", "20",
                                           "--time-scale", time_scale, "--out", str(out)),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (point,) = json.loads(out.read_text())["points"]
    assert point["completed"] == 12
    assert point["request_throughput"] <= 2 / point["e2e_s"]["p50"] * 1.05
    assert point["output_tokens_per_s"] <= 2 * point["tokens_per_s_per_user"] * 1.05
