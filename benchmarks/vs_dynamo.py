"""The orchestrator side by side with NVIDIA Dynamo 1.6.1: frontend CPU per request and per token, memory.

    bash scripts/setup-dynamo-bench.sh        # Dynamo 1.6.1 into .venv-dynamo, once
    .venv/bin/python benchmarks/vs_dynamo.py [--modes aggregated disaggregated] [--paces zero paced]
        [--rounds 4] [--requests 128] [--max-tokens 1 64 256] [--concurrency 16] [--streams 1024]

Both systems run on this machine at the same time, one worker per role on each side: `orchestrator serve` in
front of our simulated workers, and Dynamo's frontend (`python -m dynamo.frontend`, its HTTP server,
preprocessor and router in one process) in front of Dynamo's mock engine (`python -m dynamo.mocker`), with
prefill and decode mockers for the disaggregated mode. Both sides' workers run at the same pace, `--paces`:
`zero`, no GPU time at all (`sim-worker --time-scale 0`; `dynamo.mocker --speedup-ratio 1e6`: Dynamo 1.6.1's
mocker runs in real time at a ratio of 0 or less, its source returns the unscaled time then), so tokens come
as fast as each side can carry them and may be batched; and `paced`, both in real time (`--time-scale 1`,
`--speedup-ratio 1`), so tokens arrive one step apart, about one write per token, as in production.
Dynamo runs without etcd or NATS: file discovery, the TCP request plane and the ZMQ event
plane, its logs at warn (ours at WARNING). Dynamo's frontend still writes one INFO line per request (its
request span target is enabled whatever DYN_LOG says); ours writes none, at any level.

One load generator for both (benchmarks/overhead.py's slots; the same streamed chat completion, the same prompt,
ignore_eos, usage in the last event) at `--concurrency`. For each max_tokens value, `--requests` streams go
through one system while the CPU time of its frontend process (threads' run time from /proc, cpu_cost.py's
cpu_seconds) is read before and after; the systems and the max_tokens values take turns, `--rounds` times,
so that the drift of a shared VM hits both alike. Per round the CPU per request is fitted as a + b * tokens;
the table has the medians, and the ratios orchestrator / Dynamo (median of the rounds' paired ratios). b is
fitted over three lengths or more (1, 64 and 256 tokens by default), so that it is a slope, not two points.

Memory: with `--streams` streams open at once (aggregated, 4 workers on each side, tokens paced a few per
second: sim `--time-scale`, mocker `--speedup-ratio`, so that every stream is open and streaming together),
the frontend's resident set (VmRSS) is sampled while all of them are in flight and have had their first
token; printed with the RSS at rest before, and the observed time per token of each side.

Dynamo's mock engine emits random 32-bit token ids, which tiny-chat's 811-token vocabulary cannot detokenise:
Dynamo would then send no content event at all. Its response replay table (`--response-replay-trace-path`,
chosen per request by the `output_replay_id` annotation in `nvext`) makes it emit the word-like tokens our
simulator emits instead; the table also fixes each stream's length, so it has one row per max_tokens value.
Our server ignores the `nvext` field; both receive the same body.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import trio

from orchestrator.bench.sse_client import Connection
from orchestrator.models import TINY_CHAT
from orchestrator.processes import ManagedProcess, free_port
from orchestrator.sim.output import Vocabulary
from orchestrator.testkit.plugin import write_config
from orchestrator.testkit.processes import OrchestratorServers, SimWorkers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_cost import cpu_seconds, fit_line, idle_cpu_ms_per_s
from overhead import ThroughOrchestrator, run_slots

ROOT = Path(__file__).resolve().parent.parent
DYNAMO_PYTHON = ROOT / ".venv-dynamo" / "bin" / "python"
DYNAMO_VERSION = "1.6.1"
DYNAMO_LOG = "warn"
ZERO_COST_SPEEDUP = 1e6  # the mocker's --speedup-ratio for workers at zero cost (0 would mean real time)
# --paces: (our simulated workers' --time-scale, Dynamo's mocker's --speedup-ratio)
PACES = {"zero": (0.0, ZERO_COST_SPEEDUP), "paced": (1.0, 1.0)}
MEMORY_WORKERS = 4  # per side in the memory run: each simulated worker batches at most 256 requests


def replay_key(max_tokens: int) -> str:
    return f"tokens-{max_tokens}"


class Streams(ThroughOrchestrator):
    """The same streamed chat completions to either frontend: Dynamo's mocker replays the tokens `nvext` names
    (ours ignores the field), and the events are read in a way that fits both frontends' SSE."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(url, max_tokens)
        self.body["nvext"] = {"annotations": [f"output_replay_id:{replay_key(max_tokens)}"]}

    async def __call__(self, i: int, j: int, connection: Connection, on_first=None) -> tuple[float, int]:
        start = time.perf_counter()
        marks: dict = {"first": None, "tokens": 0}

        def on_data(payload: bytes, at: float) -> None:
            if b'"completion_tokens"' in payload:  # the usage event (may also carry the last content)
                marks["tokens"] = json.loads(payload)["usage"]["completion_tokens"]
            if b'"content":"' in payload and b'"content":""' not in payload:
                self.events += 1
                if marks["first"] is None:
                    marks["first"] = at
                    if on_first is not None:
                        on_first()

        await connection.post_stream("/v1/chat/completions", self.body, on_data)
        if marks["first"] is None or marks["tokens"] == 0:
            raise RuntimeError(f"{self.url}: a stream without content or usage (max_tokens "
                               f"{self.body['max_tokens']})")
        self.tokens += marks["tokens"]
        return marks["first"] - start, marks["tokens"]


