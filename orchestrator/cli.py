"""`orchestrator` command line: one subcommand per job, each in the module that owns it."""

from __future__ import annotations

import argparse
import os
import sys

from orchestrator import __version__, log

# Each module defines add_parser(subparsers); imports inside run() keep `--help` fast.
SUBCOMMAND_MODULES = ("orchestrator.sim.cli", "orchestrator.serve", "orchestrator.launch", "orchestrator.config_check",
                      "orchestrator.discovery.sidecar", "orchestrator.bench.cli")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _env_log_level() -> str:
    level = os.environ.get("ORCH_LOG_LEVEL", "INFO").upper()
    return level if level in LOG_LEVELS else "INFO"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchestrator", description="Disaggregated LLM serving on TensorRT-LLM "
                                     "OpenEngine v1 workers.")
    parser.add_argument("--version", action="version", version=f"orchestrator {__version__}")
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, metavar="{" + ",".join(LOG_LEVELS) + "}",
                        default=_env_log_level(), help="any case; default $ORCH_LOG_LEVEL or INFO")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMAND_MODULES:
        __import__(module, fromlist=["add_parser"]).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    log.configure(_env_log_level())  # logging works from the first line
    from orchestrator.processes import watch_lifeline

    watch_lifeline()  # started by `orchestrator launch`: exit with it, however it ends
    parser = build_parser()
    args = parser.parse_args(argv)
    log.configure(args.log_level)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    return args.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
