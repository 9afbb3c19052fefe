"""`orchestrator serve -c CONFIG`: the HTTP frontend, the worker pool and the coordinator, on trio."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import shutil
import signal
import sys
import tempfile
import urllib.parse
from collections.abc import Callable
from functools import partial
from pathlib import Path

import attrs
import trio

from orchestrator import config as config_module
from orchestrator.config import Config, ConfigError
from orchestrator.frontend.descriptors import connection_cap, open_files_limit, raise_open_files_limit
from orchestrator.frontend.multiprocess import FrontendChildren, FrontendProcess, ParentWatch
from orchestrator.processes import orchestrator_command

log = logging.getLogger("orchestrator.serve")
# After the shutdown grace, the requests still running are ended with a 503 or a final SSE error event
# (App.cut_in_flight); this is how long they get to write it before the HTTP server closes their connections.
LAST_WORDS_S = 2.0
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode reads it at import


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run the orchestrator (OpenAI-compatible HTTP API)",
                              description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and "
                                          "/metrics. Prints 'ready http://HOST:PORT' once serving.")
    p.add_argument("-c", "--config", type=Path, required=True, help="the YAML config file (docs/configuration.md)")
    p.add_argument("--host", default=None, help="override http.host")
    p.add_argument("--port", type=int, default=None, help="override http.port (0: a free port)")
    p.add_argument("--worker", action="append", default=[], metavar="ROLE=grpc://HOST:PORT",
                   help="replace the static worker list of ROLE (repeatable); used by `orchestrator launch`")
    p.add_argument("--etcd-endpoint", action="append", default=[], metavar="URL",
                   help="replace discovery.etcd.endpoints (repeatable); used by `orchestrator launch`")
    # Set by frontend 0 on the copies it starts (http.processes); not for operators.
    p.add_argument("--frontend-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--frontend-parent", type=int, default=None, help=argparse.SUPPRESS)
    # The flag that sets the port of whoever started us (`orchestrator launch`: --http-port), for the busy-port hint.
    p.add_argument("--port-flag", default="--port", help=argparse.SUPPRESS)
    p.set_defaults(run=run)


def apply_etcd_overrides(config: Config, endpoints: list[str]) -> Config:
    if not endpoints:
        return config
    if config.discovery.etcd is None:
        raise ConfigError("--etcd-endpoint", "discovery.etcd", "an etcd discovery section in the config")
    etcd = attrs.evolve(config.discovery.etcd, endpoints=tuple(endpoints))
    return attrs.evolve(config, discovery=config_module.DiscoveryConfig(etcd=etcd))


def apply_worker_overrides(config: Config, overrides: list[str]) -> Config:
    if not overrides:
        return config
    lists: dict[str, list[str]] = {}
    for item in overrides:
        role, sep, address = item.partition("=")
        if not sep or role not in config_module.ROLES or not address.startswith("grpc://"):
            raise ConfigError("--worker", item, "ROLE=grpc://HOST:PORT with ROLE aggregated, prefill or decode")
        lists.setdefault(role, []).append(address)
    static = config.discovery.static or config_module.StaticDiscovery()
    static = attrs.evolve(static, **{role: tuple(addresses) for role, addresses in lists.items()})
    return attrs.evolve(config, discovery=config_module.DiscoveryConfig(static=static))


def worker_tls(config: Config):
    """The TLS settings of every worker connection (None: plaintext h2c, TensorRT-LLM's default)."""
    if config.workers_tls is None:
        return None
    return config.workers_tls.tls(config.base_dir, config.source)


def make_registry(config: Config, loop_thread):
    if config.discovery.etcd is not None:
        from orchestrator.discovery.etcd import EtcdRegistry
        etcd = config.discovery.etcd
        return EtcdRegistry(etcd.endpoints, etcd.namespace, model=config.model.name, loop_thread=loop_thread,
                            tls=etcd.tls(config.base_dir, config.source))
    from orchestrator.discovery.static import StaticRegistry

    static = config.discovery.static
    if static is None:
        raise ValueError("the config has neither discovery.etcd nor discovery.static")  # load() refuses that
    return StaticRegistry({"aggregated": static.aggregated, "prefill": static.prefill, "decode": static.decode},
                          model=config.model.name)


async def serve(config: Config, *, host: str, port: int, ready_line: bool = True, handle_signals: bool = True,
                frontend: FrontendProcess = FrontendProcess(),
                child_argv: Callable[[int, int], list[str]] | None = None,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve until SIGTERM/SIGINT (when `handle_signals`) or until the caller cancels.

    With `frontend.count` > 1 this is one of several frontend processes on the port (see
    orchestrator/frontend/multiprocess.py); frontend 0 starts the others with `child_argv(index, port)`.
    """
    from orchestrator import tracing
    from orchestrator.engine import LoopThread
    from orchestrator.flow.coordinator import Coordinator
    from orchestrator.frontend import memory
    from orchestrator.frontend.app import App
    from orchestrator.frontend.auth import load_api_keys
    from orchestrator.metrics import Metrics
    from orchestrator.tokenizer import ModelTokenizer
    from orchestrator.workers.kv_routing import kv_routing
    from orchestrator.workers.pool import WorkerPool

    memory.use_mmap_for_big_blocks()  # a 20 MB body's memory goes back to the OS when it is freed
    tokenizer = ModelTokenizer.from_dir(config.model_dir)
    several = frontend.count > 1
    metrics = Metrics(config.mode, multiprocess_dir=os.environ[METRICS_DIR_ENV] if several else None)
    limits = config.limits
    tracer = tracing.from_config(config)
    async with LoopThread.open() as loop_thread, tracer.running():
        kv = kv_routing(config, metrics)
        try:
            pool = WorkerPool(loop_thread=loop_thread, metrics=metrics, routing=config.routing, model=config.model.name,
                              health_interval=limits.health_interval_s, discovery_timeout=limits.discovery_timeout_s,
                              removal_grace=limits.shutdown_grace_s, tls=worker_tls(config),
                              stream_transport=config.stream_transport, keepalive=config.keepalive,
                              kv=kv)
            api_keys = load_api_keys(config.auth, file=config.source, base_dir=config.base_dir)
            app = App(config, Coordinator(config, pool, tokenizer, metrics), pool, metrics, api_keys, frontend=frontend,
                      tracer=tracer)
            shutdown = trio.Event()
            children = None
            # A signal during start-up (etcd unreachable, workers still loading) ends the start-up at once.
            startup = trio.CancelScope()
            async with trio.open_nursery() as nursery:
                if handle_signals:
                    nursery.start_soon(_on_signal, app, shutdown, startup)
                url = None
                with startup:
                    await nursery.start(pool.run, make_registry(config, loop_thread))
                    url = await nursery.start(serve_http, app, config, host, port, shutdown, several)
                    log.info("serving %s mode on %s (model %s)%s", config.mode, url, config.model.name,
                             f", frontend process {frontend.index} of {frontend.count}" if several else "")
                    if several and frontend.is_first and child_argv is not None:
                        from prometheus_client.multiprocess import mark_process_dead

                        bound_port = urllib.parse.urlsplit(url).port
                        children = FrontendChildren(
                            frontend.count, lambda index: child_argv(index, bound_port),
                            ready_timeout=limits.worker_startup_timeout_s + 60,
                            stop_timeout=limits.shutdown_grace_s + 10,
                            on_exit=lambda pid: mark_process_dead(pid, os.environ[METRICS_DIR_ENV]))
                        await nursery.start(children.run, shutdown)
                    elif frontend.parent_pid is not None:
                        nursery.start_soon(ParentWatch(frontend.parent_pid, partial(_drain, app, shutdown)).run)
                    with trio.move_on_after(limits.worker_startup_timeout_s) as waiting:
                        while not all(pool.ready_count(role) for role in config.needed_roles):
                            await pool.changed.wait()
                    if waiting.cancelled_caught:
                        log.error("no ready worker for every role of %s mode after %.0f s; serving anyway, "
                                  "/health says not ready", config.mode, limits.worker_startup_timeout_s)
                if startup.cancelled_caught:
                    log.info("stopped during start-up")
                    nursery.cancel_scope.cancel()
                    return
                if ready_line:
                    print(f"ready {url}", flush=True)
                task_status.started(url)
                await shutdown.wait()
                # The HTTP server stops accepting and lets in-flight requests finish for the shutdown grace; those
                # still running then are ended with a 503 or a final SSE error event (their nurseries abort the
                # engine work), and LAST_WORDS_S later the server closes what is left; then the pool goes. The
                # other frontend processes drain at the same time (SIGTERM from FrontendChildren).
                await _finish_in_flight(app, limits.shutdown_grace_s)
                if children is not None:
                    await children.stopped.wait()
                nursery.cancel_scope.cancel()
        finally:
            if kv is not None and kv.feed is not None:
                kv.feed.close()  # after the pool, which ran its follow tasks; also when start-up failed
    log.info("stopped")


async def _finish_in_flight(app, grace_s: float) -> None:
    with trio.move_on_after(grace_s):
        await app.in_flight.wait_until_none()
    if len(app.in_flight) > 0:
        cut = app.cut_in_flight()
        log.warning("shutdown grace of %g s is over: ending the %d requests still running with a 503 (or a final "
                    "error event on a started stream)", grace_s, cut)
        with trio.move_on_after(LAST_WORDS_S):
            await app.in_flight.wait_until_none()


async def serve_http(app, config: Config, host: str, port: int, shutdown: trio.Event, reuse_port: bool = False,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The HTTP server (orchestrator/frontend/http_server.py), serving `app` until `shutdown`; started with its
    URL. `reuse_port`: the port is shared with the other frontend processes (SO_REUSEPORT)."""
    http = config.http
    from orchestrator.frontend.http_server import ServerLimits, open_listener
    from orchestrator.frontend.http_server import serve_http as serve_native

    tls = http.tls(config.base_dir, config.source)
    ssl_context = None if tls is None else tls.server_context(["http/1.1"])  # HTTPS
    limits = ServerLimits(keep_alive_s=http.keep_alive_s, max_header_bytes=http.max_header_bytes,
                          grace_s=config.limits.shutdown_grace_s + LAST_WORDS_S,
                          max_connections=connection_cap(http.max_connections, open_files_limit()))
    listener = await open_listener(host, port, backlog=http.backlog, reuse_port=reuse_port)
    await serve_native(app, listener, limits=limits, shutdown=shutdown, ssl_context=ssl_context,
                       task_status=task_status)


async def _on_signal(app, shutdown: trio.Event, startup: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("%s: draining (grace %.0f s)", signal.Signals(signum).name, app.config.limits.shutdown_grace_s)
            _drain(app, shutdown)
            startup.cancel()  # a no-op once start-up is over
            return


def _drain(app, shutdown: trio.Event) -> None:
    app.draining = True
    shutdown.set()


def run(args: argparse.Namespace) -> int:
    try:
        config = apply_etcd_overrides(apply_worker_overrides(config_module.load(args.config), args.worker),
                                      args.etcd_endpoint)
        from orchestrator.frontend.auth import load_api_keys

        keys = load_api_keys(config.auth, file=str(args.config), base_dir=config.base_dir)
        worker_tls(config)  # unreadable TLS files are a configuration error, before anything starts
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    host = args.host or config.http.host
    if not keys.enabled and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("no API keys are configured (auth: in %s) and the API listens on %s: anyone who can reach "
                    "the port can use it", args.config, host)
    port = config.http.port if args.port is None else args.port
    raise_open_files_limit()  # every client connection is a descriptor; the soft limit is often only 1,024
    count = config.http.processes
    frontend = FrontendProcess(index=args.frontend_index, count=count, parent_pid=args.frontend_parent)
    metrics_dir = None
    if count > 1 and frontend.is_first:
        # Before prometheus_client is first imported (inside serve): it picks file-backed values then.
        # The children inherit the variable, so every process writes under the same directory.
        if "prometheus_client" in sys.modules:
            raise RuntimeError("prometheus_client was imported before the metrics directory was set")
        metrics_dir = tempfile.mkdtemp(prefix="orch-metrics-")
        os.environ[METRICS_DIR_ENV] = metrics_dir
    elif count > 1 and (METRICS_DIR_ENV not in os.environ or args.frontend_parent is None):
        log.error("--frontend-index is for the frontend processes `orchestrator serve` starts itself")
        return 2

    def child_argv(index: int, bound_port: int) -> list[str]:
        overrides = [a for w in args.worker for a in ("--worker", w)]
        overrides += [a for e in args.etcd_endpoint for a in ("--etcd-endpoint", e)]
        return orchestrator_command("--log-level", args.log_level, "serve", "-c", str(args.config), "--host", host,
                                    "--port", str(bound_port), "--frontend-index", str(index),
                                    "--frontend-parent", str(os.getpid()), *overrides)

    try:
        trio.run(partial(serve, config, host=host, port=port, frontend=frontend, child_argv=child_argv))
    except (OSError, BaseExceptionGroup) as exc:
        busy = _address_in_use(exc)
        if busy is None:
            raise
        log.error("%s", busy_port_message(host, port, busy, args.port_flag, args.config))
        return 2
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
        elif count > 1 and os.getppid() != args.frontend_parent:  # frontend 0 was killed: it cannot clean up
            from orchestrator.frontend.multiprocess import leave_metrics_dir

            leave_metrics_dir(os.environ[METRICS_DIR_ENV])
    return 0


def busy_port_message(host: str, port: int, error: OSError, flag: str, config_path) -> str:
    return (f"cannot listen on {host}:{port}: {error.strerror or error}; choose another with {flag} or http.port in "
            f"{config_path}")


def _address_in_use(exc: BaseException) -> OSError | None:
    """The EADDRINUSE inside what the listener's bind raised (possibly wrapped in exception groups)."""
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _address_in_use(inner)
            if found is not None:
                return found
    return None
