"""The orchestrator's own CPU per request and per streamed token, aggregated and disaggregated.

    python benchmarks/cpu_cost.py [--requests 256] [--concurrency 16] [--max-tokens 1 64 256] [--fit-rounds 4]

Simulated workers at zero GPU cost (--time-scale 0). For each mode and each max_tokens, the same
streamed requests go through `orchestrator serve` and its CPU time (its threads' run time in ns from
/proc/PID/task/*/schedstat, the same time utime + stime count in 10 ms ticks) is read before and after;
the CPU per request is fitted by least squares as a + b * tokens, in rounds where the max_tokens values take
turns (a and b are the medians of the rounds' fits; their range is printed), and so is the CPU of our gRPC client
reading the same streams alone, its tokens counted where they arrive as serve writes them (the floor: what
reading the streams costs without HTTP). The SSE events per streamed
token are counted on the wire. Then, at concurrency 64, streamed tokens/s through the orchestrator against
the same streams driven directly over gRPC (benchmarks/overhead.py's drivers), in interleaved rounds
against the same workers (medians), with who spent the CPU per token on each path (the workers, serve, this
process: our direct client or the HTTP load generator) and how many cores were busy: on a box that the
workers and the load generator share with serve, what 0.9 retained leaves serve per token is printed too.

The targets (issue 12) are printed beside the figures: a <= 1.0 ms aggregated / 1.3 ms
disaggregated, b <= 20 us per token with one event per token, c=64 retained fraction >= 0.9, idle
CPU <= 8 ms per second (measured first, with the default health interval).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

from orchestrator.engine import EngineClient, LoopThread
from orchestrator.testkit.processes import OrchestratorServers, SimWorkers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import Direct, ThroughOrchestrator, chat_prompt_ids, run_slots, start_deployment

TARGETS = {"aggregated": (1.0, 20.0), "disaggregated": (1.3, 20.0)}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _run_time(pid: int, fields: list[str]) -> float:
    """CPU seconds of one process: the sum of its threads' run time in ns from /proc/PID/task/*/schedstat
    (utime + stime come in 10 ms ticks: a 0.1 s measurement would be 10% quantisation); the ticks where
    schedstat is missing."""
    try:
        return sum(int((task / "schedstat").read_text().split()[0])
                   for task in Path(f"/proc/{pid}/task").iterdir()) / 1e9
    except (OSError, ValueError, IndexError):
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def cpu_seconds(pid: int) -> float:
    """CPU time of a process (its threads included) and of its children (the other frontend processes
    with http.processes > 1), from /proc."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = _stat(int(entry.name))
                if int(entry.name) == pid or int(fields[1]) == pid:
                    total += _run_time(int(entry.name), fields)
            except OSError:
                continue
    return total


def idle_cpu_ms_per_s(pid: int, seconds: float) -> float:
    """CPU the process spends with no request at all (health polls, timers), in ms per second."""
    time.sleep(1.0)  # past start-up
    before, start = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) * 1e3 / (time.monotonic() - start)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y over x."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    return mean_y - slope * mean_x, slope


