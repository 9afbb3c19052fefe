"""A worker that streams tokens to us is alive: a health check it answers late under load keeps it in the pool.

Issue 43 point 7: with 1,024 streams on 2 aggregated workers, their Health answers came after the 1 s timeout and
both were marked unhealthy for about 1.4 s (65 requests got 503 "no aggregated worker is available"). Here the
simulated workers answer Health 1.6 s late whenever they run requests (--health-delay; the check times out after
1 s), and clients keep sending requests for longer than several health rounds.
"""

import httpx
import trio

from orchestrator.testkit.plugin import write_config
from serve_helpers import chat_body, sse_events

CLIENTS = 24
REQUESTS_EACH = 3  # of 160 tokens each at time scale 1: about 4 s of load, several health rounds (0.2 s apart,
                   # each timing out after 1 s while the workers answer 1.6 s late)


async def test_workers_streaming_tokens_stay_in_the_pool_while_their_health_answers_late(
        tmp_path, sim_workers, orchestrator_in_process):
    workers = [sim_workers.start("aggregated", "--time-scale", "1", "--health-delay", "1.6") for _ in range(2)]
    config = write_config(tmp_path / "late-health.yaml", "aggregated",
                          {"aggregated": [w.address for w in workers]})
    failures: list[str] = []
    done = 0
    states: set[str] = set()

    async with orchestrator_in_process(config) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        async def client(n: int) -> None:
            nonlocal done
            for i in range(REQUESTS_EACH):
                response = await http.post("/v1/chat/completions", json=chat_body(
                    f"client {n} request {i}", max_tokens=160, stream=True, ignore_eos=True))
                events = sse_events(response.text)
                if response.status_code != 200 or events[-1] != "[DONE]" or any(
                        isinstance(e, dict) and "error" in e for e in events):
                    failures.append(f"{response.status_code} {response.text[:200]}")
                else:
                    done += 1

        async def watch_health() -> None:
            while True:
                for worker in (await http.get("/health")).json()["workers"]:
                    states.add(worker["state"])
                await trio.sleep(0.1)

        # both workers in the pool before the load starts: /health is 200 once one of them is (a worker still
        # connecting on a busy machine is not what this test is about)
        with trio.fail_after(30):
            while {w["state"] for w in (await http.get("/health")).json()["workers"]} != {"ready"}:
                await trio.sleep(0.05)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_health)
            async with trio.open_nursery() as clients:
                for n in range(CLIENTS):
                    clients.start_soon(client, n)
            nursery.cancel_scope.cancel()
        metrics = (await http.get("/metrics")).text

    assert failures == [] and done == CLIENTS * REQUESTS_EACH
    assert states == {"ready"}
    # the health checks did time out meanwhile: kept in the pool because their streams flowed
    late = [line for line in metrics.splitlines() if line.startswith("orchestrator_health_checks_late_total")]
    assert late and sum(float(line.rsplit(" ", 1)[1]) for line in late) > 0


class _QuietClient:
    """What the monitor asks of a client after a failed health check: did anything arrive; fail the silent calls."""

    def __init__(self, heard: bool):
        self.heard, self.failed = heard, 0

    def heard_within(self, seconds: float) -> bool:
        return self.heard

    def fail_calls_if_silent(self, quiet_s: float, why: str) -> int:
        self.failed += 1
        return 0


def _monitor_after(errors, *, heard: bool):
    import grpc

    from orchestrator.config import RoutingConfig
    from orchestrator.discovery.snapshots import WorkerSpec
    from orchestrator.engine import WorkerUnavailable
    from orchestrator.engine.errors import EngineError
    from orchestrator.metrics import Metrics
    from orchestrator.workers.pool import Worker, WorkerPool
    from orchestrator.workers.states import WorkerState

    pool = WorkerPool(loop_thread=None, metrics=Metrics(), routing=RoutingConfig(), model="m")  # type: ignore
    worker = Worker(WorkerSpec(address="grpc://127.0.0.1:9", role="aggregated"))
    worker.state = WorkerState.READY
    client = _QuietClient(heard)
    kinds = {"timeout": WorkerUnavailable("Health timed out", worker="w", rpc="Health",
                                          grpc_status=grpc.StatusCode.DEADLINE_EXCEEDED),
             "refused": WorkerUnavailable("connection refused", worker="w", rpc="Health",
                                          grpc_status=grpc.StatusCode.UNAVAILABLE),
             "answer": EngineError("internal", worker="w", rpc="Health")}
    states = []
    for kind in errors:
        pool.monitor._on_health_error(worker, client, 1.0, kinds[kind])  # type: ignore[arg-type]
        states.append(str(worker.state))
    return states, client.failed


def test_a_timed_out_health_check_with_nothing_arriving_counts_only_the_second_time_in_a_row():
    """A starved host answers late with its streams silent (long prefills): one miss is not a verdict."""
    assert _monitor_after(["timeout", "timeout"], heard=False) == (["ready", "unhealthy"], 1)


def test_a_timed_out_health_check_while_streams_flow_never_takes_the_worker_out():
    assert _monitor_after(["timeout"] * 5, heard=True) == (["ready"] * 5, 0)


def test_a_refused_connection_or_an_error_answer_counts_at_once():
    assert _monitor_after(["refused"], heard=True) == (["unhealthy"], 1)
    assert _monitor_after(["answer"], heard=False) == (["unhealthy"], 0)
