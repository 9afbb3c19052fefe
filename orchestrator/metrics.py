"""Prometheus metrics of one orchestrator process (its own registry, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("orchestrator_requests", "Requests by route, mode and outcome",
                                ["route", "mode", "outcome"], registry=r)
        self.ttft = Histogram("orchestrator_time_to_first_token_seconds", "Time to first token", ["mode"],
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("orchestrator_inter_token_latency_seconds", "Time between streamed chunks",
                             ["mode"], buckets=_LATENCY, registry=r)
        self.stage = Histogram("orchestrator_stage_duration_seconds",
                               "Stage durations: prefill, kv_handoff (prefill ready -> first decode token), decode",
                               ["stage"], buckets=_LATENCY, registry=r)
        self.inflight = Gauge("orchestrator_requests_in_flight", "Requests being served (queue depth)", registry=r)
        self.workers = Gauge("orchestrator_workers", "Workers in the pool by role and state", ["role", "state"],
                             registry=r)
        self.engine_errors = Counter("orchestrator_engine_errors", "Engine errors by code", ["code"], registry=r)
        self.retries = Counter("orchestrator_retries", "Legs retried on another worker of the same role, by role",
                               ["role"], registry=r)
        self.kv_cleanups = Counter("orchestrator_kv_cleanups", "KV sessions released after a cancellation, by way",
                                   ["way"], registry=r)
        self.migrations = Counter("orchestrator_migrations", "Requests continued on another worker after a worker "
                                  "failed mid-stream (prompt + tokens sent), by mode", ["mode"], registry=r)
        for mode in ("aggregated", "disaggregated", "local"):
            self.migrations.labels(mode)
        self.prefill_answers = Counter("orchestrator_prefill_answers",
                                       "Disaggregated requests answered by the context-only leg alone (its one token "
                                       "finished them: EOS or a stop)", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