# ---- the two deployments -------------------------------------------------------------------------------

class Orchestrator:
    name = "orchestrator"

    def __init__(self, tmp: Path, mode: str, workers: int = 1, time_scale: float = 0.0):
        self._workers, self._servers = SimWorkers(tmp), OrchestratorServers(tmp)
        try:
            roles = ("aggregated",) * workers if mode == "aggregated" else ("prefill", "decode") * workers
            addresses: dict[str, list[str]] = {}
            for role in roles:
                worker = self._workers.start(role, "--time-scale", str(time_scale))
                addresses.setdefault(role, []).append(worker.address)
            config = write_config(tmp / f"orchestrator-{mode}-{workers}.yaml", mode, addresses,
                                  limits={"health_interval_s": 1.0})  # the shipped default (tests poll faster)
            server = self._servers.start(config, env={"ORCH_LOG_LEVEL": "WARNING"})
        except BaseException:
            self.close()
            raise
        self.url, self.pid = server.url, server.process.pid

    def close(self) -> None:
        self._servers.close()
        self._workers.close()


def dynamo_model_dir(tmp: Path) -> Path:
    """tiny-chat for Dynamo: its model card reads config.json as a Hugging Face model config, which needs
    `architectures` (and an eos_token_id); the tokenizer files are ours unchanged."""
    model = tmp / "dynamo-tiny-chat"
    model.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_CHAT / name, model / name)
    config = json.loads((TINY_CHAT / "config.json").read_text())
    eos_token = json.loads((TINY_CHAT / "tokenizer_config.json").read_text())["eos_token"]
    added = {t["content"]: t["id"] for t in json.loads((TINY_CHAT / "tokenizer.json").read_text())["added_tokens"]}
    config.update({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "eos_token_id": added[eos_token]})
    (model / "config.json").write_text(json.dumps(config, indent=1))
    return model


def replay_trace(tmp: Path, max_tokens_values: list[int]) -> Path:
    """The mocker's response table: per max_tokens, that many of the word-like ids our simulator emits."""
    words = Vocabulary.from_model_dir(TINY_CHAT).word_ids
    path = tmp / "dynamo-replay.jsonl"
    with path.open("w") as out:
        for n in sorted(set(max_tokens_values)):
            ids = [words[(7 * i + n) % len(words)] for i in range(n)]
            out.write(json.dumps({"timestamp": 0, "request_id": replay_key(n), "input_length": 32,
                                  "output_length": n, "hash_ids": [0], "output_token_ids": ids}) + "\n")
    return path


