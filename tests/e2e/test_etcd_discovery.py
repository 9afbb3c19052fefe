"""Worker discovery through a real etcd server, with real sim-worker and orchestrator processes."""

import signal
import subprocess
import time

import httpx
import pytest
import trio

from orchestrator.discovery import keys
from orchestrator.discovery.snapshots import WorkerSpec
from orchestrator.testkit.plugin import EtcdServer, orchestrator_command, write_config

pytestmark = pytest.mark.etcd
FAST = ("--time-scale", "0.02")
TTL = 3


def sim_flags(etcd, *extra):
    return (*FAST, "--etcd", etcd.url, "--etcd-namespace", "test", "--etcd-ttl", str(TTL), *extra)


def etcd_config(tmp_path, etcd, mode="disaggregated", name="etcd.yaml"):
    return write_config(tmp_path / name, mode, etcd={"endpoints": [etcd.url], "namespace": "test"},
                        limits={"worker_startup_timeout_s": 0.5, "health_interval_s": 0.2})


async def pool_addresses(http, url):
    return {(w["role"], w["address"]) for w in (await http.get(url + "/health")).json()["workers"]}


async def wait_until(predicate, timeout, interval=0.05):
    start = trio.current_time()
    with trio.fail_after(timeout):
        while not await predicate():
            await trio.sleep(interval)
    return trio.current_time() - start


def chat(max_tokens=2):
    return {"model": "tiny-chat", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]}


def test_key_layout_and_values_round_trip():
    spec = WorkerSpec(address="grpc://10.0.0.5:50051", role="decode", model="llama", instance_id="d-1")
    key = keys.worker_key("prod", "llama", "decode", "d-1")
    assert key == "prod/workers/llama/decode/d-1"
    assert keys.parse_entry(key, keys.worker_value(spec, schema_revision=1)) == spec
    for bad in (b"not json", b"[]", b'{"address": "http://x", "role": "decode"}', b'{"address": "grpc://x:1"}'):
        with pytest.raises(keys.BadEntry):
            keys.parse_entry(key, bad)
    with pytest.raises(ValueError):
        keys.worker_key("prod", "llama", "decode", "a/b")


async def test_workers_arrive_serve_and_leave_through_etcd(tmp_path, etcd_server, sim_workers, orchestrator_servers):
    server = orchestrator_servers.start(etcd_config(tmp_path, etcd_server))
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await http.get(server.url + "/health")).status_code == 503  # nobody registered yet
        prefill = sim_workers.start("prefill", *sim_flags(etcd_server))
        decode = sim_workers.start("decode", *sim_flags(etcd_server))
        registered_at = time.monotonic()  # both printed `ready` only after their key was written

        async def serves():
            return (await http.post(server.url + "/v1/chat/completions", json=chat())).status_code == 200

        await wait_until(serves, timeout=5, interval=0.02)
        assert time.monotonic() - registered_at < 1.0, "a new worker gets traffic within 1 s of registering"

        # SIGKILL: no goodbye; the lease expires within TTL and the worker leaves the pool
        decode.process.process.kill()
        gone = await wait_until(lambda: _without(http, server.url, decode.address), timeout=TTL + 2)
        # it left when its lease expired (at least TTL minus one keep-alive interval), not before and not later
        assert TTL * 2 / 3 - 0.5 <= gone <= TTL + 1.0
        # draining (SIGTERM): the registration withdraws at once
        decode2 = sim_workers.start("decode", *sim_flags(etcd_server))
        await wait_until(lambda: _with(http, server.url, decode2.address), timeout=5)
        prefill.process.signal(signal.SIGTERM)
        left = await wait_until(lambda: _without(http, server.url, prefill.address), timeout=5)
        assert left < 1.0


async def _with(http, url, address):
    return any(a == address for _, a in await pool_addresses(http, url))


async def _without(http, url, address):
    return not await _with(http, url, address)


async def test_two_orchestrators_see_the_same_pool(tmp_path, etcd_server, sim_workers, orchestrator_servers):
    first = orchestrator_servers.start(etcd_config(tmp_path, etcd_server, name="a.yaml"))
    second = orchestrator_servers.start(etcd_config(tmp_path, etcd_server, name="b.yaml"))
    sim_workers.start("prefill", *sim_flags(etcd_server))
    sim_workers.start("decode", *sim_flags(etcd_server))
    async with httpx.AsyncClient(timeout=30) as http:
        async def both_full():
            a, b = await pool_addresses(http, first.url), await pool_addresses(http, second.url)
            return len(a) == 2 and a == b

        await wait_until(both_full, timeout=5)
        for server in (first, second):
            assert (await http.post(server.url + "/v1/chat/completions", json=chat())).status_code == 200


