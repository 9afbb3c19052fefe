"""The simulated TRT-LLM worker: an OpenEngine v1 gRPC server over the scheduler and KV store.

It behaves like TensorRT-LLM's own OpenEngine server (orchestrator.sim.persona says how, revision 1
or 3); the "strict" persona keeps the spec-only behaviour. Either way a real protocol mistake of the
orchestrator (a decode leg whose prompt or media differ from its prefill, a handoff the decode
cannot resolve, image placeholders that do not match the images) is an error here, as it would be
on the engine. One module per job: control.py (Control RPCs), admission.py (Generate and what it
accepts), responses.py (scheduler events -> responses); this module holds the state and serves.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import random
import signal
import time
import uuid as uuidlib
from pathlib import Path

import grpc
import httpx
from tokenizers import Tokenizer

from orchestrator.openengine.v1 import openengine_pb2_grpc
from orchestrator.sim import gpu_sleep, kv_events, kv_transfer, output
from orchestrator.sim.admission import AdmissionService
from orchestrator.sim.config import SimConfig
from orchestrator.sim.control import ControlService
from orchestrator.sim.lora import LoraRegistry
from orchestrator.sim.responses import ResponseCallbacks
from orchestrator.sim.scheduler import Faults, Scheduler, SimRequest

log = logging.getLogger("orchestrator.sim")
__all__ = ["SimConfig", "SimWorker", "serve"]


class SimWorker(ControlService, AdmissionService, ResponseCallbacks, openengine_pb2_grpc.InferenceServicer,
                openengine_pb2_grpc.ControlServicer):
    def __init__(self, config: SimConfig):
        self.config = config
        self.instance_id = config.instance_id or f"sim-{config.role}-{uuidlib.uuid4().hex[:8]}"
        self.tokenizer = Tokenizer.from_file(str(config.model_dir / "tokenizer.json"))
        self.vocab = output.Vocabulary.from_model_dir(config.model_dir)
        faults = Faults(crash_after_tokens=config.crash_after_tokens, stall_after_tokens=config.stall_after_tokens,
                        eos_probability=config.eos_probability)
        self.persona = config.persona
        # image blocks are keyed with ids above the vocabulary (prefix_cache.expanded_image)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.scheduler = Scheduler(config.profile, config.role, self.vocab, time_scale=config.time_scale,
                                   faults=faults, total_kv_blocks=config.total_kv_blocks,
                                   context_stops=self.persona.streams_context_token,
                                   attention_dp_size=config.dp_size, prefix_caching=config.prefix_caching,
                                   mm_keys=config.multimodal, id_offset=self.vocab_size)
        self.zmq_publishers: list[kv_events.ZmqPublisher] = []  # revision 1, when events are on
        self.kv_fanout: kv_events.GrpcFanout | None = None  # revision 3 and strict, when events are on
        self.grpc_port = 0
        self.sessions = kv_transfer.SessionStore(self.scheduler.release_blocks, config.session_ttl_s)
        self.kv_sleep = gpu_sleep.GpuSleep()
        self.image_token_id = _image_token_id(config.model_dir, self.tokenizer)
        # TensorRT-LLM's context request ids are integers; KvSessionRef.session_id carries one.
        self.context_ids = itertools.count(random.Random().randrange(1 << 20, 1 << 40))
        self.kv_port = 0
        self.started_at = time.monotonic()
        self.draining = False
        self.active: dict[str, SimRequest] = {}
        self.finished_ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.random = random.Random(config.seed)
        self.http: httpx.AsyncClient | None = None
        self.cancelled_by_client = 0
        self.cancelled_after_terminal = 0  # cancels that raced the status of a call already over (admission.py)
        self.late_session_aborts = 0  # aborts by session answered ABORTED that freed nothing (control.py)
        self.stalled_requests = 0  # aborted by the stall watchdog (admission.py)
        self.model_info_calls = 0
        self.load_calls = 0  # GetLoad calls, so tests can see how often a router polls
        self.background: list[asyncio.Future] = []  # e.g. etcd self-registration
        # what recent requests carried, for tests and debugging: {id, kind, media: [...]}
        self.recent: collections.deque[dict] = collections.deque(maxlen=32)
        self.loras = LoraRegistry()  # the adapters LoadLora registered (a persona that serves them)

    def start_kv_events(self) -> None:
        """Bind the persona's KV event publishers and connect them to the scheduler's steps."""
        c = self.config
        if not c.kv_events.enabled:
            return
        if self.persona.revision_1_trtllm:
            self.zmq_publishers = [kv_events.ZmqPublisher(rank.index, c.host, c.kv_events, mm_keys=c.multimodal)
                                   for rank in self.scheduler.ranks]
            for publisher in self.zmq_publishers:
                publisher.start()
            self.scheduler.on_kv_events = lambda rank, events: self.zmq_publishers[rank].publish(events)
        else:
            self.kv_fanout = kv_events.GrpcFanout(len(self.scheduler.ranks), c.kv_events)
            self.scheduler.on_kv_events = self.kv_fanout.publish

    def stop_kv_events(self) -> None:
        for publisher in self.zmq_publishers:
            publisher.close()

    # ---- drain ---------------------------------------------------------------------------------
    async def drain(self, grace_s: float) -> None:
        self.draining = True
        log.info("draining: %d running, %d queued", self.scheduler.running, len(self.scheduler.waiting))
        deadline = time.monotonic() + grace_s
        while not self.scheduler.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


def _image_token_id(model_dir: Path, tokenizer: Tokenizer) -> int | None:
    """The model's image placeholder (tokenizer_config.json or processor_config.json `image_token`)."""
    for name in ("tokenizer_config.json", "processor_config.json"):
        path = model_dir / name
        if path.exists():
            token = json.loads(path.read_text()).get("image_token")
            if token:
                return tokenizer.token_to_id(token)
    return None


