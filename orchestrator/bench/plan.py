"""`orchestrator bench plan FILE`: which topology serves a workload best on a GPU budget.

For a budget of G GPUs (one worker per GPU) it considers aggregated x G, every prefill:decode split
P:(G-P) of disaggregated serving, and conditional disaggregation on the same splits (prompts up to
`max_local_prefill_length` tokens prefill on the decode worker). Each topology runs the workload at
every concurrency of the sweep on a **virtual clock**: the simulated worker's own scheduler
(orchestrator.sim.scheduler: continuous batching, chunked prefill, KV-block admission) and cost
profile, driven step by step with no processes and no sleeping, plus the KV transfer time between
the stages. That makes a whole plan a matter of seconds, and its figures the ones `bench compare`
would measure on live simulated workers, minus HTTP and gRPC overheads.

The report ranks topologies by goodput per GPU (requests/s meeting the SLO, at the best load point)
and draws the Pareto frontier of tokens/s per GPU against tokens/s per user. When aiconfigurator is
installed (`--aiconfigurator PYTHON`: an interpreter that can import it), its own recommendation for
the same workload is put beside ours.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import attrs
import yaml

from orchestrator.bench.compare import SloSpec, _fmt, _json_default
from orchestrator.bench.loadgen import Range
from orchestrator.bench.metrics import RequestRecord, aggregate
from orchestrator.config import ConfigError, build_attrs
from orchestrator.roles import ROLES
from orchestrator.sim.output import Vocabulary
from orchestrator.sim.profiles import PROFILES, Profile
from orchestrator.sim.scheduler import CONTEXT_ONLY, FULL, GENERATION_ONLY, Scheduler, SimRequest, Step

PLAN_MODES = ("aggregated", "disaggregated", "conditional")


@attrs.frozen
class PlanWorkload:
    input_len: str = "2000:3000"
    output_len: str = "150"
    requests: int = 200  # per load point
    seed: int = 1
    concurrency: tuple[int, ...] = (4, 8, 16, 32, 64, 128)


@attrs.frozen
class PlanSpec:
    gpus: int = 8
    profile: str = "llama3-8b-h100"
    modes: tuple[str, ...] = PLAN_MODES
    max_local_prefill_length: int = 512  # conditional mode
    workload: PlanWorkload = PlanWorkload()
    slo: SloSpec = SloSpec()
    # what aiconfigurator is asked for the same workload (when it is installed)
    aiconfigurator_model: str = "meta-llama/Meta-Llama-3.1-8B"
    aiconfigurator_system: str = "h100_sxm"


@attrs.frozen
class Topology:
    mode: str
    prefill: int = 0
    decode: int = 0
    aggregated: int = 0

    @property
    def gpus(self) -> int:
        return self.prefill + self.decode + self.aggregated

    @property
    def name(self) -> str:
        if self.mode == "aggregated":
            return f"aggregated {self.aggregated}x"
        return f"{self.mode} {self.prefill}P:{self.decode}D"


def load_plan_spec(path: Path) -> PlanSpec:
    spec = build_attrs(PlanSpec, yaml.safe_load(path.read_text()), str(path), "")
    if spec.gpus < 1:
        raise ConfigError(str(path), "gpus", "an integer >= 1", spec.gpus)
    if spec.profile not in PROFILES:
        raise ConfigError(str(path), "profile", " or ".join(sorted(PROFILES)), spec.profile)
    for i, mode in enumerate(spec.modes):
        if mode not in PLAN_MODES:
            raise ConfigError(str(path), f"modes[{i}]", " or ".join(PLAN_MODES), mode)
    if not spec.workload.concurrency or min(spec.workload.concurrency) < 1:
        raise ConfigError(str(path), "workload.concurrency", "a list of concurrencies >= 1",
                          spec.workload.concurrency)
    for key in ("input_len", "output_len"):
        try:
            Range.parse(getattr(spec.workload, key))
        except ValueError as exc:
            raise ConfigError(str(path), f"workload.{key}", "N or LOW:HIGH", getattr(spec.workload, key)) from exc
    return spec


def topologies(spec: PlanSpec) -> list[Topology]:
    result = []
    if "aggregated" in spec.modes:
        result.append(Topology("aggregated", aggregated=spec.gpus))
    for mode in ("disaggregated", "conditional"):
        if mode in spec.modes:
            result += [Topology(mode, prefill=p, decode=spec.gpus - p) for p in range(1, spec.gpus)]
    return result


# ---- the virtual-clock simulation -------------------------------------------------------------------

class Stepping(Protocol):
    """A simulated worker the virtual clock steps: its scheduler and the step in flight."""

    scheduler: Scheduler
    step: Step | None


# A clock's own worker type (reuse's workers carry more than Stepping): what its step hooks are handed back.
SteppingT = TypeVar("SteppingT", bound=Stepping)


class _Worker:
    def __init__(self, role: str, profile: Profile):
        self.role = role
        self.scheduler = Scheduler(profile, role, Vocabulary([1, 2, 3], eos_id=0))
        self.step: Step | None = None  # the step in flight, if any

    @property
    def load(self) -> int:
        s = self.scheduler
        return s.running + len(s.waiting)


class VirtualClock(Generic[SteppingT]):
    """Simulated workers' step loops on one virtual clock (also orchestrator.bench.reuse's). A worker has a
    `scheduler` and the `step` in flight; `run_events` plays everything scheduled until nothing is left."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()

    def _at(self, when: float, action, *args) -> None:
        heapq.heappush(self._events, (when, next(self._seq), action, args))

    def run_events(self) -> None:
        while self._events:
            self.now, _, action, args = heapq.heappop(self._events)
            action(*args)

    def _submit(self, worker: SteppingT, request: SimRequest) -> None:
        worker.scheduler.submit(request)
        if worker.step is None:
            self._start_step(worker)

    def _start_step(self, worker: SteppingT) -> None:
        worker.step = worker.scheduler.plan_step()
        if worker.step is not None:
            self._at(self.now + worker.step.ms / 1000.0, self._finish_step, worker)

    def _finish_step(self, worker: SteppingT) -> None:
        # Callbacks of this step may submit to this worker: it counts as busy until its next step is planned.
        if worker.step is not None:  # scheduled by _start_step only when it planned one
            worker.scheduler.finish_step(worker.step)
        worker.step = None
        self._start_step(worker)


