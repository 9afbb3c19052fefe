"""Prometheus metrics of one orchestrator (its own registry, so tests can run several).

With several frontend processes (`http.processes`), prometheus_client's multiprocess mode keeps every
process's values in files under one directory (PROMETHEUS_MULTIPROC_DIR, set by the first process
before prometheus_client is imported), and /metrics in any process renders the sum: counters and
histograms summed over every process that ever ran, in-flight summed over live ones, process CPU
and memory summed over live ones (FrontendProcesses).
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import os
import re
from pathlib import Path
from typing import Any

import attrs
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from orchestrator.openengine.v1.error_pb2 import ErrorCode
from orchestrator.roles import ROLES

_ITL = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
_PATHS = ("aggregated", "disaggregated", "local")  # how a request was served (conditional mode picks per request)
ROUTES = ("chat", "completions", "responses", "messages")
OUTCOMES = ("ok", "error", "client_error", "disconnected")
KV_CLEANUP_WAYS = ("decode_pull", "decode_first_token")  # only a pull frees a session (kv/lease.py)
KV_INDEX_MODES = ("events", "approximate")  # orchestrator.workers.kv_index.MODES, a label of kv_index_mode
KEY_LIMIT_CODES = ("rate_limit_exceeded", "token_limit_exceeded", "concurrency_limit_exceeded")  # frontend/limits.py
# Why a worker's KV events were refused (workers/kv_event_codec.py REFUSALS), a label of kv_events_refused
KV_REFUSALS = ("oversize", "over_bound", "bad_rank", "malformed")
ROUTING_REASONS = ("policy", "prefix", "load", "hot_prefix_guard", "single")  # workers/routing.py REASONS
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


# The families labelled by model (its last label): a Metrics is one model's view of them (for_model). Requests
# that never named a served model (a bad body, an unknown model) count under model "".
_PER_MODEL = ("requests", "ttft", "itl", "prompt_tokens", "cached_tokens", "output_tokens", "stage", "workers",
              "engine_errors", "retries", "kv_cleanups", "migrations", "routing_decisions", "routing_prompt_blocks",
              "routing_cached_blocks", "kv_index_blocks", "kv_index_mode", "health_checks_late", "kv_events_refused")
_PER_MODEL_ONE = ("kv_index_routed", "prefill_answers")  # labelled by model alone: the view holds the series


class ModelSeries:
    """A metric family seen by one model: `labels(...)` and `remove(...)` take the other labels."""

    __slots__ = ("family", "model")

    def __init__(self, family, model: str) -> None:
        self.family, self.model = family, model

    def labels(self, *values: str):
        return self.family.labels(*values, self.model)

    def remove(self, *values: str) -> None:
        self.family.remove(*values, self.model)


class Metrics:
    """Every labelled series exists from start-up at 0, so a rate() or an alert sees the first event.

    One registry per process; this object is one model's view of it (`model`, and its `mode`), for_model()
    gives another's."""

    def __init__(self, mode: str = "disaggregated", *, model: str = "", multiprocess_dir: str | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self._multiprocess = multiprocess_dir is not None
        if multiprocess_dir is None:
            ProcessCollector(registry=r)  # process_cpu_seconds_total, resident memory, open fds
            r.register(PLATFORM_COLLECTOR)
            r.register(GC_COLLECTOR)
            self._rendered = r
        else:  # the metrics below write to files; what is rendered is every process's files, summed
            self._rendered = CollectorRegistry()
            MultiProcessCollector(self._rendered, path=multiprocess_dir)
            self._rendered.register(FrontendProcesses(multiprocess_dir))
            self._rendered.register(PLATFORM_COLLECTOR)
        self.requests = Counter("orchestrator_requests", "Requests by route, mode and outcome",
                                ["route", "mode", "outcome", "model"], registry=r)
        self.ttft = Histogram("orchestrator_time_to_first_token_seconds", "Time to first token", ["mode", "model"],
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("orchestrator_inter_token_latency_seconds",
                             "Time between streamed tokens (a gap before k tokens that arrived together counts k "
                             "times as gap/k)", ["mode", "model"], buckets=_ITL, registry=r)
        self.prompt_tokens = Counter("orchestrator_prompt_tokens", "Prompt tokens of requests sent to workers, by mode",
                                     ["mode", "model"], registry=r)
        self.cached_tokens = Counter("orchestrator_cached_prompt_tokens",
                                     "Prompt tokens the engines found in their KV cache (usage.cached_prompt_tokens; a "
                                     "split request: the prefill's), by mode", ["mode", "model"], registry=r)
        self.output_tokens = Counter("orchestrator_output_tokens", "Tokens streamed to clients, by mode",
                                     ["mode", "model"], registry=r)
        self.stage = Histogram("orchestrator_stage_duration_seconds",
                               "Stage durations: prefill, kv_handoff (prefill ready -> first decode token), decode",
                               ["stage", "model"], buckets=_LATENCY, registry=r)
        self.inflight = Gauge("orchestrator_requests_in_flight", "Requests being served (queue depth)", registry=r,
                              multiprocess_mode="livesum")
        # Every frontend process keeps its own view of the same pool: the latest one written is the answer.
        self.workers = Gauge("orchestrator_workers", "Workers in the pool by role and state",
                             ["role", "state", "model"], registry=r, multiprocess_mode="livemostrecent")
        self.engine_errors = Counter("orchestrator_engine_errors", "Engine errors by code", ["code", "model"],
                                     registry=r)
        self.retries = Counter("orchestrator_retries", "Legs retried on another worker of the same role, by role",
                               ["role", "model"], registry=r)
        self.kv_cleanups = Counter("orchestrator_kv_cleanups", "KV sessions released after a cancellation, by way",
                                   ["way", "model"], registry=r)
        self.migrations = Counter("orchestrator_migrations", "Requests continued on another worker after a worker "
                                  "failed mid-stream (prompt + tokens sent), by mode", ["mode", "model"],
                                  registry=r)
        # KV-aware routing (orchestrator/workers/routing.py KvAware; docs/kv-routing.md). Per worker: the prompt
        # blocks routed there and how many of them the index said it held (expected hit rate = cached / prompt).
        self.routing_decisions = Counter("orchestrator_routing_decisions", "Routing decisions by role and reason "
                                         "(prefix, load, hot_prefix_guard, single, policy)",
                                         ["role", "reason", "model"],
                                         registry=r)
        self.routing_prompt_blocks = Counter("orchestrator_kv_routing_prompt_blocks", "Full prompt blocks routed "
                                             "kv_aware, by worker", ["worker", "model"], registry=r)
        self.routing_cached_blocks = Counter("orchestrator_kv_routing_cached_blocks", "Of those, the leading blocks "
                                             "the KV index said the worker held, by worker", ["worker", "model"],
                                             registry=r)
        self.kv_index_blocks = Gauge("orchestrator_kv_index_blocks", "Blocks the KV index holds from a worker's KV "
                                     "events (block x DP rank), by worker", ["worker", "model"], registry=r,
                                     multiprocess_mode="livemostrecent")
        self.kv_index_mode = Gauge("orchestrator_kv_index_mode", "1 for the way the KV index knows a worker: events "
                                   "(its KV events) or approximate (where we routed)", ["worker", "mode", "model"],
                                   registry=r, multiprocess_mode="livemostrecent")
        self.kv_index_routed = Gauge("orchestrator_kv_index_routed_entries", "Approximate entries (block x worker "
                                     "we routed it to) alive in the KV index", ["model"], registry=r,
                                     multiprocess_mode="livemostrecent")
        self.health_checks_late = Counter("orchestrator_health_checks_late", "Health checks that timed out without "
                                          "taking the worker out of the pool (its streams flowed, or fewer misses "
                                          "in a row than it takes), by worker", ["worker", "model"], registry=r)
        self.kv_events_refused = Counter("orchestrator_kv_events_refused", "KV event batches or messages refused "
                                         "from a worker (oversize, over its bound, a wrong rank), by worker and "
                                         "reason", ["worker", "reason", "model"], registry=r)
        self.prefill_answers = Counter("orchestrator_prefill_answers",
                                       "Disaggregated requests answered by the context-only leg alone (its one token "
                                       "finished them: EOS or a stop)", ["model"], registry=r)
        # Per API key name (auth:), never the secret; series for every configured key exist from start-up.
        self.key_requests = Counter("orchestrator_key_requests", "Completion requests admitted, by API key name",
                                    ["key"], registry=r)
        self.key_rejections = Counter("orchestrator_key_rejections", "Requests refused with 429 by an API key's "
                                      "limits, by key name and error code", ["key", "code"], registry=r)
        self.key_prompt_tokens = Counter("orchestrator_key_prompt_tokens", "Prompt tokens of answered requests "
                                         "(their usage), by API key name", ["key"], registry=r)
        self.key_cached_tokens = Counter("orchestrator_key_cached_prompt_tokens", "Prompt tokens the engines found "
                                         "cached (usage.prompt_tokens_details), by API key name", ["key"], registry=r)
        self.key_completion_tokens = Counter("orchestrator_key_completion_tokens", "Completion tokens of answered "
                                             "requests (their usage), by API key name", ["key"], registry=r)

        self.families = {name: getattr(self, name) for name in (*_PER_MODEL, *_PER_MODEL_ONE)}
        self._bind(model, mode)

    def for_model(self, model: str, mode: str) -> Metrics:
        """The view of one served model: the same registry, its series labelled `model` (and `mode`, the
        model's), under the same names, so a call such as `metrics.retries.labels(role)` stays as it is."""
        view = copy.copy(self)
        view._bind(model, mode)
        return view

    def _bind(self, model: str, mode: str) -> None:
        self.model = model
        for name in _PER_MODEL:
            setattr(self, name, ModelSeries(self.families[name], model))
        for name in _PER_MODEL_ONE:
            setattr(self, name, self.families[name].labels(model))
        # Every labelled series is created here, at 0; the ones used per request or per token are kept, since a
        # labels() call takes a lock and validates its arguments each time.
        self.by_path = {path: PathSeries(self.ttft.labels(path), self.prompt_tokens.labels(path),
                                         self.output_tokens.labels(path), self.itl.labels(path),
                                         self.cached_tokens.labels(path))
                        for path in _PATHS}
        for path in _PATHS:
            self.migrations.labels(path)
        self._requests = {(route, outcome): self.requests.labels(route, mode, outcome)
                          for route in ROUTES for outcome in OUTCOMES}
        self.by_stage = {stage: self.stage.labels(stage) for stage in ("prefill", "kv_handoff", "decode")}
        for role in ROLES:
            self.retries.labels(role)
        for role in ROLES:
            for reason in ROUTING_REASONS:
                self.routing_decisions.labels(role, reason)
        for way in KV_CLEANUP_WAYS:
            self.kv_cleanups.labels(way)
        for code in ErrorCode.keys():
            self.engine_errors.labels(code)

    def key_usage(self, name: str) -> KeyUsage:
        """The series of one API key name, created at 0."""
        return KeyUsage(self.key_requests.labels(name), self.key_prompt_tokens.labels(name),
                        self.key_cached_tokens.labels(name), self.key_completion_tokens.labels(name),
                        {code: self.key_rejections.labels(name, code) for code in KEY_LIMIT_CODES})

    def request_done(self, route: str, outcome: str) -> None:
        self._requests[route, outcome].inc()

    def token_meter(self, path: str) -> TokenMeter:
        """The token counter and ITL histogram of one stream served by `path`."""
        series = self.by_path[path]
        return TokenMeter(series.output_tokens, series.itl)

    def forget_worker(self, worker: str) -> None:
        """`worker` (its address) left the pool: its per-worker series go, so that a fleet that churns does not
        grow /metrics without bound nor show workers that are gone. In multiprocess mode prometheus_client
        cannot delete a value already written to this process's file: its gauges read 0 instead (a worker
        that does not exist holds no blocks), its counters stay until the process exits."""
        if self._multiprocess:
            self.kv_index_blocks.labels(worker).set(0)
            for mode in KV_INDEX_MODES:
                self.kv_index_mode.labels(worker, mode).set(0)
            return
        series = [(self.kv_index_blocks, (worker,)), (self.routing_prompt_blocks, (worker,)),
                  (self.routing_cached_blocks, (worker,)), (self.health_checks_late, (worker,)),
                  *((self.kv_events_refused, (worker, reason)) for reason in KV_REFUSALS),
                  *((self.kv_index_mode, (worker, mode)) for mode in KV_INDEX_MODES)]
        for metric, labels in series:
            # A series never created (a worker never routed to) is no error; prometheus_client before 0.22 raised
            # KeyError for it, which here would end the pool's task.
            with contextlib.suppress(KeyError):
                metric.remove(*labels)

    def render(self) -> bytes:
        return generate_latest(self._rendered)


@attrs.frozen
class PathSeries:
    """The series of one serving path (aggregated / disaggregated / local)."""

    ttft: Any
    prompt_tokens: Any
    output_tokens: Any
    itl: Any
    cached_tokens: Any


@attrs.frozen
class KeyUsage:
    """The series of one API key name."""

    requests: Any
    prompt_tokens: Any
    cached_tokens: Any
    completion_tokens: Any
    rejections: dict  # by the 429's error code (frontend/limits.py)

    def answered(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        if cached_tokens:
            self.cached_tokens.inc(cached_tokens)


class TokenMeter:
    """One stream's streamed-token count and inter-token latencies, added to the shared series every
    FLUSH_TOKENS tokens and when the stream ends (flush()).

    Why: per token, prometheus_client takes a lock for the counter, the histogram sum and its bucket;
    here a token costs a bisect and two additions, and the shared series lag by at most FLUSH_TOKENS
    tokens of each stream in flight. A gap before k tokens that arrived together counts k times as gap/k;
    the first tokens of a stream count with a gap of 0 after the first (whose wait is the TTFT).
    """

    FLUSH_TOKENS = 32
    __slots__ = ("_counter", "_itl", "_bounds", "_counts", "_sum", "_tokens", "_batched")

    def __init__(self, counter, itl) -> None:
        self._counter, self._itl = counter, itl
        # prometheus_client's histogram keeps one value per bucket (not cumulative) and its sum; adding
        # counts to them is what observe() does one at a time. If a release changes that, observe() it is.
        self._batched = all(hasattr(itl, name) for name in ("_upper_bounds", "_buckets", "_sum"))
        self._bounds = itl._upper_bounds if self._batched else ()
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._tokens = 0

    def add(self, gap: float | None, tokens: int) -> None:
        """`tokens` arrived together, `gap` seconds after the previous ones (None: the first of the stream)."""
        value, count = (0.0, tokens - 1) if gap is None else (gap / tokens, tokens)
        if count > 0:
            if self._batched:
                self._counts[bisect.bisect_left(self._bounds, value)] += count
                self._sum += value * count
            else:
                for _ in range(count):
                    self._itl.observe(value)
        self._tokens += tokens
        if self._tokens >= self.FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        if self._tokens:
            self._counter.inc(self._tokens)
            self._tokens = 0
        counts = self._counts
        for index, count in enumerate(counts):
            if count:
                self._itl._buckets[index].inc(count)
                counts[index] = 0
        if self._sum:
            self._itl._sum.inc(self._sum)
            self._sum = 0.0


_LIVE_FILE = re.compile(r"gauge_livesum_(\d+)\.db")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class FrontendProcesses:
    """CPU and memory of every live frontend process, summed (what ProcessCollector reports for one).

    A process is live while its `livesum` gauge file exists: every process writes one (in-flight), and
    the first process removes a child's with `mark_process_dead` when the child exits.
    """

    def __init__(self, multiprocess_dir: str) -> None:
        self.dir = Path(multiprocess_dir)

    def live_pids(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _LIVE_FILE.fullmatch(p.name)))

    def collect(self):
        cpu = rss = 0.0
        count = 0
        for pid in self.live_pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # ended between the listing and now
                continue
            count += 1
            cpu += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
            rss += int(fields[21]) * _PAGE_SIZE
        yield CounterMetricFamily("process_cpu_seconds", "User and system CPU of the frontend processes, summed",
                                  value=cpu)
        yield GaugeMetricFamily("process_resident_memory_bytes", "Resident memory of the frontend processes, summed",
                                value=rss)
        yield GaugeMetricFamily("orchestrator_frontend_processes", "Live frontend processes behind the port",
                                value=count)