class Dynamo:
    name = f"dynamo {DYNAMO_VERSION}"

    def __init__(self, tmp: Path, mode: str, max_tokens_values: list[int], workers: int = 1,
                 speedup_ratio: float = ZERO_COST_SPEEDUP, max_num_seqs: int = 256):
        run = tmp / f"dynamo-{mode}-{workers}"
        run.mkdir()
        # file discovery under this run's own directory; Dynamo's model-card cache under it too, not in ~/.cache
        env = {"DYN_LOG": DYNAMO_LOG, "DYN_FILE_KV": str(run / "discovery"), "HOME": str(run),
               "XDG_CACHE_HOME": str(run / "cache")}
        planes = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
        engine = ["-m", "dynamo.mocker", "--model-path", str(dynamo_model_dir(tmp)), "--model-name", "tiny-chat",
                  "--speedup-ratio", str(speedup_ratio), "--max-num-seqs", str(max_num_seqs),
                  "--num-workers", str(workers),
                  "--response-replay-trace-path", str(replay_trace(tmp, max_tokens_values)), *planes]
        port = free_port()
        self._processes: list[ManagedProcess] = []
        try:
            roles = ["agg"] if mode == "aggregated" else ["prefill", "decode"]
            for role in roles:
                self._processes.append(ManagedProcess(f"dynamo-mocker-{role}", [
                    str(DYNAMO_PYTHON), *engine, "--disaggregation-mode", role], env=env, log_dir=run))
            self.frontend = ManagedProcess("dynamo-frontend", [
                str(DYNAMO_PYTHON), "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
                *planes], env=env, log_dir=run)
            self._processes.append(self.frontend)
            self.url, self.pid = f"http://127.0.0.1:{port}", self.frontend.pid
            self._engines = self._processes[:-1]
            self._wait_ready(timeout=120.0)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        """Until the frontend lists the model (Dynamo prints no readiness line)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for process in self._processes:
                if not process.alive():
                    raise RuntimeError(process.describe_failure())
            with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as response:
                    if json.loads(response.read())["data"]:
                        time.sleep(1.0)  # the other worker kinds of the model are discovered alongside
                        return
            time.sleep(0.5)
        raise RuntimeError(f"Dynamo's frontend did not list the model within {timeout:.0f} s:\n"
                           + "\n".join(p.tail(10) for p in self._processes))

    def engine_cpu(self) -> list[float]:
        return [cpu_seconds(p.pid) for p in self._engines]

    def close(self) -> None:
        for process in reversed(self._processes):
            process.stop()


# ---- CPU ----------------------------------------------------------------------------------------------

async def cpu_rounds(systems, args) -> tuple[dict[str, list[list[tuple[float, float]]]], dict[str, float]]:
    """Per system, per round: (tokens per request, frontend CPU seconds per request) for each max_tokens; and
    per system the content events per streamed token."""
    streams = {s.name: [Streams(s.url, n) for n in args.max_tokens] for s in systems}
    for system in systems:  # warm-up: connections, caches, the first-request paths
        for one in streams[system.name]:
            await run_slots(args.concurrency, 2, one)
    per_slot = max(1, args.requests // args.concurrency)
    requests = per_slot * args.concurrency
    rounds: dict[str, list[list[tuple[float, float]]]] = {s.name: [] for s in systems}
    for index in range(args.rounds):
        order = systems if index % 2 == 0 else systems[::-1]  # neither always goes first
        for system in order:
            points = []
            for one in streams[system.name]:
                tokens_before, cpu_before = one.tokens, cpu_seconds(system.pid)
                await run_slots(args.concurrency, per_slot, one)
                spent = cpu_seconds(system.pid) - cpu_before
                points.append(((one.tokens - tokens_before) / requests, spent / requests))
            rounds[system.name].append(points)
    events_per_token = {name: sum(s.events for s in group) / max(sum(s.tokens for s in group), 1)
                        for name, group in streams.items()}
    return rounds, events_per_token


def check_prefill_used(dynamo: Dynamo, before: list[float]) -> None:
    """Disaggregated: the prefill mocker must have worked (its CPU moved), or the frontend served alone."""
    after = dynamo.engine_cpu()
    if after[0] - before[0] < 0.05:
        raise RuntimeError("Dynamo's prefill mocker spent no CPU: requests did not go through it")


# ---- memory -------------------------------------------------------------------------------------------

def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def memory_at(system, streams: int, max_tokens: int) -> dict[str, float]:
    """`streams` streams at once; the frontend's RSS at rest, and its largest RSS sampled while all of them
    were in flight with their first token in; the median time per token the client saw."""
    one = Streams(system.url, max_tokens)
    await run_slots(8, 2, one)  # warm-up
    await trio.sleep(1.0)
    rest = rss_mib(system.pid)
    state = {"streaming": 0, "done": 0}
    samples: list[float] = []
    per_token: list[float] = []

    def first_token() -> None:
        state["streaming"] += 1

    async def stream(i: int) -> None:
        connection = Connection(system.url)
        try:
            start = time.perf_counter()
            ttft, tokens = await one(i, 0, connection, first_token)
            per_token.append((time.perf_counter() - start - ttft) / max(tokens - 1, 1))
        finally:
            state["done"] += 1
            await connection.aclose()

    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(stream, i)
        while state["done"] < streams:  # sampled in this task while the streams run in theirs
            if state["streaming"] == streams and state["done"] == 0:
                samples.append(rss_mib(system.pid))
            await trio.sleep(0.1)
    if not samples:
        raise RuntimeError(f"{system.name}: never had all {streams} streams streaming at once; pace the tokens "
                           f"slower (--sim-time-scale / --mocker-speedup-ratio) or use longer streams")
    return {"rest": rest, "peak": max(samples), "samples": len(samples),
            "ms_per_token": statistics.median(per_token) * 1e3}


# ---- the run ------------------------------------------------------------------------------------------

def measure_cpu(tmp: Path, mode: str, pace: str, args) -> tuple[dict, dict, dict]:
    time_scale, speedup_ratio = PACES[pace]
    run = tmp / pace
    run.mkdir(exist_ok=True)
    with contextlib.ExitStack() as stack:
        orchestrator = Orchestrator(run, mode, time_scale=time_scale)
        stack.callback(orchestrator.close)
        dynamo = Dynamo(run, mode, args.max_tokens, speedup_ratio=speedup_ratio)
        stack.callback(dynamo.close)
        idle = {system.name: idle_cpu_ms_per_s(system.pid, args.idle_seconds) for system in (orchestrator, dynamo)}
        before = dynamo.engine_cpu()
        rounds, events_per_token = trio.run(cpu_rounds, [orchestrator, dynamo], args)
        if mode == "disaggregated":
            check_prefill_used(dynamo, before)
    return rounds, events_per_token, idle


def measure_memory(tmp: Path, args) -> dict[str, dict[str, float]]:
    results = {}
    # one deployment at a time: the other's paced streams would compete for the two cores
    for name in ("orchestrator", "dynamo"):
        system: Orchestrator | Dynamo
        if name == "orchestrator":
            system = Orchestrator(tmp, "aggregated", MEMORY_WORKERS, args.sim_time_scale)
        else:
            system = Dynamo(tmp, "aggregated", [args.memory_max_tokens], MEMORY_WORKERS, args.mocker_speedup_ratio,
                            max_num_seqs=args.streams)
        try:
            results[system.name] = trio.run(memory_at, system, args.streams, args.memory_max_tokens)
        finally:
            system.close()
    return results


def summarise(points_by_round: list[list[tuple[float, float]]]) -> dict:
    fits = [fit_line(points) for points in points_by_round]
    columns = list(zip(*points_by_round))  # per max_tokens, over the rounds
    return {"a": statistics.median(a for a, _ in fits), "b": statistics.median(b for _, b in fits),
            "fits": fits, "per_request": [statistics.median(cpu for _, cpu in column) for column in columns],
            "tokens": [statistics.median(tokens for tokens, _ in column) for column in columns]}


def paired_ratio(ours: list[list[tuple[float, float]]], theirs: list[list[tuple[float, float]]], pick) -> float:
    """The median over rounds of ours / theirs, for one figure picked from each round's points."""
    return statistics.median(pick(o) / pick(t) for o, t in zip(ours, theirs))