async def serve(config: SimConfig, *, slow_start_s: float = 0.0, drain_grace_s: float = 30.0,
                on_ready=None) -> int:
    """Run a sim worker until SIGTERM/SIGINT; drain, then return 0."""
    if slow_start_s > 0:
        log.info("fault injection: slow start, binding in %.1f s", slow_start_s)
        await asyncio.sleep(slow_start_s)
    worker = SimWorker(config)
    kv_server = await asyncio.start_server(worker.sessions.serve_connection, config.host, 0)
    worker.kv_port = kv_server.sockets[0].getsockname()[1]
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    openengine_pb2_grpc.add_InferenceServicer_to_server(worker, server)
    openengine_pb2_grpc.add_ControlServicer_to_server(worker, server)
    if config.tls_cert is not None:  # TLS, and mTLS when a client CA is given
        if config.tls_key is None:
            raise ValueError("--tls-cert needs --tls-key")
        credentials = grpc.ssl_server_credentials([(config.tls_key.read_bytes(), config.tls_cert.read_bytes())],
                                                  root_certificates=(config.tls_client_ca.read_bytes()
                                                                     if config.tls_client_ca else None),
                                                  require_client_auth=config.tls_client_ca is not None)
        port = server.add_secure_port(f"{config.host}:{config.port}", credentials)
    else:
        port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"cannot bind gRPC port {config.host}:{config.port}")
    worker.grpc_port = port
    worker.start_kv_events()
    await server.start()
    scheduler_task = asyncio.create_task(worker.scheduler.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    address = f"grpc://{config.host}:{port}"
    log.info("sim worker %s role=%s model=%s profile=%s time_scale=%g kv=%s:%d", worker.instance_id, config.role,
             config.model, config.profile.name, config.time_scale, config.host, worker.kv_port)
    if on_ready is not None:
        await on_ready(worker, address)
    print(f"ready {address}", flush=True)
    await stop.wait()
    worker.draining = True  # health says NOT_READY at once, so a registration withdraws now
    await worker.drain(drain_grace_s)
    for task in worker.background:
        task.cancel()
    if worker.background:
        await asyncio.gather(*worker.background, return_exceptions=True)
    await server.stop(grace=1.0)
    scheduler_task.cancel()
    worker.stop_kv_events()
    kv_server.close()
    if worker.http is not None:
        await worker.http.aclose()
    log.info("sim worker %s stopped", worker.instance_id)
    return 0
