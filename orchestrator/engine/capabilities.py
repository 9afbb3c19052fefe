"""What a worker can do (ServerInfo + ModelInfo), and a single-flight cache for discovering it.

The cache's contract, each point tested in tests/unit/test_engine_capabilities.py:
- concurrent callers share one in-flight discovery; the worker is not asked N times at once;
- the discovery is bounded by a timeout;
- a failure is shared: every caller waiting on that attempt gets the same error;
- the next call after a failure tries again;
- a caller cancelled while waiting does not cancel the discovery for the others;
- closing the cache wakes every waiter with ClientClosed;
- a re-read (after `invalidate`) that fails keeps the last known value: TensorRT-LLM answers GetServerInfo
  UNAVAILABLE while its node discovery is pending, and a worker whose health is fine stays routable on the
  facts it last reported instead of failing every request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import attrs
import trio
from google.protobuf import json_format

from orchestrator.engine.errors import ClientClosed, DiscoveryFailed, EngineError, IncompatibleWorker
from orchestrator.log import cause_chain
from orchestrator.openengine.v1 import generation_pb2, model_pb2, server_pb2
from orchestrator.roles import Role

T = TypeVar("T")
log = logging.getLogger(__name__)
# DeploymentCapacity.max_loras above this is read as this: we never size anything on a count a worker sends.
MAX_LORAS = 1024

# Revision-1 TensorRT-LLM (tensorrt_llm/grpc/openengine/control.py) reports ENGINE_ROLE_UNSPECIFIED:
# "the same build serves either phase; the role is per request". Such a worker takes any role.
UNSPECIFIED_ROLE = "unspecified"
_SOURCE_NAMES = {
    generation_pb2.MEDIA_SOURCE_TYPE_URL: "url",
    generation_pb2.MEDIA_SOURCE_TYPE_DATA_URI: "data_uri",
    generation_pb2.MEDIA_SOURCE_TYPE_RAW_BYTES: "raw_bytes",
}


@attrs.frozen
class MultimodalSupport:
    """Revision 3's ModelInfo.multimodal_capabilities, reduced to what the orchestrator uses."""

    aggregate_images: bool  # MODALITY_IMAGE in aggregate_modalities: one worker runs the whole request
    prefill_decode_images: bool  # MODALITY_IMAGE in prefill_decode_modalities: context-first disagg
    source_types: frozenset[str]  # "url" | "data_uri" | "raw_bytes"; empty: not said
    per_request_media_options: bool
    routing_image_token_id: int | None

    @classmethod
    def from_proto(cls, caps: model_pb2.MultimodalCapabilities) -> MultimodalSupport:
        return cls(
            aggregate_images=generation_pb2.MODALITY_IMAGE in caps.aggregate_modalities,
            prefill_decode_images=generation_pb2.MODALITY_IMAGE in caps.prefill_decode_modalities,
            source_types=frozenset(_SOURCE_NAMES[s] for s in caps.source_types if s in _SOURCE_NAMES),
            per_request_media_options=(caps.supports_per_request_media_options
                                       if caps.HasField("supports_per_request_media_options") else False),
            routing_image_token_id=(caps.routing_image_token_id if caps.HasField("routing_image_token_id")
                                    else None),
        )


@attrs.frozen
class FeatureSupport:
    """One generation feature as ModelInfo.generation advertises it (guided decoding, output logprobs).

    TensorRT-LLM fills these from its configuration: guided decoding is `supported` only with a grammar backend,
    and its modes are that backend's (control.py / capabilities.py). A worker that does not say a feature is
    supported does not get requests that need it: without a backend TensorRT-LLM ignores a guide silently.
    """

    supported: bool = False
    modes: frozenset[str] = frozenset()  # lower-case mode names ("json_schema", "top_n"); empty: none listed
    max_top_n: int | None = None  # logprobs only

    def takes(self, mode: str) -> bool:
        return self.supported and (not self.modes or mode in self.modes)

    @classmethod
    def guided(cls, caps: model_pb2.GuidedDecodingCapabilities) -> FeatureSupport:
        return cls(supported=caps.supported if caps.HasField("supported") else False,
                   modes=frozenset(_mode_name(model_pb2.GuidedDecodingMode, "GUIDED_DECODING_MODE_", m)
                                   for m in caps.modes))

    @classmethod
    def logprobs(cls, caps: model_pb2.LogprobCapabilities) -> FeatureSupport:
        return cls(supported=caps.supported if caps.HasField("supported") else False,
                   modes=frozenset(_mode_name(model_pb2.CandidateTokenSelectionMode,
                                              "CANDIDATE_TOKEN_SELECTION_MODE_", m)
                                   for m in caps.candidate_selection_modes),
                   max_top_n=caps.max_top_n if caps.HasField("max_top_n") else None)


def _mode_name(enum, prefix: str, value: int) -> str:
    try:
        return enum.Name(value).removeprefix(prefix).lower()
    except ValueError:
        return f"mode_{value}"  # a mode from a newer schema: listed, never asked for


