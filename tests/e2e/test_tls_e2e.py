"""TLS and mTLS to the workers and to etcd, and HTTPS on the frontend, with certificates made for the test (openssl)."""

import shutil
import ssl
import subprocess

import httpx
import openai
import pytest
import trio

from orchestrator.processes import ProcessFailed
from orchestrator.testkit.plugin import EtcdServer, ManagedProcess, orchestrator_command, write_config

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
FAST = ("--time-scale", "0")


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a certificate for 127.0.0.1 (workers and the frontend) and a client certificate, all signed by it."""
    d = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca", "-keyout",
            "ca.key", "-out", "ca.pem", cwd=d)
    for name, extension in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                            ("client", "extendedKeyUsage=clientAuth")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out",
                f"{name}.csr", cwd=d)
        (d / f"{name}.ext").write_text(extension + "\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)
    return d


def mtls_worker(sim_workers, pki):
    return sim_workers.start("aggregated", *FAST, "--tls-cert", str(pki / "server.pem"), "--tls-key",
                             str(pki / "server.key"), "--tls-client-ca", str(pki / "ca.pem"))


def test_mtls_to_a_worker_and_https_for_the_clients(tmp_path, pki, sim_workers, orchestrator_servers):
    worker = mtls_worker(sim_workers, pki)
    config = write_config(tmp_path / "tls.yaml", "aggregated", {"aggregated": [worker.address]},
                          workers_tls={"ca_file": str(pki / "ca.pem"), "cert_file": str(pki / "client.pem"),
                                       "key_file": str(pki / "client.key")},
                          http={"tls_cert_file": str(pki / "server.pem"), "tls_key_file": str(pki / "server.key")})
    server = orchestrator_servers.start(config, timeout=60)
    url = server.url.replace("http://", "https://")
    trusted = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    # the SDK types http_client as an httpx2.Client, and takes an httpx.Client as well
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                           http_client=httpx.Client(verify=trusted))  # type: ignore[arg-type]
    answer = client.chat.completions.create(model="tiny-chat", max_tokens=3,
                                            messages=[{"role": "user", "content": "hi"}])
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 3
    # a stream over TLS: tokens go out from the request's own task (send_now is for plain sockets)
    chunks = list(client.chat.completions.create(model="tiny-chat", max_tokens=6, stream=True,
                                                 messages=[{"role": "user", "content": "hi"}]))
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 6
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(httpx.ConnectError):  # HTTPS for real: an untrusted certificate is refused
        httpx.get(url + "/health")


def test_a_worker_that_wants_a_client_certificate_refuses_a_connection_without_one(tmp_path, pki, sim_workers,
                                                                                  orchestrator_servers):
    worker = mtls_worker(sim_workers, pki)
    config = write_config(tmp_path / "notls.yaml", "aggregated", {"aggregated": [worker.address]},
                          workers_tls={"ca_file": str(pki / "ca.pem")}, limits={"worker_startup_timeout_s": 2})
    server = orchestrator_servers.start(config, timeout=60)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post("/v1/chat/completions", json={"model": "tiny-chat", "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 503


@pytest.mark.etcd
async def test_discovery_through_an_etcd_that_requires_client_certificates(tmp_path, pki, sim_workers,
                                                                            orchestrator_servers):
    """etcd serves TLS only and wants a client certificate (--client-cert-auth): the register sidecar
    and the orchestrator both connect with theirs (`--etcd-ca/--etcd-cert/--etcd-key`, and
    `discovery.etcd.ca_file/cert_file/key_file`), and the worker it announced serves."""
    etcd = EtcdServer(tmp_path, tls=(str(pki / "server.pem"), str(pki / "server.key"), str(pki / "ca.pem")))
    sidecar = None
    try:
        assert etcd.url.startswith("https://")
        worker = sim_workers.start("aggregated", *FAST)
        # Without a client certificate etcd refuses the TLS handshake: that sidecar never registers.
        refused = ManagedProcess("register-refused", orchestrator_command(
            "register", "--etcd", etcd.url, "--worker", worker.address, "--role", "aggregated", "--namespace", "tls",
            "--etcd-ca", str(pki / "ca.pem")), log_dir=tmp_path)
        try:
            with pytest.raises(ProcessFailed):
                refused.wait_ready(4)
        finally:
            refused.stop()
        sidecar = ManagedProcess("register", orchestrator_command(
            "register", "--etcd", etcd.url, "--worker", worker.address, "--role", "aggregated", "--namespace", "tls",
            "--etcd-ca", str(pki / "ca.pem"), "--etcd-cert", str(pki / "client.pem"),
            "--etcd-key", str(pki / "client.key")), log_dir=tmp_path)
        assert sidecar.wait_ready(30).startswith("tls/workers/tiny-chat/aggregated/")
        config = write_config(tmp_path / "etcd-tls.yaml", "aggregated", etcd={
            "endpoints": [etcd.url], "namespace": "tls", "ca_file": str(pki / "ca.pem"),
            "cert_file": str(pki / "client.pem"), "key_file": str(pki / "client.key")})
        server = orchestrator_servers.start(config)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            with trio.fail_after(15):
                while (await http.get("/health")).status_code != 200:
                    await trio.sleep(0.1)
            answer = await http.post("/v1/chat/completions", json={
                "model": "tiny-chat", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
    finally:
        if sidecar is not None:
            sidecar.stop()
        etcd.close()
