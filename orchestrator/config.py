"""The orchestrator's configuration: frozen attrs classes loaded from YAML.

Every error names the file, the key (as a dotted path) and what was expected; unknown keys are
rejected so that a typo never passes silently. `orchestrator check-config FILE` runs `load()`.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import yaml

from orchestrator.models import MODELS_DIR
from orchestrator.parsers import UnknownParserError, resolve
from orchestrator.roles import ROLES
from orchestrator.tls import TlsMaterial, UnreadableTlsFile

MODES = ("aggregated", "disaggregated", "conditional")
POLICIES = ("round_robin", "least_loaded", "kv_aware")
# kv_aware chooses where a prompt is prefilled: the roles that run prefills (a decode leg's KV arrives with it)
KV_AWARE_ROLES = ("aggregated", "prefill")


class ConfigError(ValueError):
    def __init__(self, file: str, key: str, expected: str, got: Any = attrs.NOTHING):
        self.file, self.key, self.expected, self.got = file, key, expected, got
        found = "" if got is attrs.NOTHING else f", got {got!r}"
        super().__init__(f"{file}: {key}: expected {expected}{found}")

    @property
    def errors(self) -> list[ConfigError]:
        """Every error this stands for (ConfigErrors: several)."""
        return [self]


class ConfigErrors(ConfigError):
    """Several errors of one file, all reported at once (the first one's file, key and expectation are ours);
    its message has one line per error."""

    def __init__(self, errors: list[ConfigError]):
        first = errors[0]
        ValueError.__init__(self, "\n".join(str(error) for error in errors))
        self.file, self.key, self.expected = first.file, first.key, first.expected
        self._errors = errors

    @property
    def errors(self) -> list[ConfigError]:
        return list(self._errors)

    @staticmethod
    def of(errors: list[ConfigError]) -> ConfigError | None:
        """None for no error, the error itself for one, all of them for several."""
        flat = [one for error in errors for one in error.errors]
        return None if not flat else flat[0] if len(flat) == 1 else ConfigErrors(flat)


def _positive(instance, attribute, value):
    if value is not None and value <= 0:
        raise _InvalidField(attribute.name, "a number > 0", value)


def _parser_name(instance, attribute, value):
    """model.tool_call_parser / reasoning_parser: a parser we have (the attribute is resolve()'s keyword)."""
    if value is not None:
        try:
            resolve(**{attribute.name: value})
        except UnknownParserError as exc:
            raise _InvalidField(attribute.name, f"one of {', '.join(exc.known)}", value) from None


class _InvalidField(ValueError):
    """Raised by validators; build_attrs turns it into a ConfigError with the full key."""

    def __init__(self, name: str, expected: str, got: Any):
        super().__init__(name, expected, got)
        self.name, self.expected, self.got = name, expected, got


@attrs.frozen
class AdapterConfig:
    """A LoRA adapter a model serves: its API name, and where the workers find its weights (a path on the worker
    host, relative ones resolved against the config file's directory; not checked here)."""

    name: str
    source_path: str

    def resolved_source_path(self, base: Path) -> str:
        path = Path(self.source_path)
        return str(path if path.is_absolute() else (base / path).resolve())


@attrs.frozen
class ModelConfig:
    name: str = "tiny-chat"  # the API's `model`
    dir: str = "builtin:tiny-chat"  # tokenizer.json + tokenizer_config.json; builtin:NAME = shipped
    context_window: int | None = attrs.field(default=None, validator=_positive)
    aliases: tuple[str, ...] = ()
    # The output parsers (TensorRT-LLM's names, docs/parsers.md); unset: what the workers advertise in ModelInfo
    tool_call_parser: str | None = attrs.field(default=None, validator=_parser_name)
    reasoning_parser: str | None = attrs.field(default=None, validator=_parser_name)
    adapters: tuple[AdapterConfig, ...] = ()  # LoRA adapters, requested as `NAME` or `MODEL:NAME`

    @property
    def names(self) -> tuple[str, ...]:
        """What a request's `model` may say to mean this model: its name and aliases."""
        return (self.name, *self.aliases)

    def resolved_dir(self, base: Path) -> Path:
        if self.dir.startswith("builtin:"):
            return MODELS_DIR / self.dir.removeprefix("builtin:")
        path = Path(self.dir)
        return path if path.is_absolute() else (base / path).resolve()


@attrs.frozen
class ConditionalConfig:
    max_local_prefill_length: int = attrs.field(default=512, validator=_positive)


@attrs.frozen
class StaticDiscovery:
    aggregated: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()


@attrs.frozen
class EtcdDiscovery:
    endpoints: tuple[str, ...] = ("http://127.0.0.1:2379",)  # https://: TLS (with the system's CAs by default)
    namespace: str = "orchestrator"
    lease_ttl_s: int = attrs.field(default=10, validator=_positive)
    # TLS to etcd: any of these turns it on. ca_file verifies etcd; cert_file + key_file are ours (mTLS).
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def tls(self, base_dir: Path, file: str) -> TlsMaterial | None:
        """The TLS material, or None for plaintext unless the endpoints say https://."""
        if self.ca_file is None and self.cert_file is None and self.key_file is None:
            return None
        return _read_pem_files(self, "discovery.etcd", base_dir, file)


@attrs.frozen
class DiscoveryConfig:
    static: StaticDiscovery | None = None
    etcd: EtcdDiscovery | None = None


@attrs.frozen
class KvAwareConfig:
    """The kv_aware policy's knobs (docs/kv-routing.md); orchestrator.workers.routing.KvAwareKnobs."""

    overlap_weight: float = attrs.field(default=1.0, validator=_positive)  # one uncached block vs one block of load
    max_imbalance: int = 4  # hot-prefix guard: requests above the least loaded candidate's that void a cache hit
    max_kv_usage: float = 0.9  # load ceiling: KV cache fraction in use above which a hit does not count
    approximate_ttl_s: float = attrs.field(default=120.0, validator=_positive)  # workers without KV events
    # Prompt positions the engine expands one image into (model-specific), until the KV events show an image's
    # own length; 0: unknown, so until then blocks after an image match only our own routing history.
    image_tokens: int = 0


@attrs.frozen
class RoutingConfig:
    aggregated: str = "round_robin"
    prefill: str = "round_robin"
    decode: str = "least_loaded"
    load_staleness_ms: int = attrs.field(default=250, validator=_positive)
    kv_aware: KvAwareConfig = KvAwareConfig()

    @property
    def kv_aware_roles(self) -> tuple[str, ...]:
        """The roles routed kv_aware: a request's prompt block keys are computed only when this is not empty."""
        return tuple(role for role in KV_AWARE_ROLES if getattr(self, role) == "kv_aware")


@attrs.frozen
class LimitsConfig:
    max_images: int = attrs.field(default=16, validator=_positive)
    max_image_bytes: int = attrs.field(default=20 * 1024 * 1024, validator=_positive)
    max_total_image_bytes: int = attrs.field(default=64 * 1024 * 1024, validator=_positive)
    max_image_url_chars: int = attrs.field(default=8192, validator=_positive)
    # A leg whose worker fails after tokens were streamed is continued on another worker this many times.
    migration_limit: int = 2
    # Hosts (exact names) or networks (CIDR) whose image URLs may name internal addresses: workers fetch URLs
    # themselves, so by default only public addresses are allowed (orchestrator/media_policy.py).
    image_url_allowlist: tuple[str, ...] = ()
    max_request_bytes: int = attrs.field(default=96 * 1024 * 1024, validator=_positive)
    request_timeout_s: float = attrs.field(default=600.0, validator=_positive)
    worker_startup_timeout_s: float = attrs.field(default=300.0, validator=_positive)
    discovery_timeout_s: float = attrs.field(default=10.0, validator=_positive)
    health_interval_s: float = attrs.field(default=1.0, validator=_positive)
    prefill_retries: int = 1
    decode_retries: int = 1  # generation legs that failed before their first token
    kv_cleanup_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    shutdown_grace_s: float = attrs.field(default=30.0, validator=_positive)


@attrs.frozen
class KeepaliveConfig:
    """HTTP/2 keepalive on the worker connections, either stream_transport (orchestrator/transport/keepalive.py)."""

    # A PING once a connection with calls open heard nothing from its worker for this long; at most two while
    # the worker sends nothing, then one per 5 minutes (a stock gRPC server's limit); doubled after a GOAWAY
    # too_many_pings from a stricter one.
    interval_s: float = attrs.field(default=30.0, validator=_positive)
    # A PING unanswered this long fails the connection's calls (retryable): a worker host gone without a FIN.
    timeout_s: float = attrs.field(default=10.0, validator=_positive)


@attrs.frozen
class TlsFiles:
    """PEM files for TLS to the workers. `ca_file` verifies them; `cert_file` + `key_file` are ours (mTLS)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None  # the name to check in the workers' certificates, if not their address

    def tls(self, base_dir: Path, file: str) -> TlsMaterial:
        return _read_pem_files(self, "workers_tls", base_dir, file, server_name=self.server_name)


def _read_pem_files(section, name: str, base_dir: Path, file: str, server_name: str | None = None,
                    prefix: str = "") -> TlsMaterial:
    """`section`'s ca_file, cert_file and key_file (each named with `prefix`) read, None where unset; paths
    relative to the config."""
    ca, cert, key = (getattr(section, prefix + setting, None) for setting in ("ca_file", "cert_file", "key_file"))
    if (cert is None) != (key is None):
        raise ConfigError(file, name, f"both {prefix}cert_file and {prefix}key_file, or neither")
    try:
        return TlsMaterial.read(ca, cert, key, base_dir=base_dir, server_name=server_name)
    except UnreadableTlsFile as exc:
        raise ConfigError(file, f"{name}.{prefix}{exc.setting}", f"a readable PEM file ({exc.strerror})",
                          getattr(section, prefix + exc.setting)) from exc


@attrs.frozen
class KeyLimits:
    """One API key's limits, each optional; enforced per orchestrator process (frontend/limits.py)."""

    requests_per_s: float | None = attrs.field(default=None, validator=_positive)  # token bucket, 1 s of burst
    tokens_per_min: int | None = attrs.field(default=None, validator=_positive)  # prompt + completion, 1 min of burst
    max_concurrency: int | None = attrs.field(default=None, validator=_positive)  # requests in flight at once


@attrs.frozen
class ApiKeyConfig:
    """A named API key: the name labels its usage metrics and logs (never the secret), which is inline
    (`key`), in an environment variable (`key_env`) or alone in a file (`key_file`, e.g. a mounted Secret)."""

    name: str
    key: str | None = None
    key_env: str | None = None
    key_file: str | None = None
    limits: KeyLimits | None = None
    # isolates this key's prefix cache: its requests' KV blocks are keyed with this salt on every worker
    # (kv.cache_salt), so another key's requests never reuse them, nor learn of them from cached_tokens
    cache_salt: str | None = None
    models: tuple[str, ...] | None = None  # the models (names or aliases) this key may use; unset: every one


@attrs.frozen
class AuthConfig:
    """API keys (Bearer). Any of the sources; none at all: no authentication."""

    keys: tuple[ApiKeyConfig, ...] = ()  # named keys, with usage metrics and optional limits per name
    api_keys: tuple[str, ...] = ()  # inline (prefer a file or the environment for real keys)
    api_keys_file: str | None = None  # one key per line; relative to the config file
    api_keys_env: str | None = None  # the name of an environment variable holding comma-separated keys
    protect_health: bool = False  # /health needs a key too
    protect_metrics: bool = False  # /metrics needs a key too


STREAM_TRANSPORTS = ("grpcio", "h2")  # as orchestrator/transport/calls.py has them


@attrs.frozen
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Frontend processes behind the one port, each with its own trio loop and pool view (the kernel spreads
    # connections with SO_REUSEPORT). One per core uses every core.
    processes: int = attrs.field(default=1, validator=_positive)
    backlog: int = attrs.field(default=1024, validator=_positive)  # the listen queue for connection bursts
    # Open client connections: one more closes the longest idle one, or is refused (503) when
    # none is idle. Default and ceiling: the open files limit less a reserve (frontend/descriptors.py).
    max_connections: int | None = attrs.field(default=None, validator=_positive)
    tls_cert_file: str | None = None  # HTTPS: PEM certificate chain and key
    tls_key_file: str | None = None
    body_timeout_s: float = attrs.field(default=30.0, validator=_positive)  # the whole request body, or a 408
    keep_alive_s: float = attrs.field(default=15.0, validator=_positive)  # an idle keep-alive connection closes
    max_header_bytes: int = attrs.field(default=16 * 1024, validator=_positive)
    # One SSE event per token (what aiperf and other token-counting clients measure). True: the tokens
    # that arrived together go out as one event, fewer writes under load but coarser timing.
    coalesce_tokens: bool = False

    def tls(self, base_dir: Path, file: str) -> TlsMaterial | None:
        """The served certificate and key (HTTPS), or None for plain HTTP."""
        if self.tls_cert_file is None or self.tls_key_file is None:  # load() refuses one without the other
            return None
        return _read_pem_files(self, "http", base_dir, file, prefix="tls_")


@attrs.frozen
class TracingConfig:
    """OpenTelemetry traces over OTLP/HTTP (orchestrator/tracing.py); no `tracing:` section: no tracing at all."""

    endpoint: str  # the collector's traces URL, e.g. http://otel-collector:4318/v1/traces
    sample_ratio: float = 1.0  # of the traces that start here; a client's sampled traceparent is always followed
    service_name: str = "orchestrator"


@attrs.frozen
class SimSpec:
    profile: str = "llama3-8b-h100"
    time_scale: float = 1.0
    # Which TensorRT-LLM OpenEngine server the simulator behaves as: 1, tensorrt_llm/grpc/openengine (role per
    # request, no media); 3, tensorrt_llm/openengine (declared roles, images). See orchestrator/sim/persona.py.
    schema_revision: int = 1
    # What the simulated engine was started with (orchestrator/sim/tool_formats.py, persona.py): TensorRT-LLM's
    # guided_decoding_backend (none | xgrammar | llguidance) and the model's parsers, by TensorRT-LLM's names.
    guided_backend: str = "none"
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    natural_eos: bool = False  # the model stops when it is done, whatever max_tokens allows (sim-worker --natural-eos)
    args: tuple[str, ...] = ()


RESTART_POLICIES = ("always", "on-failure", "never")  # a launched worker that exits after start-up


@attrs.frozen
class WorkerLaunch:
    role: str
    model: str | None = None  # the model it serves (models:); unset: the only one
    count: int = attrs.field(default=1, validator=_positive)
    sim: SimSpec | None = None
    # A real worker: argv with {port} substituted, run in the config file's directory (relative paths in it
    # resolve as model.dir does).
    command: tuple[str, ...] = ()
    register: bool = False  # run `orchestrator register` beside it (etcd discovery)
    env: dict[str, str] = attrs.field(factory=dict)  # added to its environment, e.g. CUDA_VISIBLE_DEVICES
    # When it exits after start-up: always restarted, only when it failed (non-zero code or a signal), or never
    # (the deployment serves on without it). Restarts back off (launch.restart_backoff_s).
    restart: str = "on-failure"


@attrs.frozen
class EtcdLaunch:
    enabled: bool = False
    binary: str = "etcd"


@attrs.frozen
class LaunchConfig:
    etcd: EtcdLaunch = EtcdLaunch()
    workers: tuple[WorkerLaunch, ...] = ()
    ready_timeout_s: float = attrs.field(default=120.0, validator=_positive)
    # Crash-loop backoff: the first restart waits this long, each quick one after it twice as long, up to
    # restart_backoff_max_s; a worker that ran that long since its last start is restarted after the first delay.
    restart_backoff_s: float = attrs.field(default=1.0, validator=_positive)
    restart_backoff_max_s: float = attrs.field(default=30.0, validator=_positive)


RESPONSE_STORES = ("sqlite", "redis")


def _store_kind(instance, attribute, value):
    if value not in RESPONSE_STORES:
        raise _InvalidField(attribute.name, f"one of {', '.join(RESPONSE_STORES)}", value)


@attrs.frozen
class ResponsesConfig:
    """Where `POST /v1/responses` keeps responses for `previous_response_id` and `GET /v1/responses/{id}`."""

    store: str = attrs.field(default="sqlite", validator=_store_kind)  # sqlite: embedded; redis: shared
    path: str | None = None  # the SQLite file (relative to the config file); None: in memory, this process only
    url: str = "redis://127.0.0.1:6379/0"  # the Redis server several replicas share
    key_prefix: str = "orchestrator:responses"
    max_age_s: float = attrs.field(default=30 * 24 * 3600.0, validator=_positive)  # OpenAI keeps 30 days
    max_count: int = attrs.field(default=100_000, validator=_positive)

    def resolved_path(self, base: Path) -> Path | None:
        if self.path is None:
            return None
        path = Path(self.path)
        return path if path.is_absolute() else (base / path).resolve()


@attrs.frozen
class Config:
    mode: str = "disaggregated"
    model: ModelConfig = ModelConfig()
    conditional: ConditionalConfig = ConditionalConfig()
    discovery: DiscoveryConfig = DiscoveryConfig(static=StaticDiscovery())
    routing: RoutingConfig = RoutingConfig()
    limits: LimitsConfig = LimitsConfig()
    http: HttpConfig = HttpConfig()
    auth: AuthConfig = AuthConfig()
    workers_tls: TlsFiles | None = None  # TLS (mTLS with cert_file/key_file) on every worker connection
    # How calls reach the workers: h2 (our HTTP/2 client on trio, transport/h2_channel.py), or grpcio
    stream_transport: str = "h2"
    keepalive: KeepaliveConfig = KeepaliveConfig()  # PINGs on the worker connections
    launch: LaunchConfig = LaunchConfig()
    tracing: TracingConfig | None = None  # OpenTelemetry; off without this section
    responses: ResponsesConfig = ResponsesConfig()  # the Responses API's store
    log_level: str = "INFO"
    source: str = attrs.field(default="<defaults>", eq=False)
    base_dir: Path = attrs.field(default=Path("."), eq=False)
    # `models:` in the file: one single-model view per served model (the first is this config itself, with its
    # own model, mode, discovery, routing and limits); empty for the single-model form and for the views.
    per_model: tuple[Config, ...] = attrs.field(default=(), eq=False)

    @property
    def models(self) -> tuple[Config, ...]:
        """Every served model as a single-model config: its model, mode, conditional, discovery, routing and
        limits, and the deployment's other sections (http, auth, launch, ...) shared."""
        return self.per_model or (self,)

    @property
    def needed_roles(self) -> tuple[str, ...]:
        return {"aggregated": ("aggregated",), "disaggregated": ("prefill", "decode"),
                "conditional": ("prefill", "decode")}[self.mode]

    @property
    def kv_aware_roles(self) -> tuple[str, ...]:
        """The roles routed kv_aware that this mode runs (routing.prefill: kv_aware in aggregated mode sets up
        nothing): the KV index, its event feed and the prompts' block keys exist only for these."""
        return tuple(role for role in self.routing.kv_aware_roles if role in self.needed_roles)

    @property
    def model_dir(self) -> Path:
        return self.model.resolved_dir(self.base_dir)


# ---- loading --------------------------------------------------------------------------------------

def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin is dict:
        key, value = typing.get_args(tp)
        return f"a mapping of {_describe(key)} to {_describe(value)}"
    if attrs.has(tp):
        return "a mapping"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false",
            type(None): "null", Path: "a path"}.get(tp, str(tp))


def _convert(value: Any, tp: Any, file: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        others = [arg for arg in args if arg is not type(None)]
        if len(others) == 1:  # X | None: what is wrong inside X names its own key
            return _convert(value, others[0], file, key)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, file, key)
            except ConfigError:
                continue
        raise ConfigError(file, key, _describe(tp), value)
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(file, key, _describe(tp), value)
        (item_type, *_) = typing.get_args(tp)
        items, errors = [], []
        for i, v in enumerate(value):
            try:
                items.append(_convert(v, item_type, file, f"{key}[{i}]"))
            except ConfigError as exc:
                errors.append(exc)
        problem = ConfigErrors.of(errors)
        if problem is not None:
            raise problem
        return tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(file, key, _describe(tp), value)
        key_type, value_type = typing.get_args(tp)
        return {_convert(k, key_type, file, f"{key}.{k}"): _convert(v, value_type, file, f"{key}.{k}")
                for k, v in value.items()}
    if attrs.has(tp):
        return build_attrs(tp, value, file, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(file, key, "true or false", value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(file, key, "an integer", value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(file, key, "a number", value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(file, key, "a string", value)
        return value
    raise ConfigError(file, key, _describe(tp), value)


def build_attrs(cls: type, data: Any, file: str, prefix: str) -> Any:
    where = prefix or "(top level)"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(file, where, "a mapping", data)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in attrs.fields(cls) if f.eq and f.name not in ("source", "base_dir")}
    # Every error of this mapping (and of those inside it), not only the first: an operator fixes them in one go.
    errors = [ConfigError(file, f"{prefix}.{name}" if prefix else name,
                          f"one of the known keys ({', '.join(sorted(fields))}); unknown key")
              for name in sorted(set(data) - set(fields), key=str)]
    kwargs = {}
    for name, value in data.items():
        if name not in fields:
            continue
        key = f"{prefix}.{name}" if prefix else name
        try:
            kwargs[name] = _convert(value, hints[name], file, key)
        except ConfigError as exc:
            errors.append(exc)
    errors += [ConfigError(file, f"{prefix}.{name}" if prefix else name, "a value (required)")
               for name, f in fields.items() if f.default is attrs.NOTHING and name not in data]
    problem = ConfigErrors.of(errors)
    if problem is not None:
        raise problem
    try:
        return cls(**kwargs)
    except _InvalidField as exc:
        raise ConfigError(file, f"{prefix}.{exc.name}" if prefix else exc.name, exc.expected, exc.got) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(file, where, str(exc)) from exc


def _problems(config: Config, file: str, check_paths: bool = True) -> Iterator[ConfigError]:
    """Every error of a config that built: each check on its own, so all of them are reported at once."""
    if config.mode not in MODES:
        yield ConfigError(file, "mode", " or ".join(MODES), config.mode)
    if config.stream_transport not in STREAM_TRANSPORTS:
        yield ConfigError(file, "stream_transport", " or ".join(STREAM_TRANSPORTS), config.stream_transport)
    for role in ROLES:
        policy = getattr(config.routing, role)
        allowed = POLICIES if role in KV_AWARE_ROLES else tuple(p for p in POLICIES if p != "kv_aware")
        if policy not in allowed:
            yield ConfigError(file, f"routing.{role}", " or ".join(allowed), policy)
    kv_aware = config.routing.kv_aware
    if kv_aware.max_imbalance < 0:
        yield ConfigError(file, "routing.kv_aware.max_imbalance", "an integer >= 0", kv_aware.max_imbalance)
    if kv_aware.image_tokens < 0:
        yield ConfigError(file, "routing.kv_aware.image_tokens", "an integer >= 0", kv_aware.image_tokens)
    if not 0.0 < kv_aware.max_kv_usage <= 1.0:
        yield ConfigError(file, "routing.kv_aware.max_kv_usage", "a number > 0 and <= 1", kv_aware.max_kv_usage)
    model_dir = config.model_dir
    for needed in ("tokenizer.json", "tokenizer_config.json") if check_paths else ():
        if not (model_dir / needed).is_file():
            yield ConfigError(file, "model.dir", f"a directory holding {needed} (looked in {model_dir})",
                              config.model.dir)
            break
    discovery = config.discovery
    if (discovery.static is None) == (discovery.etcd is None):
        yield ConfigError(file, "discovery", "exactly one of static or etcd")
    if discovery.static is not None:
        for role in ROLES:
            for i, address in enumerate(getattr(discovery.static, role)):
                if not address.startswith("grpc://") or ":" not in address.removeprefix("grpc://"):
                    yield ConfigError(file, f"discovery.static.{role}[{i}]", "grpc://HOST:PORT", address)
    for i, worker in enumerate(config.launch.workers):
        key = f"launch.workers[{i}]"
        if worker.role not in ROLES:
            yield ConfigError(file, f"{key}.role", " or ".join(ROLES), worker.role)
        if (worker.sim is None) == (not worker.command):
            yield ConfigError(file, key, "exactly one of sim or command")
        if worker.restart not in RESTART_POLICIES:
            yield ConfigError(file, f"{key}.restart", " or ".join(RESTART_POLICIES), worker.restart)
        if worker.sim is not None:  # the profile name is checked by orchestrator.launch (it knows the simulator)
            if worker.sim.time_scale < 0:
                yield ConfigError(file, f"{key}.sim.time_scale", "a number >= 0", worker.sim.time_scale)
            if worker.sim.schema_revision not in (1, 3):
                yield ConfigError(file, f"{key}.sim.schema_revision", "1 or 3", worker.sim.schema_revision)
    if config.launch.restart_backoff_max_s < config.launch.restart_backoff_s:
        yield ConfigError(file, "launch.restart_backoff_max_s", f"a number >= launch.restart_backoff_s "
                          f"({config.launch.restart_backoff_s})", config.launch.restart_backoff_max_s)
    if (config.http.tls_cert_file is None) != (config.http.tls_key_file is None):
        yield ConfigError(file, "http.tls_key_file", "both http.tls_cert_file and http.tls_key_file, or neither")
    for name in ("prefill_retries", "decode_retries", "migration_limit"):
        if getattr(config.limits, name) < 0:
            yield ConfigError(file, f"limits.{name}", "an integer >= 0", getattr(config.limits, name))
    yield from _check_keys(config.auth, file)
    yield from _check_tracing(config.tracing, file)
    for i, worker in enumerate(config.launch.workers):
        for name in worker.env:
            if not name or "=" in name or "\0" in name:
                yield ConfigError(file, f"launch.workers[{i}].env", "environment variable names without '='", name)


KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")


def _check_keys(auth: AuthConfig, file: str) -> Iterator[ConfigError]:
    seen: set[str] = set()
    for i, key in enumerate(auth.keys):
        where = f"auth.keys[{i}]"
        if not KEY_NAME.fullmatch(key.name):
            yield ConfigError(file, f"{where}.name", "a name of letters, digits and _ . : - (at most 64, used as a "
                              "metrics label)", key.name)
        if key.name in seen:
            yield ConfigError(file, f"{where}.name", "a name no other key has", key.name)
        seen.add(key.name)
        sources = [source for source in ("key", "key_env", "key_file") if getattr(key, source) is not None]
        if len(sources) != 1:
            yield ConfigError(file, where, "exactly one of key, key_env or key_file "
                              f"(got {', '.join(sources) or 'none'})")
        if key.cache_salt is not None and not key.cache_salt.strip():
            raise ConfigError(file, f"{where}.cache_salt", "a non-empty string (the key's own cache namespace)",
                              key.cache_salt)


def _check_tracing(tracing: TracingConfig | None, file: str) -> Iterator[ConfigError]:
    if tracing is None:
        return
    if not tracing.endpoint.startswith(("http://", "https://")):
        yield ConfigError(file, "tracing.endpoint", "an OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces",
                          tracing.endpoint)
    if not 0.0 <= tracing.sample_ratio <= 1.0:
        yield ConfigError(file, "tracing.sample_ratio", "a number from 0 to 1", tracing.sample_ratio)
    if not tracing.service_name:
        yield ConfigError(file, "tracing.service_name", "a non-empty name", tracing.service_name)


def load(path: str | Path, *, check_paths: bool = True) -> Config:
    path = Path(path)
    file = str(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(file, "(file)", f"a readable YAML file ({exc.strerror})") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(file, "(syntax)", f"valid YAML: {exc}") from exc
    if data is None:
        raise ConfigError(file, "(file)", "a configuration: the file is empty")
    return from_dict(data, file=file, base_dir=path.resolve().parent, check_paths=check_paths)


def serving_problem(config: Config, file: str) -> ConfigError | None:
    """Why this config cannot serve as written, if it cannot: a role a model's mode needs has no worker
    (none listed under discovery.static and none launched for it). etcd discovery finds its workers later."""
    for i, view in enumerate(config.models):
        if view.discovery.static is None:
            continue
        launched = {w.role for w in config.launch.workers if launched_model(config, w) is view}
        for role in view.needed_roles:
            if not getattr(view.discovery.static, role) and role not in launched:
                prefix = f"models[{i}]." if config.per_model else ""
                return ConfigError(file, f"{prefix}discovery.static.{role}",
                                   f"at least one {role} worker for {view.mode} mode (list its grpc:// address, or "
                                   f"launch one under launch.workers)", [])
    return None


def _without_retired_keys(data: Any, file: str) -> Any:
    """`http.server` chose between our HTTP server (`native`, the default) and hypercorn's until hypercorn was
    removed. A config that spelled out `native` keeps loading unchanged on upgrade (the key is dropped: it
    chooses nothing now); one that asked for hypercorn is refused at load, so `check-config` says so before a
    deployment would quietly run another server than the one it names."""
    http = data.get("http") if isinstance(data, dict) else None
    if not isinstance(http, dict) or "server" not in http:
        return data
    if http["server"] != "native":
        raise ConfigError(file, "http.server", "native, the only HTTP server since hypercorn was removed (or no "
                          "http.server key at all)", http["server"])
    return {**data, "http": {key: value for key, value in http.items() if key != "server"}}


def from_dict(data: Any, *, file: str = "<dict>", base_dir: Path = Path("."), check_paths: bool = True) -> Config:
    """Build and check a config; `check_paths=False` skips what only the target host has (model.dir)."""
    data = _without_retired_keys(data, file)
    if isinstance(data, dict) and "models" in data:
        return _several_models(data, file, base_dir, check_paths)
    config = build_attrs(Config, data, file, "")
    config = attrs.evolve(config, source=file, base_dir=base_dir)
    problem = ConfigErrors.of([*_problems(config, file, check_paths), *_served_problems(config, file)])
    if problem is not None:
        raise problem
    return config


# ---- several models (`models:`) -------------------------------------------------------------------

MODEL_KEYS = tuple(field.name for field in attrs.fields(ModelConfig))  # an entry's own model fields
# The sections an entry may set for itself; what it does not set it inherits from the top level, key by key.
MODEL_SECTIONS = ("mode", "conditional", "discovery", "routing", "limits")
_KEY_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _several_models(data: dict, file: str, base_dir: Path, check_paths: bool) -> Config:
    """`models:`: one single-model Config per entry, built from the top level's raw sections with the entry's
    merged over them (so an error names the key the operator wrote: the entry's, or the top level's once)."""
    entries = data["models"]
    errors: list[ConfigError] = []
    if "model" in data:
        errors.append(ConfigError(file, "model", "either model: (one model) or models: (a list), not both"))
    if not isinstance(entries, list) or not entries:
        raise ConfigError(file, "models", "a list of one or more models, each a mapping with its name", entries)
    top = {key: value for key, value in data.items() if key not in ("models", "model")}
    try:  # the shared sections, and the defaults the entries inherit: their errors are reported here, once
        shared = attrs.evolve(build_attrs(Config, top, file, ""), source=file, base_dir=base_dir)
        errors += [error for error in _problems(shared, file, check_paths=False) if not error.key.startswith("model")]
    except ConfigError as exc:
        errors += exc.errors
        shared = None
    views: list[Config] = []
    for i, entry in enumerate(entries):
        where = f"models[{i}]"
        if not isinstance(entry, dict):
            errors.append(ConfigError(file, where, "a mapping (name, dir, ..., and the sections "
                                      f"{', '.join(MODEL_SECTIONS)} it sets for itself)", entry))
            continue
        known = (*MODEL_KEYS, *MODEL_SECTIONS)
        errors += [ConfigError(file, f"{where}.{key}", f"one of the known keys ({', '.join(sorted(known))}); "
                               "unknown key") for key in entry if key not in known]
        merged = dict(top, model={key: value for key, value in entry.items() if key in MODEL_KEYS})
        for section in MODEL_SECTIONS:
            if section in entry:
                merged[section] = _inherit(top.get(section), entry[section], section)
        try:
            view = attrs.evolve(build_attrs(Config, merged, file, ""), source=file, base_dir=base_dir)
            found = list(_problems(view, file, check_paths))
        except ConfigError as exc:
            view, found = None, exc.errors
        errors += [error for error in (_entry_error(error, entry, top, where) for error in found) if error is not None]
        if view is not None:
            views.append(view)
    config = attrs.evolve(views[0], per_model=tuple(views)) if views else None
    if config is not None and len(views) == len(entries):
        errors += _served_problems(config, file)
    problem = ConfigErrors.of(errors)
    if problem is not None:
        raise problem
    if config is None or shared is None or len(views) != len(entries):  # (each of these came with an error)
        raise ConfigError(file, "models", "valid model entries")
    return config


def _inherit(top: Any, own: Any, section: str) -> Any:
    """An entry's section over the top level's, key by key for mappings (`routing.prefill` keeps the other
    routing keys). discovery's static and etcd are alternatives: an entry naming one drops the top level's other;
    and an entry's static lists are its own workers, whole (another model's workers are never inherited)."""
    if not isinstance(top, dict) or not isinstance(own, dict) or section == "discovery.static":
        return own
    if section == "discovery":
        top = {key: value for key, value in top.items() if not ({"static", "etcd"} - {key}) & set(own)}
    return {**top, **{key: _inherit(top.get(key), value, f"{section}.{key}") for key, value in own.items()}}


def _entry_error(error: ConfigError, entry: dict, top: dict, where: str) -> ConfigError | None:
    """An error of a model's view renamed to the entry's key (`models[1].routing.prefill`), or None when the
    value came from the top level (reported there, once)."""
    own = error.key.removeprefix("model").lstrip(".") if error.key.split(".")[0] == "model" else error.key
    in_model = own != error.key
    if not in_model and _has_key(top, error.key) and not _has_key(entry, error.key):
        return None
    if not in_model and own.split(".")[0].split("[")[0] not in (*MODEL_SECTIONS,):
        return None  # a shared section (launch, auth, http, ...): the top level's own error
    return ConfigError(error.file, f"{where}.{own}" if own else where, error.expected, error.got)


def _has_key(data: Any, key: str) -> bool:
    for name, index in _KEY_PART.findall(key):
        if name:
            if not isinstance(data, dict) or name not in data:
                return False
            data = data[name]
        else:
            if not isinstance(data, list) or int(index) >= len(data):
                return False
            data = data[int(index)]
    return True


def _served_problems(config: Config, file: str) -> Iterator[ConfigError]:
    """What only the whole list of models can check: names, aliases and adapter names unique across models, and
    the model names that launch.workers and auth.keys give."""
    several = len(config.models) > 1
    owner: dict[str, str] = {}
    for i, view in enumerate(config.models):
        prefix = f"models[{i}]" if config.per_model else "model"
        named = [(f"{prefix}.name", view.model.name),
                 *((f"{prefix}.aliases[{k}]", alias) for k, alias in enumerate(view.model.aliases)),
                 *((f"{prefix}.adapters[{k}].name", a.name) for k, a in enumerate(view.model.adapters))]
        for key, name in named:
            if not name.strip():
                yield ConfigError(file, key, "a non-empty name (what requests send as `model`)", name)
            elif name in owner:
                yield ConfigError(file, key, f"a name no other model, alias or adapter has ({owner[name]} has it)",
                                  name)
            else:
                owner[name] = key
    served = {name: view.model.name for view in config.models for name in view.model.names}
    for i, worker in enumerate(config.launch.workers):
        if worker.model is None and several:
            yield ConfigError(file, f"launch.workers[{i}].model", f"the model it serves, one of "
                              f"{', '.join(v.model.name for v in config.models)} (required with several models)")
        elif worker.model is not None and worker.model not in served:
            yield ConfigError(file, f"launch.workers[{i}].model", f"one of {', '.join(sorted(served))}", worker.model)
    for i, api_key in enumerate(config.auth.keys):
        for k, name in enumerate(api_key.models or ()):
            if name not in served:
                yield ConfigError(file, f"auth.keys[{i}].models[{k}]", f"a served model: one of "
                                  f"{', '.join(sorted(served))}", name)


def launched_model(config: Config, worker: WorkerLaunch) -> Config:
    """The model view a launched worker serves (its `model`, or the only one); load() checked the name."""
    for view in config.models:
        if worker.model is None or worker.model in view.model.names:
            return view
    raise ValueError(f"no served model {worker.model!r}")
