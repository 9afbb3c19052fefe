"""`orchestrator check-config FILE`: load a config and say what is wrong, or what it describes."""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator import config as config_module
from orchestrator.launch import check_sim_workers


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("check-config", help="validate a config file (names the key on error)")
    p.add_argument("config", type=Path, nargs="+")
    p.add_argument("--no-path-checks", action="store_true",
                   help="skip checks of paths that exist only on the target host (model.dir)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    status = 0
    for path in args.config:
        try:
            config = config_module.load(path, check_paths=not args.no_path_checks)
            check_sim_workers(config, str(path))
            problem = config_module.serving_problem(config, str(path))
            if problem is not None:
                raise problem
        except config_module.ConfigError as exc:
            print(f"error: {exc}")
            status = 1
            continue
        discovery = "etcd" if config.discovery.etcd is not None else "static"
        workers = sum(w.count for w in config.launch.workers)
        print(f"ok: {path}: {config.mode} mode, model {config.model.name} ({config.model_dir}), {discovery} "
              f"discovery, {workers} launched workers")
    return status
