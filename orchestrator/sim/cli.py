"""`orchestrator sim-worker`: run one simulated TRT-LLM worker process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from orchestrator.models import TINY_CHAT
from orchestrator.openengine.v1.error_pb2 import ErrorCode
from orchestrator.roles import ROLES
from orchestrator.sim.media import MediaLimits
from orchestrator.sim.persona import GUIDED_BACKENDS, HANDOFF_SHAPES, IMAGE_PATHS, LOAD_METRICS, PERSONAS, Persona
from orchestrator.sim.profiles import DEFAULT_PROFILE, PROFILES
from orchestrator.sim.tool_formats import REASONING_PARSERS, TOOL_CALL_PARSERS

log = logging.getLogger("orchestrator.sim")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sim-worker", help="run a simulated TRT-LLM worker (OpenEngine v1 gRPC)",
                              description="Serve openengine.v1.Inference and Control with a GPU cost model. "
                                          "Prints 'ready grpc://HOST:PORT' when ready.")
    p.add_argument("--role", choices=ROLES, required=True, help="the role it serves and reports")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: a free one)")
    p.add_argument("--model", default="tiny-chat", help="served model name")
    p.add_argument("--model-dir", type=Path, default=TINY_CHAT, help="tokenizer.json + tokenizer_config.json")
    p.add_argument("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE,
                   help="the GPU cost model (orchestrator/sim/profiles.py)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every cost-model duration (0.01: 100x faster; 0: no GPU time at all)")
    p.add_argument("--instance-id", default="", help="ServerInfo.instance_id (default: sim-ROLE-RANDOM)")
    p.add_argument("--warmup", type=float, default=0.0, help="seconds in HEALTH_STATE_STARTING")
    p.add_argument("--persona", choices=PERSONAS, default="trtllm",
                   help="trtllm: behave as TensorRT-LLM's own OpenEngine server; strict: the spec-only simulator")
    p.add_argument("--schema-revision", type=int, choices=(1, 3), default=1,
                   help="1: tensorrt_llm/grpc/openengine (role per request, no media, no abort by session); "
                        "3: tensorrt_llm/openengine (declared role, images, an abort by session answered but "
                        "freeing nothing once the prefill finished)")
    p.add_argument("--handoff", choices=HANDOFF_SHAPES, default="both",
                   help="revision 1: what locates the context worker in the KV session (endpoint, opaque_state "
                        "or both)")
    p.add_argument("--kv-transfer-timeout", type=float, default=None,
                   help="seconds a prefill holds an unpulled KV session; 0: until exit (default: the persona's; "
                        "revision-1 TensorRT-LLM holds it until exit)")
    p.add_argument("--abort-cleanup", action="store_true",
                   help="advertise supports_abort_cleanup and answer Control.Abort by kv_session where the persona "
                        "does not (trtllm: answered ABORTED, frees nothing, as the sibling server; strict: frees)")
    p.add_argument("--multimodal", dest="multimodal", action="store_true", default=None,
                   help="ModelInfo.supports_multimodal = true and take images (default: the persona's)")
    p.add_argument("--no-multimodal", dest="multimodal", action="store_false",
                   help="ModelInfo.supports_multimodal = false and refuse images")
    p.add_argument("--image-paths", choices=IMAGE_PATHS, default="both",
                   help="revision 3: where multimodal_capabilities lists MODALITY_IMAGE")
    p.add_argument("--max-context-length", type=int, default=None, help="override the profile's context window")
    p.add_argument("--max-loras", type=int, default=4,
                   help="revision 3: lora_config.max_loras, the LoRA adapters the GPU cache holds at once; 0: started "
                        "without a LoRA config (revision 1 serves no adapters, whatever this says)")
    p.add_argument("--total-kv-blocks", type=int, default=None, help="override the profile's KV cache size")
    p.add_argument("--guided-backend", choices=GUIDED_BACKENDS, default="none",
                   help="the grammar backend TensorRT-LLM was started with; none: guided decoding unsupported "
                        "(json_schema, json_object, choice and structural_tag guides are answered with a valid "
                        "instance; regex and EBNF guides are not modelled)")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="",
                   help="the model writes tool calls in this parser's format (TensorRT-LLM's names; hermes, "
                        "llama3_json, mistral, glm45 as vLLM names them) and ModelInfo.tool_call_parser says so "
                        "(revision 3 and strict; revision 1 never fills it). Default: hermes calls, none advertised")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default="",
                   help="the model thinks before answering, in this parser's format, unless the chat template "
                        "turned thinking off; ModelInfo.reasoning_parser says so (every revision)")
    p.add_argument("--natural-eos", action="store_true",
                   help="free text ends with EOS at a natural length (log-normal per prompt and seed, median 64 "
                        "tokens) even when max_tokens is given, as a real model stops when it is done; without it "
                        "a given max_tokens is the answer's exact length (what benchmarks expect)")
    p.add_argument("--load-metrics", choices=LOAD_METRICS, default="on",
                   help="GetLoad as TensorRT-LLM answers it with load metrics on, off (requests only), or "
                        "unavailable (UNAVAILABLE, as when its load sample is stale)")
    p.add_argument("--stall-timeout", type=_not_negative, default=None,
                   help="seconds a response may wait to be read before the request is aborted with "
                        "ERROR_CODE_OVERLOADED (default: the persona's; revision 1: 30, as TensorRT-LLM's watchdog)")
    p.add_argument("--attention-dp-size", type=int, default=None,
                   help="attention-DP ranks, each with its share of the KV blocks, its own prefix cache and KV event "
                        "publisher (default: the profile's)")
    p.add_argument("--no-prefix-cache", dest="prefix_caching", action="store_false",
                   help="recompute every prompt in full (TensorRT-LLM's enable_block_reuse=False)")
    events = p.add_argument_group("KV events (off unless --kv-events, as in TensorRT-LLM)")
    events.add_argument("--kv-events", action="store_true",
                        help="publish KV cache events: revision 1 over ZMQ (msgpack, one PUB socket per DP rank), "
                             "revision 3 through Control.SubscribeKvEvents")
    events.add_argument("--kv-events-port", type=int, default=0,
                        help="revision 1: the PUB socket's base port, rank r binds base + r (0: a free port per rank)")
    events.add_argument("--kv-events-replay-port", type=int, default=None,
                        help="revision 1: also serve replay on a ROUTER socket at this base port (0: a free one)")
    events.add_argument("--kv-events-topic", default="", help="revision 1: the topic frame of every message")
    events.add_argument("--kv-events-advertise-port", type=int, default=None, metavar="PORT",
                        help="fault: advertise PORT (+ rank) as the publishers' port, where another process may "
                             "publish what it likes (a hostile worker: benchmarks/kv_event_flood.py --http)")
    p.add_argument("--eos-probability", type=float, default=0.0, help="chance that a sampled token is EOS")
    p.add_argument("--seed", type=int, default=0, help="seed for fault injection")
    p.add_argument("--drain-grace", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM")
    p.add_argument("--media-max-bytes", type=int, default=20 * 1024 * 1024, help="per image, fetched or decoded")
    p.add_argument("--media-fetch-timeout", type=float, default=10.0, help="seconds per image URL fetch")
    p.add_argument("--tls-cert", type=Path, default=None, help="serve TLS: certificate chain (PEM)")
    p.add_argument("--tls-key", type=Path, default=None, help="serve TLS: private key (PEM)")
    p.add_argument("--tls-client-ca", type=Path, default=None, help="require client certificates from this CA (mTLS)")
    p.add_argument("--etcd", default=None, help="self-register in etcd at this URL (see `orchestrator register`)")
    p.add_argument("--etcd-namespace", default="orchestrator", help="the key prefix of the self-registration")
    p.add_argument("--etcd-ttl", type=int, default=10, help="lease TTL of the self-registration (seconds)")
    faults = p.add_argument_group("fault injection")
    faults.add_argument("--error-rate", type=float, default=0.0, help="fraction of requests answered with an error")
    faults.add_argument("--error-phase", choices=["any", "prefill", "decode", "aggregated"], default="any",
                        help="the kind of leg --error-rate applies to")
    faults.add_argument("--error-code", choices=[n for n in ErrorCode.keys() if n != "ERROR_CODE_UNSPECIFIED"],
                        default="ERROR_CODE_INTERNAL", help="the error code of injected errors")
    faults.add_argument("--error-retryable", action="store_true", help="injected errors say retryable")
    faults.add_argument("--crash-after-tokens", type=int, default=None, help="exit(3) after this many tokens")
    faults.add_argument("--stall-after-tokens", type=int, default=None, help="requests hang after this many tokens")
    faults.add_argument("--status-delay", type=float, default=0.0,
                        help="seconds between a call's last response and its status (a busy engine loop)")
    faults.add_argument("--slow-start", type=float, default=0.0, help="seconds before the port is bound")
    faults.add_argument("--drop-kv-sessions", action="store_true", help="forget KV sessions right after prefill")
    faults.add_argument("--drop-kv-events", type=int, default=0, metavar="N",
                        help="lose every Nth KV event batch after numbering it, so subscribers see a sequence gap")
    faults.add_argument("--not-ready", action="store_true", help="report HEALTH_STATE_NOT_READY forever")
    faults.add_argument("--health-delay", type=float, default=0.0,
                        help="answer Health this late (s) while requests run")
    faults.add_argument("--report-health-state", type=int, default=None,
                        help="answer Health with this HealthState number, known or not")
    faults.add_argument("--fail-model-info", action="store_true", help="GetModelInfo fails (capability discovery)")
    faults.add_argument("--report-schema-revision", type=int, default=None,
                        help="report this ServerInfo.schema_revision instead of the persona's")
    faults.add_argument("--minimum-client-revision", type=int, default=1,
                        help="the ServerInfo.minimum_client_revision it reports")
    p.set_defaults(run=run)


def _not_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 (0: no watchdog), got {text}")
    return value


def config_from_args(args: argparse.Namespace):
    from orchestrator.sim.config import SimConfig
    from orchestrator.sim.kv_events import KvEventsConfig

    persona = Persona(args.persona, args.schema_revision, args.handoff)
    for flag, value, low in (("--attention-dp-size", args.attention_dp_size, 1),
                             ("--kv-events-port", args.kv_events_port, 0),
                             ("--kv-events-replay-port", args.kv_events_replay_port, 0),
                             ("--kv-events-advertise-port", args.kv_events_advertise_port, 1),
                             ("--drop-kv-events", args.drop_kv_events, 0)):
        if value is not None and not low <= value <= 65535:
            raise SimFlagError(f"{flag} must be an integer from {low} to 65535, got {value}")
    if args.max_loras < 0:
        raise SimFlagError(f"--max-loras must be 0 or more, got {args.max_loras}")
    kv_events = KvEventsConfig(enabled=args.kv_events, port=args.kv_events_port,
                               replay_port=args.kv_events_replay_port, topic=args.kv_events_topic,
                               drop_every=args.drop_kv_events, advertise_port=args.kv_events_advertise_port)
    return SimConfig(
        role=args.role, host=args.host, port=args.port, model=args.model, model_dir=args.model_dir,
        profile=PROFILES[args.profile], time_scale=args.time_scale, instance_id=args.instance_id,
        warmup_s=args.warmup, persona=persona, kv_transfer_timeout_s=args.kv_transfer_timeout,
        supports_abort_cleanup=args.abort_cleanup, supports_multimodal=args.multimodal, image_paths=args.image_paths,
        max_context_length=args.max_context_length, total_kv_blocks=args.total_kv_blocks,
        reported_schema_revision=args.report_schema_revision, minimum_client_revision=args.minimum_client_revision,
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
        error_rate=args.error_rate, error_phase=args.error_phase, error_code=args.error_code,
        error_retryable=args.error_retryable, crash_after_tokens=args.crash_after_tokens,
        stall_after_tokens=args.stall_after_tokens, status_delay_s=args.status_delay,
        drop_kv_sessions=args.drop_kv_sessions,
        not_ready=args.not_ready, health_delay_s=args.health_delay,
        report_health_state=args.report_health_state, fail_model_info=args.fail_model_info,
        media_limits=MediaLimits(max_bytes=args.media_max_bytes, fetch_timeout_s=args.media_fetch_timeout),
        eos_probability=args.eos_probability, seed=args.seed, guided_backend=args.guided_backend,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser, natural_eos=args.natural_eos,
        load_metrics=args.load_metrics, stall_timeout_s=args.stall_timeout, attention_dp_size=args.attention_dp_size,
        prefix_caching=args.prefix_caching, kv_events=kv_events, max_loras=args.max_loras,
    )


class SimFlagError(ValueError):
    """A sim-worker flag with a value the simulator cannot use; the message names the flag."""


def run(args: argparse.Namespace) -> int:
    from orchestrator.sim.server import serve

    try:
        config = config_from_args(args)
    except SimFlagError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    on_ready = None
    if args.etcd:
        from orchestrator.sim.registration import sim_self_registration

        on_ready = sim_self_registration(args.etcd, args.etcd_namespace, config.role, config.model, args.etcd_ttl)
    try:
        import uvloop

        runner: Callable[[Coroutine[Any, Any, int]], int] = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    return runner(serve(config, slow_start_s=args.slow_start, drain_grace_s=args.drain_grace, on_ready=on_ready))