class VirtualCluster(VirtualClock[_Worker]):
    """Workers of one topology on a shared virtual clock; closed-loop users send the requests."""

    def __init__(self, topology: Topology, profile: Profile, max_local_prefill_length: int):
        super().__init__()
        self.topology, self.profile = topology, profile
        self.max_local = max_local_prefill_length if topology.mode == "conditional" else -1
        self.workers = {role: [_Worker(role, profile) for _ in range(getattr(topology, role))]
                        for role in ROLES}

    def _least_loaded(self, role: str) -> _Worker:
        return min(self.workers[role], key=lambda w: w.load)

    def run(self, prompts: list[tuple[int, int]], concurrency: int) -> list[RequestRecord]:
        """`prompts`: (input tokens, output tokens) per request, sent by `concurrency` closed-loop users."""
        queue = list(reversed(prompts))
        records: list[RequestRecord] = []

        def send() -> None:
            if not queue:
                return
            prompt_len, output_len = queue.pop()
            start = self.now
            chunks: list[tuple[float, int]] = []
            key = len(queue)

            def on_token(request: SimRequest, token: int) -> None:
                chunks.append((self.now, 1))

            def on_finish(request: SimRequest, reason: str, match) -> None:
                records.append(RequestRecord(start, self.now, tuple(chunks), output_tokens=len(chunks),
                                             input_tokens=prompt_len))
                send()  # the user's next request

            def leg(kind: str, **extra) -> SimRequest:
                return SimRequest(request_id=f"r{key}", kind=kind, prompt_len=prompt_len, key=key,
                                  max_tokens=output_len, ignore_eos=True, on_token=on_token, on_finish=on_finish,
                                  **extra)

            if self.topology.mode == "aggregated":
                self._submit(self._least_loaded("aggregated"), leg(FULL))
            elif prompt_len <= self.max_local:
                self._submit(self._least_loaded("decode"), leg(FULL))
            else:
                def on_context_done(request: SimRequest, first_token: int) -> None:
                    # The blocks now belong to the KV session on `owner`; the decode's pull frees them.
                    decode = leg(GENERATION_ONLY, first_gen_tokens=(first_token,))
                    session_blocks, request.blocks = request.blocks, 0

                    def pulled() -> None:
                        owner.scheduler.release_blocks(session_blocks)
                        self._submit(self._least_loaded("decode"), decode)

                    self._at(self.now + self.profile.kv_transfer_ms(prompt_len) / 1000.0, pulled)

                owner = self._least_loaded("prefill")
                context = leg(CONTEXT_ONLY, on_context_done=on_context_done)
                context.max_tokens = 1
                self._submit(owner, context)

        for _ in range(concurrency):
            send()
        self.run_events()
        return records