async def cpu_points(url: str, pid: int, args) -> tuple[list[list[tuple[float, float]]], float]:
    """Per round, (tokens per request, CPU seconds per request) for each max_tokens; and SSE events per token.

    The max_tokens values take turns, `--fit-rounds` times: a machine whose speed drifts (a shared VM)
    then slows every point of a round alike instead of bending the line, and the rounds show the spread."""
    all_streams = [ThroughOrchestrator(url, max_tokens) for max_tokens in args.max_tokens]
    for streams in all_streams:
        await run_slots(args.concurrency, 2, streams)  # warm-up
        streams.events = streams.tokens = 0
    per_slot = max(1, args.requests // (args.concurrency * args.fit_rounds))
    requests = per_slot * args.concurrency
    rounds = []
    for _ in range(args.fit_rounds):
        points = []
        for streams in all_streams:
            tokens_before, cpu_before = streams.tokens, cpu_seconds(pid)
            await run_slots(args.concurrency, per_slot, streams)
            spent = cpu_seconds(pid) - cpu_before
            points.append(((streams.tokens - tokens_before) / requests, spent / requests))
        rounds.append(points)
    events, tokens = sum(s.events for s in all_streams), sum(s.tokens for s in all_streams)
    return rounds, events / max(tokens, 1)


def fit_rounds(rounds: list[list[tuple[float, float]]]) -> tuple[float, float, list[tuple[float, float]]]:
    """The median a and median b of the rounds' own fits, and those fits."""
    fits = [fit_line(points) for points in rounds]
    return statistics.median(a for a, _ in fits), statistics.median(b for _, b in fits), fits


async def direct_points(mode: str, addresses: dict[str, str], prompt_ids, args,
                        stream_transport: str = "grpcio") -> list[tuple[float, float]]:
    """The floor: the same streams read by our engine client alone, in this process, no HTTP at all.

    (tokens per request, CPU seconds per request) as this process's CPU time (all its threads: the
    grpc.aio loop thread and grpc's poller included). What any Python gRPC consumer pays per message.
    """
    points = []
    async with LoopThread.open() as loop_thread, contextlib.AsyncExitStack() as stack:
        clients = {role: await stack.enter_async_context(EngineClient.open(address, loop_thread,
                                                                           stream_transport=stream_transport))
                   for role, address in addresses.items()}
        for max_tokens in args.max_tokens:
            direct = Direct(clients, prompt_ids, max_tokens, mode)
            await run_slots(args.concurrency, 2, direct)  # warm-up
            per_slot = max(1, args.requests // args.concurrency)
            before = time.process_time()
            _, _, tokens = await run_slots(args.concurrency, per_slot, direct)
            requests = per_slot * args.concurrency
            points.append((tokens / requests, (time.process_time() - before) / requests))
    return points


class CpuSplit:
    """Who spent the CPU of one c=64 run, per streamed token: the workers, serve, and this process (our
    direct client on the direct path, the HTTP load generator through us), and how busy the box was."""

    ROLES = ("workers", "serve", "client")

    def __init__(self, worker_pids: list[int], serve_pid: int):
        self._pids = {"workers": worker_pids, "serve": [serve_pid]}

    def _now(self) -> dict[str, float]:
        now = {role: sum(cpu_seconds(pid) for pid in pids) for role, pids in self._pids.items()}
        now["client"] = time.process_time()  # this process's threads only, not its children
        return now

    async def run(self, one, per_slot: int) -> tuple[float, dict[str, float]]:
        """Runs `one` at c=64; returns (tokens/s, {role: us per token, "busy": cores busy on average})."""
        before = self._now()
        seconds, _, tokens = await run_slots(64, per_slot, one)
        after = self._now()
        split = {role: (after[role] - before[role]) * 1e6 / max(tokens, 1) for role in self.ROLES}
        split["busy"] = sum(after[role] - before[role] for role in self.ROLES) / seconds
        return tokens / seconds, split


async def retained_fraction(mode: str, addresses: dict[str, str], url: str, prompt_ids, args,
                            split: CpuSplit) -> tuple[float, float, dict[str, dict[str, float]]]:
    """Streamed tokens/s at c=64: direct over gRPC (our fastest client, h2 streams: the reference for every
    variant), then through the orchestrator; `--retained-rounds` times, interleaved, so that a slow moment
    of the machine hits both. Returns the median of each, and the median CPU split of each path."""
    async with LoopThread.open() as loop_thread, contextlib.AsyncExitStack() as stack:
        clients = {role: await stack.enter_async_context(EngineClient.open(address, loop_thread))
                   for role, address in addresses.items()}
        direct = Direct(clients, prompt_ids, args.retained_max_tokens, mode)
        through = ThroughOrchestrator(url, args.retained_max_tokens)
        await run_slots(8, 1, direct)  # warm-up both paths
        await run_slots(8, 1, through)
        rates: dict[str, list[float]] = {"direct": [], "through": []}
        splits: dict[str, list[dict[str, float]]] = {"direct": [], "through": []}
        for _ in range(args.retained_rounds):
            for name, one in (("direct", direct), ("through", through)):
                rate, cpu = await split.run(one, args.retained_per_slot)
                rates[name].append(rate)
                splits[name].append(cpu)
    medians = {name: {key: statistics.median(cpu[key] for cpu in runs) for key in runs[0]}
               for name, runs in splits.items()}
    return statistics.median(rates["direct"]), statistics.median(rates["through"]), medians


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256, help="streams per max_tokens value (default 256)")
    parser.add_argument("--fit-rounds", type=int, default=4,
                        help="rounds in which the max_tokens values take turns; a and b are the medians of the "
                             "rounds' fits (default 4)")
    parser.add_argument("--concurrency", type=int, default=16, help="for the CPU fit (default 16)")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--retained-max-tokens", type=int, default=64, help="for the c=64 comparison (default 64)")
    parser.add_argument("--retained-per-slot", type=int, default=8, help="streams per slot at c=64 (default 8)")
    parser.add_argument("--retained-rounds", type=int, default=3,
                        help="interleaved direct / via-us rounds at c=64, medians reported (default 3)")
    parser.add_argument("--modes", nargs="+", default=["aggregated", "disaggregated"])
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="how long idle CPU is measured (default 5)")
    parser.add_argument("--coalesce-tokens", action="store_true", help="measure with http.coalesce_tokens: true")
    parser.add_argument("--processes", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}),
                        help="frontend process counts (http.processes; default 1 and one per core)")
    parser.add_argument("--stream-transports", nargs="+", default=["h2", "grpcio"], choices=["h2", "grpcio"],
                        help="Generate transports (stream_transport) measured with one frontend process; the "
                             "other variants use the first (default h2, the shipped default)")
    args = parser.parse_args(argv)
    prompt_ids = chat_prompt_ids()
    tmp = Path(tempfile.mkdtemp(prefix="orch-cpu-cost-"))
    workers, servers = SimWorkers(tmp), OrchestratorServers(tmp)
    rows = []
    try:
        default_transport = args.stream_transports[0]
        variants = [(n, default_transport) for n in args.processes]
        if 1 in args.processes:
            variants[1:1] = [(1, t) for t in args.stream_transports[1:]]
        for mode in args.modes:
            for processes, transport in variants:
                addresses, server = start_deployment(workers, servers, tmp, mode, http={
                    "coalesce_tokens": args.coalesce_tokens, "processes": processes},
                    stream_transport=transport)
                idle = idle_cpu_ms_per_s(server.process.pid, args.idle_seconds)
                rounds, events_per_token = trio.run(cpu_points, server.url, server.process.pid, args)
                a, b, fits = fit_rounds(rounds)
                points = [(statistics.median(p[0] for p in column), statistics.median(p[1] for p in column))
                          for column in zip(*rounds)]  # per max_tokens, over the rounds
                floor = fit_line(trio.run(direct_points, mode, addresses, prompt_ids, args, transport))
                split = CpuSplit([w.process.pid for w in workers.started if w.process.alive()], server.process.pid)
                direct, through, cpu = trio.run(retained_fraction, mode, addresses, server.url, prompt_ids, args,
                                                split)
                # "native": our own HTTP server (frontend/http_server.py), as the earlier tables name it
                label = f"native x{processes}" + (f" {transport}" if transport != default_transport else "")
                rows.append((mode, label, points, a, b, events_per_token, direct, through, idle, floor, fits, cpu))
                server.process.stop()  # one deployment at a time: nothing else competes for the 2 cores
                workers.close()
    finally:
        servers.close()
        workers.close()
        shutil.rmtree(tmp, ignore_errors=True)  # the logs and configs of this run: nothing left behind
    report(rows, args)
    return 0


