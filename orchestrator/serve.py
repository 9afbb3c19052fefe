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
    p.add_argument("--worker", action="append", default=[], metavar="[MODEL:]ROLE=grpc://HOST:PORT",
                   help="replace the static worker list of ROLE (repeatable; MODEL: which model's, required when the "
                        "config serves several); used by `orchestrator launch`")
    p.add_argument("--etcd-endpoint", action="append", default=[], metavar="URL",
                   help="replace discovery.etcd.endpoints (repeatable); used by `orchestrator launch`")
    # Set by frontend 0 on the copies it starts (http.processes); not for operators.
    p.add_argument("--frontend-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--frontend-parent", type=int, default=None, help=argparse.SUPPRESS)
    # The flag that sets the port of whoever started us (`orchestrator launch`: --http-port), for the busy-port hint.
    p.add_argument("--port-flag", default="--port", help=argparse.SUPPRESS)
    p.set_defaults(run=run)


def _each_model(config: Config, change: Callable[[Config], Config]) -> Config:
    """`change` applied to every model's view (and to the top level, which is the first model's)."""
    views = tuple(change(view) for view in config.models)
    return attrs.evolve(views[0], per_model=views) if config.per_model else views[0]


def apply_etcd_overrides(config: Config, endpoints: list[str]) -> Config:
    if not endpoints:
        return config
    if all(view.discovery.etcd is None for view in config.models):
        raise ConfigError("--etcd-endpoint", "discovery.etcd", "an etcd discovery section in the config")

    def override(view: Config) -> Config:
        if view.discovery.etcd is None:  # a model with static lists keeps them
            return view
        etcd = attrs.evolve(view.discovery.etcd, endpoints=tuple(endpoints))
        return attrs.evolve(view, discovery=config_module.DiscoveryConfig(etcd=etcd))

    return _each_model(config, override)


def apply_worker_overrides(config: Config, overrides: list[str]) -> Config:
    """`--worker [MODEL:]ROLE=URL`: the static worker lists of the models named (all of them replaced for a role
    given at least once); MODEL may be left out when the config serves one model."""
    if not overrides:
        return config
    several = len(config.models) > 1
    lists: dict[tuple[str, str], list[str]] = {}
    for item in overrides:
        left, sep, address = item.partition("=")
        model, colon, role = left.rpartition(":")
        view = next((v for v in config.models if model in v.model.names), None) if colon else config.models[0]
        if not sep or role not in config_module.ROLES or not address.startswith("grpc://") or view is None or \
                (several and not colon):
            served = ", ".join(v.model.name for v in config.models)
            raise ConfigError("--worker", item, f"{'MODEL:' if several else '[MODEL:]'}ROLE=grpc://HOST:PORT with ROLE "
                              f"aggregated, prefill or decode{' and MODEL one of ' + served if several else ''}")
        lists.setdefault((view.model.name, role), []).append(address)

    def override(view: Config) -> Config:
        mine = {role: tuple(addresses) for (model, role), addresses in lists.items() if model == view.model.name}
        if not mine:
            return view
        static = attrs.evolve(view.discovery.static or config_module.StaticDiscovery(), **mine)
        return attrs.evolve(view, discovery=config_module.DiscoveryConfig(static=static))

    return _each_model(config, override)


def worker_tls(config: Config):
    """The TLS settings of every worker connection (None: plaintext h2c, TensorRT-LLM's default)."""
    if config.workers_tls is None:
        return None
    return config.workers_tls.tls(config.base_dir, config.source)