@attrs.frozen
class WorkerCapabilities:
    instance_id: str
    role: str  # "aggregated" | "prefill" | "decode" | "unspecified" (any role)
    engine: str
    schema_revision: int
    models: tuple[str, ...]
    model_id: str
    max_context_length: int | None
    max_output_tokens: int | None
    supports_multimodal: bool
    multimodal: MultimodalSupport | None  # revision 3 only
    supports_abort_cleanup: bool
    total_kv_blocks: int | None
    handoff_profile: str = ""  # an addition: KvConnectorInfo.handoff_profile (docs/openengine-additions.md)
    tokenizer_source: str = ""  # an addition: ModelInfo.tokenizer.source
    guided_decoding: FeatureSupport = FeatureSupport()
    output_logprobs: FeatureSupport = FeatureSupport()
    # ModelInfo.generation.supports_cache_salt: Generate honours kv.cache_salt. What a server advertises is what its
    # Generate accepts (revision 1 control.py sets it true and servicer.py passes the salt to generate_async); unset
    # is not a promise, and a worker that dropped the salt would share one tenant's cached blocks with another.
    supports_cache_salt: bool = False
    data_parallel_size: int = 1
    kv_block_size: int | None = None
    extra: tuple[tuple[str, str], ...] = ()  # ServerInfo.extra, each value as JSON (the operator's view)
    # the output parsers the model needs, by TensorRT-LLM's names ("" / None: none said); the frontend runs them
    tool_call_parser: str | None = None  # ModelInfo.tool_call_parser (the sibling server fills it)
    reasoning_parser: str | None = None  # ModelInfo.reasoning_parser (both servers: llm.args.reasoning_parser)
    # LoRA: ModelInfo.supports_lora (revision 1 always false: its Generate refuses lora_name; the sibling server
    # true with a LoRA config) and DeploymentCapacity.max_loras (the sibling's lora_config.max_loras: how many
    # adapters its GPU LoRA cache holds at once; None: not said), at most MAX_LORAS
    supports_lora: bool = False
    max_loras: int | None = None

    def serves_role(self, role: str) -> bool:
        return self.role in (role, UNSPECIFIED_ROLE)

    @property
    def runs_whole_requests_on_decode(self) -> bool:
        """Whether a decode worker takes a request without a KV session (conditional disaggregation's local
        path). Gated on what the worker says, not on a revision number (revisions were relabelled upstream):
        a worker with one build for every role (ENGINE_ROLE_UNSPECIFIED) runs anything; a declared decode role
        that packs its handoff under a named profile is TensorRT-LLM's sibling server, which refuses one
        ("Decode requests require a prefill KV session")."""
        return self.role == UNSPECIFIED_ROLE or not self.handoff_profile

    def image_support(self, disaggregated: bool) -> tuple[bool, str]:
        """Whether this worker takes images on this path, and the signals that said so.

        Every signal the worker sends must agree: ModelInfo.supports_multimodal (revision 1, the coarse
        one) and, on revision 3, MODALITY_IMAGE in multimodal_capabilities for the path's kind
        (aggregate_modalities for a whole request, prefill_decode_modalities for a context-first split).
        """
        said = [f"supports_multimodal={str(self.supports_multimodal).lower()}"]
        accepts = self.supports_multimodal
        if self.multimodal is not None:
            listed = self.multimodal.prefill_decode_images if disaggregated else self.multimodal.aggregate_images
            field = "prefill_decode_modalities" if disaggregated else "aggregate_modalities"
            said.append(f"image {'in' if listed else 'not in'} multimodal_capabilities.{field}")
            accepts = accepts and listed
        return accepts, ", ".join(said)

    def accepts_source(self, source: str) -> bool:
        """`source`: "url" | "data_uri". Revision 3 may list the encodings it dereferences."""
        types = self.multimodal.source_types if self.multimodal is not None else frozenset()
        return not types or source in types

    @classmethod
    def from_protos(cls, server: server_pb2.ServerInfo, model: model_pb2.ModelInfo) -> WorkerCapabilities:
        kv = server.kv_connector
        capacity = server.capacity
        return cls(
            instance_id=server.instance_id,
            role=_role_name(server.engine_role),
            engine=f"{server.engine_name} {server.engine_version}".strip(),
            schema_revision=server.schema_revision,
            models=tuple(server.supported_models),
            model_id=model.served_model_name or model.model_id,
            max_context_length=model.max_context_length if model.HasField("max_context_length") else None,
            max_output_tokens=model.max_output_tokens if model.HasField("max_output_tokens") else None,
            supports_multimodal=model.supports_multimodal if model.HasField("supports_multimodal") else False,
            multimodal=(MultimodalSupport.from_proto(model.multimodal_capabilities)
                        if model.HasField("multimodal_capabilities") else None),
            supports_abort_cleanup=kv.supports_abort_cleanup if kv.HasField("supports_abort_cleanup") else False,
            total_kv_blocks=capacity.total_kv_blocks if capacity.HasField("total_kv_blocks") else None,
            handoff_profile=kv.handoff_profile,
            tokenizer_source=model.tokenizer.source if model.HasField("tokenizer") else "",
            guided_decoding=FeatureSupport.guided(model.generation.guided_decoding),
            output_logprobs=FeatureSupport.logprobs(model.generation.output_logprobs),
            supports_cache_salt=(model.generation.supports_cache_salt
                                 if model.generation.HasField("supports_cache_salt") else False),
            data_parallel_size=(server.parallelism.data_parallel_size
                                if server.parallelism.HasField("data_parallel_size") else 1),
            kv_block_size=capacity.kv_block_size if capacity.HasField("kv_block_size") else None,
            extra=tuple(sorted((key, json.dumps(value, sort_keys=True))
                               for key, value in json_format.MessageToDict(server.extra).items())),
            tool_call_parser=model.tool_call_parser[:64] or None,  # (a name: never more than a short word)
            reasoning_parser=model.reasoning_parser[:64] or None,
            supports_lora=model.supports_lora if model.HasField("supports_lora") else False,
            max_loras=min(capacity.max_loras, MAX_LORAS) if capacity.HasField("max_loras") else None,
        )