def report_cpu(cpu: dict[tuple[str, str], tuple[dict, dict, dict]], args) -> None:
    dynamo_name = Dynamo.name
    print(f"Frontend CPU (run time of its threads), c={args.concurrency}, streamed chat completions, max_tokens "
          f"{args.max_tokens}, {args.requests} requests per value and round, {args.rounds} interleaved rounds "
          f"(medians); {os.cpu_count()} cores")
    print("workers per side: aggregated, 1 (orchestrator: 1 sim-worker; Dynamo: 1 mocker, --num-workers 1); "
          "disaggregated, 1 prefill + 1 decode on each side")
    for pace, (time_scale, speedup_ratio) in PACES.items():
        if pace in args.paces:
            print(f"pace {pace}: sim-worker --time-scale {time_scale:g}, dynamo.mocker --speedup-ratio "
                  f"{speedup_ratio:g}")
    header = (f"{'mode':20} {'frontend':17} {'a ms/req':>9} {'b us/tok':>9} "
              + " ".join(f"{f'{n}-tok ms':>10}" for n in args.max_tokens) + f" {'events/tok':>10} {'idle ms/s':>8}")
    print(header)
    for (mode, pace), (rounds, events_per_token, idle) in cpu.items():
        ours, theirs = rounds["orchestrator"], rounds[dynamo_name]
        label = f"{mode} {pace}"
        for name in ("orchestrator", dynamo_name):
            s = summarise(rounds[name])
            print(f"{label:20} {name:17} {s['a'] * 1e3:9.3f} {s['b'] * 1e6:9.1f} "
                  + " ".join(f"{cpu * 1e3:10.3f}" for cpu in s["per_request"])
                  + f" {events_per_token[name]:10.2f} {idle[name]:8.1f}")
        a_ratio = paired_ratio(ours, theirs, lambda points: fit_line(points)[0])
        b_ratio = paired_ratio(ours, theirs, lambda points: fit_line(points)[1])
        per_request = [paired_ratio(ours, theirs, lambda points, k=k: points[k][1])
                       for k in range(len(args.max_tokens))]
        print(f"{label:20} {'ratio ours/theirs':17} {a_ratio:9.2f} {b_ratio:9.2f} "
              + " ".join(f"{r:10.2f}" for r in per_request))
        a_pairs = [fit_line(o)[0] / fit_line(t)[0] for o, t in zip(ours, theirs)]
        b_pairs = [fit_line(o)[1] / fit_line(t)[1] for o, t in zip(ours, theirs)]
        print(f"{'':20} paired ratios over the rounds: a {min(a_pairs):.2f}-{max(a_pairs):.2f}, "
              f"b {min(b_pairs):.2f}-{max(b_pairs):.2f}")
        for name in ("orchestrator", dynamo_name):
            fits = summarise(rounds[name])["fits"]
            a_values, b_values = [a * 1e3 for a, _ in fits], [b * 1e6 for _, b in fits]
            print(f"{'':20} {name}: over the rounds a {min(a_values):.3f}-{max(a_values):.3f} ms, "
                  f"b {min(b_values):.1f}-{max(b_values):.1f} us/tok")


