"""What a simulated worker holds, declared once for the parts of SimWorker that read it.

SimWorker (orchestrator.sim.server) is one class assembled from ControlService, AdmissionService and
ResponseCallbacks; its __init__ sets this state. Each part subclasses SimWorkerState so that a type checker
knows the attributes and the other parts' methods it uses. Nothing here runs: annotations only.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx
    from tokenizers import Tokenizer

    from orchestrator.openengine.v1 import lifecycle_pb2
    from orchestrator.sim import gpu_sleep, kv_events, kv_transfer, output
    from orchestrator.sim.config import SimConfig
    from orchestrator.sim.lora import LoraRegistry
    from orchestrator.sim.outbox import Outbox
    from orchestrator.sim.persona import Persona
    from orchestrator.sim.scheduler import Scheduler, SimRequest


class SimWorkerState:
    config: SimConfig
    instance_id: str
    tokenizer: Tokenizer
    vocab: output.Vocabulary
    persona: Persona
    vocab_size: int  # image blocks are keyed with ids above it
    scheduler: Scheduler
    zmq_publishers: list[kv_events.ZmqPublisher]
    kv_fanout: kv_events.GrpcFanout | None
    grpc_port: int
    sessions: kv_transfer.SessionStore
    kv_sleep: gpu_sleep.GpuSleep  # how a pull spends its KV transfer's (scaled) time
    image_token_id: int | None
    context_ids: Iterator[int]
    kv_port: int
    started_at: float
    draining: bool
    active: dict[str, SimRequest]
    finished_ids: collections.OrderedDict[str, None]
    random: random.Random
    http: httpx.AsyncClient | None
    cancelled_by_client: int
    cancelled_after_terminal: int
    late_session_aborts: int
    stalled_requests: int
    model_info_calls: int
    load_calls: int
    recent: collections.deque[dict]
    loras: LoraRegistry

    if TYPE_CHECKING:  # defined by the other parts
        def health_state(self) -> lifecycle_pb2.HealthState: ...
        def _token_response(self, rid: str, want_logprobs: bool, top_n: int, *,
                            first_without_logprob: bool = False) -> Callable[[int, int], Any]: ...
        def _token_callback(self, outbox: Outbox, token_response: Any,
                            stop_texts: list[str]) -> Callable[[SimRequest, int], None]: ...
        def _finish_callback(self, outbox: Outbox, rid: str,
                             prompt_len: int) -> Callable[[SimRequest, str, Any], None]: ...
        def _context_callback(self, outbox: Outbox, rid: str, prompt_ids: Any, media_ids: Any, prompt_len: int,
                              token_response: Any, stop_texts: list[str],
                              want_logprobs: bool) -> Callable[[SimRequest, int], None]: ...
