"""Distributed tracing end to end: a disaggregated request through real processes, its spans received by an
OTLP/HTTP receiver in this test, parent links intact from the client's traceparent down to each engine call,
and the workers seeing the traceparent of their own leg, over both worker transports.

What the workers are sent follows TensorRT-LLM's revision-1 OpenEngine servicer: `Generate`
(tensorrt_llm/grpc/openengine/servicer.py @ 06cb2191b0be3da4297abb13d5082a5e39b3b460) reads
`_metadata_from_context(context)` and passes its `trace_headers` to `LLM.generate_async`;
`_trace_headers` (request_mapping.py @ 05d4fbd5909373a61bfec2289b17055c3d485244, as at e416b94d7b91) copies the
gRPC metadata keys `traceparent` and `tracestate` and refuses repeated `openengine-*` keys. The simulated worker
records what those keys carried (orchestrator/sim/admission.py `trace_headers`).
"""

from __future__ import annotations

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import trio
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from orchestrator.testkit.plugin import write_config
from sim_helpers import recent_requests

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class OtlpReceiver:
    """An OTLP/HTTP trace receiver on a free loopback port: every span it was sent, decoded."""

    def __init__(self):
        self.spans: list = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                with receiver.lock:
                    for resource in request.resource_spans:
                        for scope in resource.scope_spans:
                            receiver.spans += [(resource.resource, span) for span in scope.spans]
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, names: set[str], timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                found = {span.name: (resource, span) for resource, span in self.spans}
            if names <= set(found):
                return found
            time.sleep(0.05)
        raise AssertionError(f"spans {sorted(names - set(found))} never arrived; got {sorted(found)}")

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    receiving = OtlpReceiver()
    yield receiving
    receiving.close()


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
async def test_a_disaggregated_request_is_one_trace_from_the_client_to_each_engine_call(
        tmp_path, sim_workers, orchestrator_servers, engine_client, receiver, transport):
    prefill = sim_workers.start("prefill", "--time-scale", "0")
    decode = sim_workers.start("decode", "--time-scale", "0")
    config = write_config(tmp_path / "traced.yaml", "disaggregated",
                          {"prefill": [prefill.address], "decode": [decode.address]}, stream_transport=transport,
                          tracing={"endpoint": receiver.url, "service_name": "orchestrator-test"})
    # The SDK's own variable: export every 50 ms instead of every 5 s, so the test does not wait
    server = orchestrator_servers.start(config, env={"OTEL_BSP_SCHEDULE_DELAY": "50"})
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        answer = await http.post("/v1/chat/completions", headers={
            "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "vendor=abc"},
            json={"model": "tiny-chat", "messages": [{"role": "user", "content": "Describe the river"}],
                  "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    spans = await trio.to_thread.run_sync(receiver.wait_for, {"POST /v1/chat/completions", "plan", "prefill",
                                                              "kv_handoff", "decode"})
    resource, root = spans["POST /v1/chat/completions"]
    assert {a.key: a.value.string_value for a in resource.attributes}["service.name"] == "orchestrator-test"
    assert root.trace_id.hex() == CLIENT_TRACE and root.parent_span_id.hex() == CLIENT_SPAN  # the client's trace
    assert root.kind == root.SPAN_KIND_SERVER
    root_attributes = {a.key: json_format.MessageToDict(a.value) for a in root.attributes}
    assert root_attributes["gen_ai.request.model"] == {"stringValue": "tiny-chat"}  # the model it resolved to
    for name in ("plan", "prefill", "kv_handoff", "decode"):
        _, child = spans[name]
        assert child.trace_id.hex() == CLIENT_TRACE and child.parent_span_id == root.span_id, name
    attributes = {a.key: json_format.MessageToDict(a.value) for a in spans["prefill"][1].attributes}
    assert attributes["orchestrator.worker"] == {"stringValue": prefill.address}
    assert attributes["orchestrator.attempt"] == {"intValue": "1"} and attributes["orchestrator.retry"] == {
        "boolValue": False}
    # Each worker saw the traceparent of its own leg's span (and the client's tracestate), as TensorRT-LLM reads them
    for worker, leg in ((prefill, "prefill"), (decode, "decode")):
        (record,) = await recent_requests(engine_client, worker)
        span_id = spans[leg][1].span_id.hex()
        assert record["trace"] == {"traceparent": f"00-{CLIENT_TRACE}-{span_id}-01", "tracestate": "vendor=abc"}


async def test_without_a_tracing_section_the_workers_see_no_trace_context(tmp_path, sim_workers, orchestrator_servers,
                                                                       engine_client):
    worker = sim_workers.start("aggregated", "--time-scale", "0")
    config = write_config(tmp_path / "plain.yaml", "aggregated", {"aggregated": [worker.address]})
    server = orchestrator_servers.start(config)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        answer = await http.post("/v1/chat/completions", headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
                           json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 2})
    assert answer.status_code == 200
    (record,) = await recent_requests(engine_client, worker)
    assert record["trace"] == {}


def test_tracing_config_errors_name_the_key(tmp_path):
    from orchestrator import config as config_module
    from orchestrator.config import ConfigError

    for section, key, words in ((({"endpoint": "collector:4318"}), "tracing.endpoint", "an OTLP/HTTP traces URL"),
                                ({"endpoint": "http://c:4318/v1/traces", "sample_ratio": 2}, "tracing.sample_ratio",
                                 "a number from 0 to 1"),
                                ({"sample_ratio": 0.5}, "tracing.endpoint", "required")):
        path = write_config(tmp_path / "t.yaml", "aggregated", {"aggregated": ["grpc://127.0.0.1:9"]}, tracing=section)
        with pytest.raises(ConfigError) as info:
            config_module.load(path)
        assert info.value.key == key and words in str(info.value), info.value


class SilentCollector:
    """A listener that accepts connections and never answers (a collector that hangs)."""

    def __init__(self):
        import socket

        self.socket = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}/v1/traces"
        self.accepted: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        try:
            while True:
                self.accepted.append(self.socket.accept()[0])
        except OSError:
            return

    def close(self):
        self.socket.close()
        for connection in self.accepted:
            connection.close()


@pytest.mark.parametrize("collector", ["closed-port", "never-answers"])
async def test_sigterm_exits_within_a_bounded_flush_whatever_the_collector_does(tmp_path, collector, sim_workers,
                                                                                orchestrator_servers):
    """Nothing in flight: the exit takes the (empty) drain and a flush of at most 2 s, not the exporter's
    retries against a collector that is down (30 s)."""
    import signal
    import socket

    silent = None
    if collector == "never-answers":
        silent = SilentCollector()
        endpoint = silent.url
    else:
        with socket.socket() as probe:  # a port nothing listens on
            probe.bind(("127.0.0.1", 0))
            endpoint = f"http://127.0.0.1:{probe.getsockname()[1]}/v1/traces"
    try:
        worker = sim_workers.start("aggregated", "--time-scale", "0")
        config = write_config(tmp_path / "traced.yaml", "aggregated", {"aggregated": [worker.address]},
                              tracing={"endpoint": endpoint})
        server = orchestrator_servers.start(config)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            for _ in range(3):  # spans batched for the exporter
                answer = await http.post("/v1/chat/completions", json={
                    "model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
                assert answer.status_code == 200
        process = server.process.process
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = await trio.to_thread.run_sync(lambda: process.wait(timeout=60))
        took = time.monotonic() - started
    finally:
        if silent is not None:
            silent.close()
    assert code == 0
    assert took < 6.0, f"exit took {took:.1f} s"  # 2 s of flush, the rest startup-free shutdown on a loaded host