def report_memory(memory: dict[str, dict[str, float]], args) -> None:
    dynamo_name = Dynamo.name
    print(f"\nFrontend memory (VmRSS) with {args.streams} streams open at once, aggregated, {MEMORY_WORKERS} "
          f"workers per side, {args.memory_max_tokens} tokens per stream")
    print(f"{'frontend':17} {'at rest MiB':>12} {f'{args.streams} streams MiB':>18} {'KiB/stream':>11} "
          f"{'ms/token seen':>14} {'samples':>8}")
    for name, m in memory.items():
        per_stream = (m["peak"] - m["rest"]) * 1024 / args.streams
        print(f"{name:17} {m['rest']:12.1f} {m['peak']:18.1f} {per_stream:11.1f} {m['ms_per_token']:14.0f} "
              f"{m['samples']:8.0f}")
    ours, theirs = memory["orchestrator"], memory[dynamo_name]
    print(f"{'ratio ours/theirs':17} {ours['rest'] / theirs['rest']:12.2f} {ours['peak'] / theirs['peak']:18.2f} "
          f"{(ours['peak'] - ours['rest']) / (theirs['peak'] - theirs['rest']):11.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="*", default=["aggregated", "disaggregated"],
                        choices=["aggregated", "disaggregated"])
    parser.add_argument("--paces", nargs="*", default=["zero", "paced"], choices=list(PACES),
                        help="the workers' pace, the same on both sides: zero (no GPU time) and/or paced (real "
                             "time); default both")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default 4)")
    parser.add_argument("--requests", type=int, default=128, help="streams per max_tokens value, system and round "
                                                                   "(default 128)")
    parser.add_argument("--concurrency", type=int, default=16, help="streams in flight at once (default 16)")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[1, 64, 256],
                        help="stream lengths b is fitted over, three or more (default 1 64 256)")
    parser.add_argument("--streams", type=int, default=1024, help="streams open at once for the memory figure "
                                                                  "(default 1024; 0: no memory run)")
    parser.add_argument("--memory-max-tokens", type=int, default=64, help="tokens per stream in the memory run")
    parser.add_argument("--sim-time-scale", type=float, default=25.0,
                        help="our simulated workers' pace in the memory run (default 25: about 0.2 s per token)")
    parser.add_argument("--mocker-speedup-ratio", type=float, default=0.03,
                        help="Dynamo's mocker's pace in the memory run (default 0.03: about 0.2 s per token at "
                             "1,024 streams)")
    parser.add_argument("--idle-seconds", type=float, default=3.0,
                        help="how long each frontend's CPU at rest is measured (health checks, timers; default 3)")
    args = parser.parse_args(argv)
    if len(set(args.max_tokens)) < 3:
        parser.error("--max-tokens needs three values or more (a line fitted through two is no fit)")
    if not DYNAMO_PYTHON.exists():
        print(f"{DYNAMO_PYTHON} is missing: run scripts/setup-dynamo-bench.sh first", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="orch-vs-dynamo-"))
    try:
        cpu = {(mode, pace): measure_cpu(tmp, mode, pace, args) for pace in args.paces for mode in args.modes}
        if cpu:
            report_cpu(cpu, args)  # before the memory run: its figures stand even if that one fails
        memory = measure_memory(tmp, args) if args.streams else None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # logs, configs, Dynamo's discovery files and caches
    if memory:
        report_memory(memory, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
