"""`orchestrator register`: the sidecar that announces one worker in etcd.

    orchestrator register --etcd http://127.0.0.1:2379 --worker grpc://127.0.0.1:50051 --role decode

It waits for the worker (connect-until-ready), refuses a worker whose ServerInfo role (or model)
differs from what it was told, then keeps it registered under a lease while its health is READY or
DEGRADED, withdraws it at once when it turns unhealthy (NOT_READY: also how a draining worker says it),
and revokes the lease on SIGTERM (the lease rules are discovery/lease_keeper.py's). Prints `ready KEY`
once registered.
"""

from __future__ import annotations

import argparse
import logging
import signal
import uuid
from functools import partial

import trio

from orchestrator.discovery import keys
from orchestrator.discovery.lease_keeper import LeaseKeeper
from orchestrator.discovery.snapshots import WorkerSpec

log = logging.getLogger("orchestrator.register")
HEALTH_POLL_S = 0.25


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("register", help="announce a worker in etcd (sidecar beside a TRT-LLM worker)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--etcd", required=True, help="etcd URL, e.g. http://127.0.0.1:2379 (https://: TLS)")
    p.add_argument("--etcd-ca", default=None, metavar="PEM", help="CA that signed etcd's certificate (TLS)")
    p.add_argument("--etcd-cert", default=None, metavar="PEM", help="our client certificate for etcd (mTLS)")
    p.add_argument("--etcd-key", default=None, metavar="PEM", help="the key of --etcd-cert")
    p.add_argument("--worker", required=True, help="the worker's gRPC address, grpc://HOST:PORT")
    p.add_argument("--advertise", default=None, help="address to publish (default: --worker)")
    p.add_argument("--role", required=True, choices=keys.ROLES, help="the role to register it under")
    p.add_argument("--model", default=None, help="expected served model (default: the worker's first)")
    p.add_argument("--namespace", "--etcd-namespace", dest="namespace", default="orchestrator",
                   help="the key prefix the orchestrator watches (discovery.etcd.namespace)")
    p.add_argument("--ttl", type=int, default=10, help="lease TTL in seconds (keep-alive every TTL/3)")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds to wait for the worker to become ready")
    p.set_defaults(run=run)


def etcd_tls(args: argparse.Namespace):
    """TLS to etcd from the --etcd-* flags (None: plaintext, unless --etcd says https://)."""
    from orchestrator.tls import TlsMaterial, UnreadableTlsFile

    if args.etcd_ca is None and args.etcd_cert is None and args.etcd_key is None:
        return None
    if (args.etcd_cert is None) != (args.etcd_key is None):
        raise SystemExit("orchestrator register: --etcd-cert and --etcd-key go together")
    try:
        return TlsMaterial.read(args.etcd_ca, args.etcd_cert, args.etcd_key)
    except UnreadableTlsFile as exc:
        raise SystemExit(f"orchestrator register: cannot read {exc.filename}: {exc.strerror}") from exc


async def register(args: argparse.Namespace) -> int:
    from orchestrator.engine import EngineClient, EngineError, LoopThread

    async with LoopThread.open() as loop_thread, EngineClient.open(args.worker, loop_thread) as client:
        try:
            caps = await client.wait_until_ready(deadline=args.startup_timeout)
        except EngineError as exc:
            log.error("worker %s never became ready: %s", args.worker, exc)
            return 1
        if not caps.serves_role(args.role):  # UNSPECIFIED (real TRT-LLM) serves any role
            log.error("refusing to register %s as %s: its ServerInfo.engine_role is %s", args.worker, args.role,
                      caps.role)
            return 2
        model = args.model or (caps.models[0] if caps.models else caps.model_id)
        if args.model and args.model not in caps.models and args.model != caps.model_id:
            log.error("refusing to register %s for model %s: it serves %s", args.worker, args.model,
                      ", ".join(caps.models) or caps.model_id)
            return 2
        instance_id = caps.instance_id or f"{args.role}-{uuid.uuid4().hex[:8]}"
        spec = WorkerSpec(address=args.advertise or args.worker, role=args.role, model=model, instance_id=instance_id)
        key = keys.worker_key(args.namespace, model, args.role, instance_id)
        healthy = {"now": True}
        registration = LeaseKeeper(args.etcd, key, keys.worker_value(spec, schema_revision=caps.schema_revision),
                                   ttl=args.ttl, is_healthy=lambda: healthy["now"], tls=etcd_tls(args))

        async def watch_health() -> None:
            while True:
                try:
                    state = await client.health(timeout=2.0)
                    healthy["now"] = state.serving
                except EngineError:
                    healthy["now"] = False
                await trio.sleep(HEALTH_POLL_S)

        async def announce_ready() -> None:
            while not registration.registered:
                await trio.sleep(0.05)
            print(f"ready {key}", flush=True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_health)
            nursery.start_soon(announce_ready)
            nursery.start_soon(_stop_on_signal, nursery.cancel_scope)
            # The registration runs on the asyncio thread; cancelling this task cancels it there,
            # and its `finally` revokes the lease.
            await loop_thread.run(registration.run)
    return 0


async def _stop_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("%s: withdrawing and exiting", signal.Signals(signum).name)
            scope.cancel()
            return


def run(args: argparse.Namespace) -> int:
    return trio.run(partial(register, args))