def _role_name(value: int) -> str:
    """A role we know, "unspecified" (serves any), or a number no schema names, which serves none (the pool
    calls that worker misconfigured instead of sending it anything)."""
    role = Role.from_engine_role(value)
    if role is not None:
        return str(role)
    return UNSPECIFIED_ROLE if value == server_pb2.ENGINE_ROLE_UNSPECIFIED else f"unknown engine role {value}"


class _Attempt(Generic[T]):
    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: T | None = None
        self.error: EngineError | None = None


class SingleFlightCache(Generic[T]):
    """Caches the first successful `fetch()`; concurrent misses share one attempt.

    Attempts run in `nursery` (owned by the engine client), never in a caller's scope, so a
    cancelled caller leaves the attempt running for everyone else.
    """

    def __init__(self, fetch: Callable[[], Awaitable[T]], *, nursery: trio.Nursery, timeout: float,
                 worker: str, what: str = "capability discovery"):
        self._fetch = fetch
        self._nursery = nursery
        self._timeout = timeout
        self._worker = worker
        self._what = what
        self._value: T | None = None
        self._last_known: T | None = None  # kept across invalidate(), for a re-read that fails
        self._attempt: _Attempt[T] | None = None
        self._closed = False
        self.attempts = 0  # how many times the worker was asked (observable in tests and metrics)

    @property
    def cached(self) -> T | None:
        return self._value

    def invalidate(self) -> None:
        """Read again on next use; the current value stays the fallback if that read fails."""
        self._last_known = self._value or self._last_known
        self._value = None

    async def get(self) -> T:
        if self._closed:
            raise self._closed_error()
        if self._value is not None:
            await trio.lowlevel.checkpoint()
            return self._value
        attempt = self._attempt
        if attempt is None:
            attempt = self._attempt = _Attempt()
            self._nursery.start_soon(self._run, attempt)
        await attempt.done.wait()
        if attempt.error is not None:
            if isinstance(attempt.error, ClientClosed):
                raise self._closed_error()
            cause = attempt.error
            raise DiscoveryFailed(
                f"{self._what} failed: {type(cause).__name__}: {cause.message}",
                worker=self._worker, rpc=cause.rpc, code=cause.code, retryable=cause.retryable,
                grpc_status=cause.grpc_status,
            ) from cause
        return attempt.value  # type: ignore[return-value]

    async def _run(self, attempt: _Attempt[T]) -> None:
        self.attempts += 1
        try:
            try:
                with trio.fail_after(self._timeout):
                    value = await self._fetch()
            except trio.TooSlowError:
                raise EngineError(f"no answer within {self._timeout:g} s", worker=self._worker,
                                  rpc="GetServerInfo/GetModelInfo", retryable=True) from None
        except EngineError as exc:
            # An outage (UNAVAILABLE, a timeout) says nothing new about the worker: keep what it last reported.
            # A worker that now refuses us (IncompatibleWorker) or a closing client is news: let it stand.
            if self._last_known is not None and not isinstance(exc, (ClientClosed, IncompatibleWorker)):
                log.warning("%s of %s failed; keeping the capabilities it last reported: %s", self._what,
                            self._worker, cause_chain(exc))
                self._value = attempt.value = self._last_known
            else:
                attempt.error = exc
        except BaseException:  # cancelled: the owning client is closing
            if attempt.error is None:
                attempt.error = self._closed_error()
            raise
        else:
            self._value = value
            attempt.value = value
        finally:
            if self._attempt is attempt:
                self._attempt = None
            attempt.done.set()

    def close(self) -> None:
        """Wake every waiter with ClientClosed; later calls fail the same way."""
        self._closed = True
        attempt, self._attempt = self._attempt, None
        if attempt is not None and not attempt.done.is_set():
            attempt.error = self._closed_error()
            attempt.done.set()

    def _closed_error(self) -> ClientClosed:
        return ClientClosed("engine client closed", worker=self._worker, rpc="capabilities")
