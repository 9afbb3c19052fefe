"""`orchestrator bench run`, `compare`, `plan`, `reuse` and `trace`."""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="load generator and agg-vs-disagg comparison")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    run = sub.add_parser("run", help="run a workload against an OpenAI-compatible endpoint",
                         formatter_class=_DefaultsHelp,
                         description="Send seeded chat requests (prompts built with the model's tokenizer) at each "
                                     "concurrency or Poisson rate, stream the answers, and report TTFT, TPOT, ITL, "
                                     "E2E, throughput, tokens/s per user and per GPU, goodput under the SLO and "
                                     "errors by kind. Exits 1 when any request failed.")
    run.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    run.add_argument("--model", default="tiny-chat", help="the model name the requests ask for")
    run.add_argument("--model-dir", default="builtin:tiny-chat", help="tokenizer used to build prompts")
    run.add_argument("--input-len", default="512", help="prompt tokens per request, N or LOW:HIGH (uniform), counted "
                     "before the chat template: the server's prompt_tokens add the template's own tokens")
    run.add_argument("--output-len", default="128", help="max_tokens per request (with ignore_eos), N or LOW:HIGH "
                     "(uniform)")
    run.add_argument("--concurrency", type=int, nargs="*", default=[], help="concurrency sweep")
    run.add_argument("--rate", type=float, nargs="*", default=[], help="Poisson request-rate sweep (req/s)")
    run.add_argument("--requests", type=int, default=32, help="recorded requests per load point")
    run.add_argument("--warmup", type=int, default=2, help="requests sent before each load point and not recorded")
    run.add_argument("--image-share", type=float, default=0.0, help="fraction of requests (0 to 1) with an image")
    run.add_argument("--seed", type=int, default=0, help="seed of the prompts, lengths and image choices")
    run.add_argument("--gpus", type=int, default=1, help="GPU count of the topology, for tokens/s per GPU")
    run.add_argument("--slo-ttft", type=float, default=None, help="goodput bound on TTFT (s)")
    run.add_argument("--slo-tpot", type=float, default=None, help="goodput bound on TPOT (s)")
    run.add_argument("--time-scale", type=float, default=1.0, help="the simulated workers' time scale: figures are "
                     "converted to GPU time (without --baseline-url the orchestrator's own time is scaled too)")
    run.add_argument("--baseline-url", default=None, metavar="URL", help="the same topology on workers at time "
                     "scale 0: the workload runs there first, one request at a time, to measure the time that "
                     "--time-scale leaves unscaled (the orchestrator's and the client's own)")
    run.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    run.add_argument("--label", default="", help="names the results in the output (default: the URL)")
    run.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    run.set_defaults(run=run_command)
    compare = sub.add_parser("compare", help="the same workload on several topologies; writes a report",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    compare.add_argument("file", type=Path, help="e.g. configs/bench/agg-vs-disagg.yaml")
    compare.add_argument("--out", type=Path, default=Path("results/bench"),
                         help="the directory for results.json, report.md and each launcher's log")
    compare.set_defaults(run=compare_command)
    plan = sub.add_parser("plan", help="rank every topology of a GPU budget for a workload and SLO (virtual clock)",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    plan.add_argument("file", type=Path, help="e.g. configs/bench/plan-8gpu.yaml")
    plan.add_argument("--out", type=Path, default=Path("results/plan"), help="the directory for the report")
    plan.add_argument("--aiconfigurator", default=None, metavar="PYTHON",
                      help="an interpreter that can import aiconfigurator: its recommendation goes in the report")
    plan.set_defaults(run=plan_command)
    reuse = sub.add_parser("reuse", help="prefix-cache hit rates and TTFT by turn for conversations and shared "
                                         "system prompts, per topology and routing policy (virtual clock)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    reuse.add_argument("file", type=Path, help="e.g. configs/bench/reuse.yaml")
    reuse.add_argument("--out", type=Path, default=None, help="also write results.json and report.md here")
    reuse.set_defaults(run=reuse_command)
    trace = sub.add_parser("trace", help="replay a Mooncake-format trace in real time; TTFT, ITL, cache hits "
                                         "against an infinite-cache oracle (docs/kv-routing.md)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    trace.add_argument("file", type=Path, help="JSONL: timestamp (ms), input_length, output_length, hash_ids, "
                                               "optionally session_id (benchmarks/traces/ has one)")
    trace.add_argument("--url", required=True, help="the deployment's base URL, e.g. http://127.0.0.1:8000")
    trace.add_argument("--label", default="", help="names this run in the report (e.g. the routing policy)")
    trace.add_argument("--model", default="tiny-chat", help="the model name the replayed requests ask for")
    trace.add_argument("--block-size", type=int, default=512, help="tokens per hash id in the trace")
    trace.add_argument("--time-scale", type=float, default=1.0, help="multiplies the gaps between requests")
    trace.add_argument("--length-scale", type=float, default=1.0,
                       help="multiplies input and output lengths and the block size")
    trace.add_argument("--sample", type=float, default=1.0, help="fraction of the conversations replayed, whole")
    trace.add_argument("--seed", type=int, default=0, help="seed of the conversation sample")
    trace.add_argument("--limit", type=int, default=None, help="replay at most this many requests")
    trace.add_argument("--out", type=Path, default=Path("results/trace"),
                       help="runs.jsonl (one line per run, appended), report.md and ttft.png over all runs")
    trace.set_defaults(run=trace_command)
    bench.set_defaults(run=lambda args: bench.print_help() or 2)


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Every default in --help, except where the help already says what the default is."""

    def _get_help_string(self, action):
        if action.required or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def run_command(args: argparse.Namespace) -> int:
    import trio

    from orchestrator.bench.loadgen import Range, Workload, load_tokenizer, sweep

    if not args.concurrency and not args.rate:
        print("error: give --concurrency and/or --rate", file=sys.stderr)
        return 2
    workload = Workload(model=args.model, input_len=Range.parse(args.input_len),
                        output_len=Range.parse(args.output_len),
                        requests=args.requests, warmup=args.warmup, image_share=args.image_share, seed=args.seed,
                        timeout_s=args.timeout)
    tokenizer = load_tokenizer(args.model_dir)
    points = trio.run(partial(sweep, args.url, workload, tokenizer, concurrency=args.concurrency, rates=args.rate,
                              gpus=args.gpus, slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot,
                              time_scale=args.time_scale, label=args.label, baseline_url=args.baseline_url))
    for p in points:
        head = f"{args.label or args.url} {p['load_kind']}={p['load']:g}"
        if p["completed"] == 0:  # no figure means anything: say what the server said instead
            print(f"{head}: no request completed")
        else:
            print(f"{head}: TTFT p50 {p['ttft_s']['p50'] * 1e3:.1f} ms, TPOT p50 {p['tpot_s']['p50'] * 1e3:.2f} ms, "
                  f"{p['output_tokens_per_s']:.0f} tok/s, {p['tokens_per_s_per_user']:.1f} tok/s/user, "
                  f"goodput {p['goodput']:.2f} req/s, errors {sum(p['errors'].values())}")
        for kind, count in sorted(p["errors"].items()):
            print(f"{head}: {count} x {kind}: {p['error_messages'].get(kind, '(no message)')}")
    if args.out is not None:
        args.out.write_text(json.dumps({"url": args.url, "points": points}, indent=2) + "\n")
    failed = {kind: 0 for p in points for kind in p["errors"]}
    for p in points:
        for kind, count in p["errors"].items():
            failed[kind] += count
    if failed:
        total = sum(p["requests"] for p in points)
        print(f"error: {sum(failed.values())} of {total} requests failed ("
              + ", ".join(f"{kind}: {n}" for kind, n in sorted(failed.items())) + ")", file=sys.stderr)
        return 1
    return 0


def compare_command(args: argparse.Namespace) -> int:
    from orchestrator.bench.compare import main_compare

    return main_compare(args.file, args.out)


def plan_command(args: argparse.Namespace) -> int:
    from orchestrator.bench.plan import main_plan

    return main_plan(args.file, args.out, args.aiconfigurator)


def reuse_command(args: argparse.Namespace) -> int:
    from orchestrator.bench.reuse import main_reuse

    return main_reuse(args.file, args.out)


def trace_command(args: argparse.Namespace) -> int:
    from orchestrator.bench.trace import main_trace

    return main_trace(args.file, args.url, label=args.label, model=args.model, block_size=args.block_size,
                      time_scale=args.time_scale, length_scale=args.length_scale, sample=args.sample,
                      seed=args.seed, limit=args.limit, out=args.out)