def cpu_split_lines(cpu: dict[str, dict[str, float]]) -> list[str]:
    d, t = cpu["direct"], cpu["through"]
    return [f"c=64 CPU per token, direct: workers {d['workers']:.0f} + our client {d['client']:.0f} "
            f"= {d['workers'] + d['client']:.0f} us, {d['busy']:.2f} cores busy",
            f"c=64 CPU per token, via us: workers {t['workers']:.0f} + serve {t['serve']:.0f} + load generator "
            f"{t['client']:.0f} = {t['workers'] + t['serve'] + t['client']:.0f} us, {t['busy']:.2f} cores busy"]


def retained_budget_line(cpu: dict[str, dict[str, float]], direct_rate: float) -> str:
    """What 0.9 retained asks of serve when the box is full: 0.9 of the direct rate on all cores leaves
    cores / (0.9 * rate) of CPU per token, and the workers and load generator take their share first."""
    through = cpu["through"]
    budget = (os.cpu_count() or 1) / (0.9 * direct_rate) * 1e6
    left = budget - through["workers"] - through["client"]
    return (f"0.9 retained: 0.9 x {direct_rate:.0f} tok/s on {os.cpu_count()} full cores leaves {budget:.0f} us "
            f"per token, serve's share {left:.0f} us after the workers and load generator as measured "
            f"(it spent {through['serve']:.0f})")