def draw_prompts(workload: PlanWorkload) -> list[tuple[int, int]]:
    rng = random.Random(workload.seed)
    inputs, outputs = Range.parse(workload.input_len), Range.parse(workload.output_len)
    return [(inputs.draw(rng), outputs.draw(rng)) for _ in range(workload.requests)]


def simulate(topology: Topology, spec: PlanSpec, concurrency: int) -> dict:
    cluster = VirtualCluster(topology, PROFILES[spec.profile], spec.max_local_prefill_length)
    records = cluster.run(draw_prompts(spec.workload), concurrency)
    return aggregate(records, gpus=topology.gpus, slo_ttft=spec.slo.ttft_s, slo_tpot=spec.slo.tpot_s)


def plan(spec: PlanSpec) -> dict:
    results: list[dict[str, Any]] = []
    for topology in topologies(spec):
        points = [{"load_kind": "concurrency", "load": c, **simulate(topology, spec, c)}
                  for c in spec.workload.concurrency]
        best = max(points, key=lambda p: p["goodput"])
        results.append({"name": topology.name, "mode": topology.mode, "gpus": topology.gpus,
                        "workers": {k: v for k, v in attrs.asdict(topology).items() if k != "mode" and v},
                        "points": points, "best": {"load": best["load"], "goodput": best["goodput"],
                                                   "goodput_per_gpu": best["goodput"] / topology.gpus}})
    results.sort(key=lambda t: t["best"]["goodput_per_gpu"], reverse=True)
    return {"gpus": spec.gpus, "profile": spec.profile, "workload": attrs.asdict(spec.workload),
            "slo": attrs.asdict(spec.slo), "max_local_prefill_length": spec.max_local_prefill_length,
            "topologies": results}