async def test_etcd_outage_keeps_serving_and_the_pool_resynchronises(tmp_path, sim_workers, orchestrator_servers):
    etcd = EtcdServer(tmp_path)  # our own: this test stops and restarts it
    try:
        server = orchestrator_servers.start(etcd_config(tmp_path, etcd))
        prefill = sim_workers.start("prefill", *sim_flags(etcd))
        decode = sim_workers.start("decode", *sim_flags(etcd))
        leaver = sim_workers.start("decode", *sim_flags(etcd))
        failures, sent = [], 0
        async with httpx.AsyncClient(timeout=30) as http:
            await wait_until(lambda: _count(http, server.url, 3), timeout=5)
            etcd.stop()
            stopped_at = trio.current_time()

            async def degraded():
                return (await http.get(server.url + "/health")).json()["status"] == "degraded"

            await wait_until(degraded, timeout=5)
            leaver.process.process.kill()  # leaves while etcd cannot see it
            while trio.current_time() - stopped_at < 15:
                response = await http.post(server.url + "/v1/chat/completions", json=chat())
                sent += 1
                if response.status_code != 200:
                    failures.append(response.text)
                await trio.sleep(0.1)
            etcd.start()
            # the pool resynchronises: ready again, and the leaver's key expires once etcd is back (its
            # lease is restored with a fresh TTL plus an election timeout; our reconnect backs off <= 2 s)
            live = {prefill.address, decode.address}
            flaps = []

            async def leaver_gone_and_live_workers_kept():
                addresses = {a for _, a in await pool_addresses(http, server.url)}
                if not live <= addresses:  # a live worker's lease must survive the restart
                    flaps.append(sorted(live - addresses))
                return leaver.address not in addresses

            try:
                await wait_until(leaver_gone_and_live_workers_kept, timeout=TTL + 25)
            except trio.TooSlowError:
                pool = (await http.get(server.url + "/health")).json()
                raise AssertionError(f"{leaver.address} still in the pool: {pool}\n{server.process.tail(60)}") from None
            assert flaps == [], f"live workers left the pool after etcd restarted: {flaps}"
            assert (await http.get(server.url + "/health")).json()["status"] == "ready"
            assert await _with(http, server.url, decode.address)
            assert (await http.post(server.url + "/v1/chat/completions", json=chat())).status_code == 200
        assert sent > 50 and failures == []
    finally:
        etcd.close()


async def _count(http, url, n):
    return len(await pool_addresses(http, url)) == n