def report(rows, args) -> None:
    print(f"orchestrator serve CPU (run time), c={args.concurrency}, max_tokens {args.max_tokens}, "
          f"sim workers at zero cost, {os.cpu_count()} cores, coalesce_tokens={args.coalesce_tokens}")
    print(f"{'mode':14} {'server':15} {'a ms/req':>9} {'target':>7} {'b us/tok':>9} {'target':>7} {'events/tok':>10} "
          f"{'c=64 direct tok/s':>18} {'via us tok/s':>13} {'retained':>8} {'target':>7}")
    for mode, server, points, a, b, events_per_token, direct, through, idle, floor, fits, cpu in rows:
        target_a, target_b = TARGETS[mode]
        print(f"{mode:14} {server:15} {a * 1e3:9.2f} {target_a:7.1f} {b * 1e6:9.1f} {target_b:7.0f} "
              f"{events_per_token:10.2f} {direct:18.0f} {through:13.0f} {through / direct:8.2f} {0.9:7.1f}")
        detail = ", ".join(f"{tokens:.0f} tok: {cpu * 1e3:.2f} ms" for tokens, cpu in points)
        print(f"{'':30} per request (medians): {detail}; idle: {idle:.1f} ms CPU per s (target 8)")
        a_values, b_values = [fit[0] * 1e3 for fit in fits], [fit[1] * 1e6 for fit in fits]
        print(f"{'':30} over {len(fits)} rounds: a {min(a_values):.2f}-{max(a_values):.2f} ms, "
              f"b {min(b_values):.1f}-{max(b_values):.1f} us/tok (the table has their medians)")
        print(f"{'':30} floor, our engine client alone (same transport, no HTTP): a {floor[0] * 1e3:.2f} ms, "
              f"b {floor[1] * 1e6:.1f} us/tok; serve/floor: a {a / floor[0]:.2f}x, b {b / floor[1]:.2f}x")
        for line in cpu_split_lines(cpu):
            print(f"{'':30} {line}")
        print(f"{'':30} {retained_budget_line(cpu, direct)}")
    for mode in dict.fromkeys(row[0] for row in rows):
        by_label = {row[1]: row for row in rows if row[0] == mode}
        base = by_label.get("native x1")
        if base is None:
            continue
        for label, row in by_label.items():
            if label != "native x1":
                print(f"{mode}: {label}/native x1  a {row[3] / base[3]:.2f}x, b {row[4] / base[4]:.2f}x, "
                      f"c=64 tok/s {row[7] / base[7]:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