def pareto_frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both axes (more tokens/s per GPU and per user), by x."""
    frontier: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if not frontier or y > frontier[-1][1]:
            frontier.append((x, y))
    return sorted(frontier)


# ---- aiconfigurator, when it is installed --------------------------------------------------------------

def aiconfigurator_recommendation(python: str, spec: PlanSpec) -> str:
    """aiconfigurator's `cli default` for the same model, GPUs, mean lengths and SLO (text, or why not)."""
    inputs, outputs = Range.parse(spec.workload.input_len), Range.parse(spec.workload.output_len)
    args = ["--model-path", spec.aiconfigurator_model, "--total-gpus", str(spec.gpus), "--system",
            spec.aiconfigurator_system, "--backend", "trtllm", "--isl", str((inputs.low + inputs.high) // 2),
            "--osl", str((outputs.low + outputs.high) // 2), "--no-color"]
    if spec.slo.ttft_s is not None:
        args += ["--ttft", f"{spec.slo.ttft_s * 1000:g}"]
    if spec.slo.tpot_s is not None:
        args += ["--tpot", f"{spec.slo.tpot_s * 1000:g}"]
    entry = "import sys; from aiconfigurator.main import main; sys.argv[0] = 'aiconfigurator'; sys.exit(main())"
    try:
        done = subprocess.run([python, "-c", entry, "cli", "default", *args], capture_output=True, text=True,
                              timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"aiconfigurator could not be run with {python}: {exc}"
    if done.returncode != 0:
        return f"aiconfigurator exited {done.returncode}: {done.stderr.strip()[-2000:]}"
    return f"`aiconfigurator cli default {' '.join(args)}` (tensor parallelism included):\n\n```\n" + \
        _aic_summary(done.stdout + done.stderr) + "\n```"


def _aic_summary(output: str) -> str:
    """Its best configurations and top tables, without log lines and the ASCII plot."""
    kept, in_plot = [], False
    for line in output.splitlines():
        if "[aiconfigurator]" in line or "Warning" in line or not line.strip():
            continue
        if "Pareto Frontier:" in line:
            in_plot = True
        elif "Deployment Details:" in line:
            in_plot = False
        elif not in_plot:
            kept.append(line.rstrip())
    return "\n".join(kept[:80])


# ---- report -----------------------------------------------------------------------------------------------

def render_markdown(document: dict, recommendation: str | None, plot: str) -> str:
    w, slo = document["workload"], document["slo"]
    lines = [
        f"# Topology plan for {document['gpus']} GPUs",
        "",
        f"Profile `{document['profile']}` (the simulator's calibrated cost model, see docs in "
        "orchestrator/sim/profiles.py), virtual clock, figures in simulated GPU time. Workload: input "
        f"{w['input_len']} tokens, output {w['output_len']} tokens, {w['requests']} requests per load point from "
        f"closed-loop users at concurrency {', '.join(map(str, w['concurrency']))}. SLO: TTFT <= {slo['ttft_s']} s, "
        f"TPOT <= {slo['tpot_s']} s. Conditional mode prefills prompts up to "
        f"{document['max_local_prefill_length']} tokens on the decode worker.",
        "",
        "Ranked by goodput per GPU at each topology's best load point:",
        "",
        "| rank | topology | best concurrency | goodput req/s | goodput req/s/GPU | TTFT p50 ms | TPOT p50 ms "
        "| tok/s/GPU | tok/s/user |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rank, topology in enumerate(document["topologies"], 1):
        best = topology["best"]
        point = next(p for p in topology["points"] if p["load"] == best["load"])
        lines.append(f"| {rank} | {topology['name']} | {best['load']} | {_fmt(best['goodput'])} | "
                     f"{_fmt(best['goodput_per_gpu'])} | {_fmt(point['ttft_s']['p50'] * 1e3)} | "
                     f"{_fmt(point['tpot_s']['p50'] * 1e3)} | {_fmt(point['tokens_per_s_per_gpu'])} | "
                     f"{_fmt(point['tokens_per_s_per_user'])} |")
    top = document["topologies"][0]
    lines += ["", f"**Choose {top['name']}** for this workload and SLO "
                  f"({_fmt(top['best']['goodput_per_gpu'])} req/s per GPU meeting the SLO).", "",
              "## Pareto frontier", "", f"![pareto]({plot})", "",
              "## aiconfigurator's recommendation", "",
              recommendation or "aiconfigurator was not installed where this plan ran (`--aiconfigurator PYTHON`).",
              ""]
    return "\n".join(lines)


def write_pareto_plot(document: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 5.4))
    every = []
    for i, topology in enumerate(document["topologies"]):
        xs = [p["tokens_per_s_per_gpu"] for p in topology["points"]]
        ys = [p["tokens_per_s_per_user"] for p in topology["points"]]
        every += [(x, y) for x, y in zip(xs, ys) if not (math.isnan(x) or math.isnan(y))]
        style = {"aggregated": "o", "disaggregated": "s", "conditional": "^"}[topology["mode"]]
        ax.plot(xs, ys, style, linestyle="-", linewidth=0.6, markersize=4, alpha=0.8, color=f"C{i % 10}",
                label=topology["name"] if i < 12 else None)
    frontier = pareto_frontier(every)
    ax.plot([x for x, _ in frontier], [y for _, y in frontier], color="black", linewidth=2, label="Pareto frontier")
    ax.set_xlabel("output tokens/s per GPU (simulated GPU time)")
    ax.set_ylabel("output tokens/s per user (simulated GPU time)")
    ax.set_title(f"{document['gpus']} GPUs, profile {document['profile']} (points: concurrency sweep)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main_plan(path: Path, out_dir: Path, aiconfigurator: str | None) -> int:
    try:
        spec = load_plan_spec(path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    document = plan(spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    recommendation = aiconfigurator_recommendation(aiconfigurator, spec) if aiconfigurator else None
    document["aiconfigurator"] = recommendation
    (out_dir / "results.json").write_text(json.dumps(document, indent=1, default=_json_default) + "\n")
    write_pareto_plot(document, out_dir / "pareto.png")
    (out_dir / "report.md").write_text(render_markdown(document, recommendation, "pareto.png"))
    for topology in document["topologies"][:5]:
        print(f"{topology['name']}: {topology['best']['goodput_per_gpu']:.3f} req/s/GPU at concurrency "
              f"{topology['best']['load']}")
    print(f"wrote {out_dir / 'report.md'}")
    return 0