def test_register_refuses_a_role_mismatch(etcd_server, sim_workers):
    """A revision-3 worker declares its role; a revision-1 TensorRT-LLM worker (ENGINE_ROLE_UNSPECIFIED)
    registers under any role, as the sidecar test below does."""
    worker = sim_workers.start("prefill", *FAST, "--schema-revision", "3")
    result = subprocess.run(orchestrator_command("register", "--etcd", etcd_server.url, "--worker", worker.address,
                                                 "--role", "decode", "--namespace", "test-mismatch"),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "refusing to register" in result.stderr and "engine_role is prefill" in result.stderr


async def test_register_sidecar_announces_withdraws_and_revokes(tmp_path, etcd_server, sim_workers,
                                                                 orchestrator_servers):
    from orchestrator.testkit.plugin import ManagedProcess

    server = orchestrator_servers.start(etcd_config(tmp_path, etcd_server, mode="aggregated"))
    worker = sim_workers.start("aggregated", *FAST)
    sidecar = ManagedProcess("register", orchestrator_command(
        "register", "--etcd", etcd_server.url, "--worker", worker.address, "--role", "aggregated",
        "--namespace", "test", "--ttl", str(TTL)), log_dir=tmp_path)
    try:
        key = sidecar.wait_ready(30)
        assert key.startswith("test/workers/tiny-chat/aggregated/")
        async with httpx.AsyncClient(timeout=30) as http:
            await wait_until(lambda: _with(http, server.url, worker.address), timeout=5)
            assert (await http.post(server.url + "/v1/chat/completions", json=chat())).status_code == 200
            sidecar.signal(signal.SIGTERM)  # revokes the lease: the worker leaves at once
            left = await wait_until(lambda: _without(http, server.url, worker.address), timeout=5)
            assert left < 1.0
        assert await trio.to_thread.run_sync(sidecar.process.wait, 10) == 0
    finally:
        sidecar.stop()


async def test_a_removed_worker_finishes_its_in_flight_requests_and_gets_no_new_ones(
        tmp_path, etcd_server, sim_workers, orchestrator_servers):
    from orchestrator.testkit.plugin import ManagedProcess

    server = orchestrator_servers.start(etcd_config(tmp_path, etcd_server, mode="aggregated", name="rm.yaml"))
    leaving = sim_workers.start("aggregated", "--time-scale", "1")  # ~6 ms per token: a long stream
    staying = sim_workers.start("aggregated", *sim_flags(etcd_server))
    sidecar = ManagedProcess("register-leaving", orchestrator_command(
        "register", "--etcd", etcd_server.url, "--worker", leaving.address, "--role", "aggregated",
        "--namespace", "test", "--ttl", str(TTL)), log_dir=tmp_path)
    try:
        sidecar.wait_ready(30)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            await wait_until(lambda: _count(http, server.url, 2), timeout=5)
            long_body = {**chat(max_tokens=150), "stream": True, "ignore_eos": True}
            results = {}

            async def stream_on(i):
                async with http.stream("POST", "/v1/chat/completions", json=long_body) as response:
                    results[i] = (response.status_code, "".join([c async for c in response.aiter_text()]))

            async with trio.open_nursery() as nursery:
                for i in range(4):  # round robin (the default): two of these land on the leaving worker
                    nursery.start_soon(stream_on, i)
                await trio.sleep(0.2)
                sidecar.signal(signal.SIGTERM)  # the key is withdrawn; the worker itself keeps running
                await wait_until(lambda: _without(http, server.url, leaving.address), timeout=5)
                for _ in range(5):  # new requests only go to the worker that stays
                    assert (await http.post("/v1/chat/completions", json=chat())).status_code == 200
        assert all(status == 200 and text.rstrip().endswith("data: [DONE]") and '"error"' not in text
                   for status, text in results.values()), results
        from orchestrator.engine import EngineClient, LoopThread

        async with LoopThread.open() as loop_thread, EngineClient.open(leaving.address, loop_thread) as client:
            load = await client.load()
        assert load.attributes.fields["tokens_emitted"].number_value >= 150  # it did serve in-flight work
        async with LoopThread.open() as loop_thread, EngineClient.open(staying.address, loop_thread) as client:
            assert (await client.load()).attributes.fields["tokens_emitted"].number_value > 0
    finally:
        sidecar.stop()


async def test_a_registration_keeps_its_lease_through_an_etcd_restart(tmp_path):
    """After a restart etcd restores leases with a fresh TTL; the registration must refresh its own lease
    (not write a new one), or the restored lease expires and deletes a live worker's key."""
    from orchestrator.discovery.etcd_client import new_client
    from orchestrator.discovery.lease_keeper import LeaseKeeper
    from orchestrator.engine import LoopThread

    etcd = EtcdServer(tmp_path)
    try:
        registration = LeaseKeeper(etcd.url, "test/workers/m/decode/keep", b'{"x": 1}', ttl=TTL)
        async with LoopThread.open() as loop_thread:
            async def key_lease():
                client = new_client(etcd.url)
                try:
                    await client.connect()
                    result = await client.get_prefix(b"test/workers/m/decode/keep")
                    return [kv.lease for kv in result.kvs]
                finally:
                    await client.close()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(loop_thread.run, registration.run)
                await wait_until(lambda: _true(registration.registered), timeout=10)
                (lease_before,) = await loop_thread.run(key_lease)
                etcd.stop()
                await wait_until(lambda: _true(not registration.registered), timeout=10)
                await trio.sleep(2)
                etcd.start()
                await wait_until(lambda: _true(registration.registered), timeout=15)
                await trio.sleep(TTL + 2)  # past the restored lease's TTL: the key must still be there
                assert await loop_thread.run(key_lease) == [lease_before]
                assert registration.registrations == 1
                nursery.cancel_scope.cancel()
    finally:
        etcd.close()


async def _true(value: bool) -> bool:
    return value


async def test_a_frozen_etcd_makes_health_degraded_keeps_serving_and_the_pool_comes_back(
        tmp_path, sim_workers, orchestrator_servers):
    """SIGSTOP keeps etcd's connections open, so no watch breaks: the registry's status probe notices."""
    etcd = EtcdServer(tmp_path)  # our own: this test freezes it
    try:
        server = orchestrator_servers.start(etcd_config(tmp_path, etcd, mode="aggregated"))
        worker = sim_workers.start("aggregated", *sim_flags(etcd))
        failures = 0
        async with httpx.AsyncClient(timeout=30) as http:
            await wait_until(lambda: _with(http, server.url, worker.address), timeout=10)
            etcd_process = etcd.process
            assert etcd_process is not None  # EtcdServer() started it
            etcd_process.signal(signal.SIGSTOP)
            try:
                async def degraded():
                    return (await http.get(server.url + "/health")).json()["status"] == "degraded"

                frozen_for = await wait_until(degraded, timeout=10, interval=0.1)
                for _ in range(10):  # the last known pool keeps serving
                    response = await http.post(server.url + "/v1/chat/completions", json=chat())
                    failures += response.status_code != 200
                await trio.sleep(max(0.0, TTL + 1 - frozen_for))  # longer than the lease
            finally:
                etcd_process.signal(signal.SIGCONT)

            async def ready_with_the_worker():
                health = (await http.get(server.url + "/health")).json()
                return health["status"] == "ready" and any(w["address"] == worker.address and w["state"] == "ready"
                                                           for w in health["workers"])

            await wait_until(ready_with_the_worker, timeout=TTL + 15, interval=0.1)
            assert (await http.post(server.url + "/v1/chat/completions", json=chat())).status_code == 200
        assert failures == 0 and frozen_for < 8
    finally:
        etcd.close()