def make_registry(config: Config, loop_thread, foreign=None):
    """The worker registry of one model's view; `foreign`: the etcd registries' shared ForeignModels."""
    if config.discovery.etcd is not None:
        from orchestrator.discovery.etcd import EtcdRegistry
        etcd = config.discovery.etcd
        return EtcdRegistry(etcd.endpoints, etcd.namespace, model=config.model.name, loop_thread=loop_thread,
                            tls=etcd.tls(config.base_dir, config.source), foreign=foreign)
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
    from orchestrator.discovery.etcd import ForeignModels
    from orchestrator.engine import LoopThread
    from orchestrator.frontend import memory
    from orchestrator.frontend.app import App
    from orchestrator.frontend.auth import load_api_keys
    from orchestrator.frontend.served_models import ServedModels
    from orchestrator.metrics import Metrics

    memory.use_mmap_for_big_blocks()  # a 20 MB body's memory goes back to the OS when it is freed
    several = frontend.count > 1
    # One registry for the process; each model's series are its view of it. This view (model "") counts the
    # requests that named no served model.
    metrics = Metrics("", model="", multiprocess_dir=os.environ[METRICS_DIR_ENV] if several else None)
    limits = config.limits  # the process's timeouts (start-up, shutdown grace): the top level's, the first model's
    tracer = tracing.from_config(config)
    deployments: list = []
    async with LoopThread.open() as loop_thread, tracer.running():
        try:
            tls = worker_tls(config)  # workers_tls is shared by every model: its files are read once
            for view in config.models:
                deployments.append(_deployment(view, metrics, loop_thread, tls))
            served = ServedModels(deployments)
            api_keys = load_api_keys(config.auth, file=config.source, base_dir=config.base_dir)
            app = App(config, served, metrics, api_keys, frontend=frontend, tracer=tracer)
            foreign = ForeignModels({view.model.name for view in config.models})  # (keys name models, not aliases)
            shutdown = trio.Event()
            children = None
            # A signal during start-up (etcd unreachable, workers still loading) ends the start-up at once.
            startup = trio.CancelScope()
            async with trio.open_nursery() as nursery:
                if handle_signals:
                    nursery.start_soon(_on_signal, app, shutdown, startup)
                url = None
                with startup:
                    for deployment in deployments:
                        await nursery.start(deployment.pool.run, make_registry(deployment.config, loop_thread,
                                                                               foreign))
                    url = await nursery.start(serve_http, app, config, host, port, shutdown, several)
                    for view in config.models:
                        log.info("serving %s mode on %s (model %s)%s", view.mode, url, view.model.name,
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
                    await _wait_for_workers(deployments, limits.worker_startup_timeout_s)
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
            for deployment in deployments:  # after the pools, which ran their follow tasks; also when start-up failed
                kv = deployment.pool.kv
                if kv is not None and kv.feed is not None:
                    kv.feed.close()
    log.info("stopped")


def _deployment(view: Config, metrics, loop_thread, tls):
    """One served model: its tokenizer, KV routing, pool, coordinator and output parsers, and its metrics view."""
    from orchestrator.flow.coordinator import Coordinator
    from orchestrator.frontend.chat_output import OutputParsers
    from orchestrator.frontend.served_models import Deployment
    from orchestrator.tokenizer import ModelTokenizer
    from orchestrator.workers.kv_routing import kv_routing
    from orchestrator.workers.pool import WorkerPool

    model = view.model
    tokenizer = ModelTokenizer.from_dir(view.model_dir)
    own_metrics = metrics.for_model(model.name, view.mode)
    limits = view.limits
    pool = WorkerPool(loop_thread=loop_thread, metrics=own_metrics, routing=view.routing, model=model.name,
                      health_interval=limits.health_interval_s, discovery_timeout=limits.discovery_timeout_s,
                      removal_grace=limits.shutdown_grace_s, tls=tls,
                      stream_transport=view.stream_transport, keepalive=view.keepalive,
                      kv=kv_routing(view, own_metrics))
    return Deployment(view, Coordinator(view, pool, tokenizer, own_metrics), pool,
                      OutputParsers(model.tool_call_parser, model.reasoning_parser), own_metrics)


async def _wait_for_workers(deployments: list, timeout_s: float) -> None:
    """Until every model has a ready worker for each role its mode needs, or `timeout_s`: then it serves anyway
    (/health says which model is not ready) and a model without workers answers 503 alone."""
    with trio.move_on_after(timeout_s):
        for deployment in deployments:
            while not all(deployment.ready_workers().values()):
                await deployment.pool.changed.wait()
        return
    waiting = [f"{d.name} ({d.config.mode} mode)" for d in deployments if not all(d.ready_workers().values())]
    log.error("no ready worker for every role of %s after %.0f s; serving anyway, /health says not ready",
              ", ".join(waiting), timeout_s)


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
