"""`orchestrator bench compare FILE`: the same workload on several topologies, side by side.

For each topology in the file it writes a launch config (simulated workers with the chosen profile
and time scale), brings it up with `orchestrator launch`, runs the workload with
`orchestrator bench run` in its own process, and tears it down. Then it writes results.json,
report.md (a table per load point and who wins where) and PNG plots: tokens/s per user against
tokens/s per GPU (the Pareto view), and TTFT and TPOT against load, topologies on the same axes.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import yaml

from orchestrator.config import MODES, ConfigError, build_attrs  # one loader, one error style
from orchestrator.roles import ROLES


@attrs.frozen
class TopologySpec:
    name: str
    mode: str
    workers: dict[str, int]  # role -> worker count (one GPU each)

    @property
    def gpus(self) -> int:
        return sum(self.workers.values())


@attrs.frozen
class WorkloadSpec:
    input_len: str = "1000:2000"
    output_len: str = "128"
    requests: int = 32
    warmup: int = 2
    image_share: float = 0.0
    seed: int = 1
    concurrency: tuple[int, ...] = ()
    rates: tuple[float, ...] = ()


@attrs.frozen
class SloSpec:
    ttft_s: float | None = None
    tpot_s: float | None = None


@attrs.frozen
class CompareSpec:
    profile: str = "llama3-8b-h100"
    time_scale: float = 0.5
    schema_revision: int = 3  # the simulated TensorRT-LLM that serves images (orchestrator/sim/persona.py)
    model: str = "tiny-chat"
    topologies: tuple[TopologySpec, ...] = ()
    workload: WorkloadSpec = WorkloadSpec()
    slo: SloSpec = SloSpec()


def load_spec(path: Path) -> tuple[CompareSpec, list[TopologySpec]]:
    spec = build_attrs(CompareSpec, yaml.safe_load(path.read_text()), str(path), "")
    if not spec.topologies:
        raise ConfigError(str(path), "topologies", "at least one topology")
    for i, topology in enumerate(spec.topologies):
        if topology.mode not in MODES:
            raise ConfigError(str(path), f"topologies[{i}].mode", " or ".join(MODES), topology.mode)
        if not topology.workers or not all(role in ROLES and n > 0 for role, n in topology.workers.items()):
            raise ConfigError(str(path), f"topologies[{i}].workers", "role: count pairs with counts > 0",
                              topology.workers)
    if not spec.workload.concurrency and not spec.workload.rates:
        raise ConfigError(str(path), "workload", "concurrency or rates to sweep")
    return spec, list(spec.topologies)


def launch_config(spec: CompareSpec, topology: TopologySpec, time_scale: float | None = None) -> dict:
    """The launch config of a topology; `time_scale` overrides the spec's (0: its zero-cost baseline)."""
    time_scale = spec.time_scale if time_scale is None else time_scale
    return {
        "mode": topology.mode,
        "model": {"name": spec.model, "dir": "builtin:tiny-chat"},
        "discovery": {"static": {role: [] for role in topology.workers}},
        "routing": {"aggregated": "least_loaded", "prefill": "least_loaded", "decode": "least_loaded"},
        "http": {"host": "127.0.0.1", "port": 0},
        "limits": {"request_timeout_s": 3600},
        "launch": {"workers": [{"role": role, "count": count,
                                "sim": {"profile": spec.profile, "time_scale": time_scale,
                                        "schema_revision": spec.schema_revision}}
                               for role, count in topology.workers.items()]},
    }


def run_topology(spec: CompareSpec, topology: TopologySpec, workdir: Path) -> dict:
    from orchestrator.processes import ManagedProcess, orchestrator_command

    launchers = []
    try:
        # Below time scale 1 a twin on zero-cost workers measures the orchestrator's own time per request, which
        # the conversion to GPU time must not scale (bench run --baseline-url).
        for suffix, time_scale in [("", spec.time_scale)] + ([("-baseline", 0.0)] if spec.time_scale != 1.0 else []):
            config_path = workdir / f"{_slug(topology.name)}{suffix}.yaml"
            config_path.write_text(yaml.safe_dump(launch_config(spec, topology, time_scale), sort_keys=False))
            launchers.append(ManagedProcess(f"launch-{_slug(topology.name)}{suffix}",
                                            orchestrator_command("launch", str(config_path)), log_dir=workdir,
                                            env={"ORCH_LOG_LEVEL": "WARNING"}, tied=True))
        url, *baseline = [launcher.wait_ready(300) for launcher in launchers]
        out = workdir / f"{_slug(topology.name)}.json"
        w = spec.workload
        argv = orchestrator_command("bench", "run", "--url", url, "--model", spec.model, "--input-len", w.input_len,
                                    "--output-len", w.output_len, "--requests", str(w.requests), "--warmup",
                                    str(w.warmup), "--image-share", repr(w.image_share), "--seed", str(w.seed),
                                    "--gpus", str(topology.gpus), "--time-scale", repr(spec.time_scale),
                                    "--label", topology.name, "--out", str(out))
        if baseline:
            argv += ["--baseline-url", baseline[0]]
        if w.concurrency:
            argv += ["--concurrency", *map(str, w.concurrency)]
        if w.rates:
            argv += ["--rate", *map(repr, w.rates)]
        if spec.slo.ttft_s is not None:
            argv += ["--slo-ttft", repr(spec.slo.ttft_s)]
        if spec.slo.tpot_s is not None:
            argv += ["--slo-tpot", repr(spec.slo.tpot_s)]
        # exit 1: some requests failed; they are counted in the results ("errors"), so the comparison goes on
        if subprocess.run(argv).returncode not in (0, 1):
            raise RuntimeError(f"bench run for {topology.name!r} failed; see the output above")
        result = json.loads(out.read_text())
    finally:
        for launcher in launchers:
            launcher.stop()
    return {"name": topology.name, "mode": topology.mode, "workers": topology.workers, "gpus": topology.gpus,
            "points": result["points"]}


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def render(out_dir: Path) -> None:
    """(Re)write report.md and the plots from results.json."""
    document = json.loads((out_dir / "results.json").read_text())
    plots = write_plots(document, out_dir)
    (out_dir / "report.md").write_text(render_markdown(document, plots))


def compare(path: Path, out_dir: Path) -> Path:
    spec, topologies = load_spec(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="orch-compare-") as tmp:
        results = [run_topology(spec, topology, Path(tmp)) for topology in topologies]
    document = {"spec_file": str(path), "started": started, "profile": spec.profile, "time_scale": spec.time_scale,
                "workload": attrs.asdict(spec.workload), "slo": attrs.asdict(spec.slo), "topologies": results}
    (out_dir / "results.json").write_text(json.dumps(document, indent=2, default=_json_default) + "\n")
    render(out_dir)
    return out_dir


def _json_default(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    raise TypeError(type(value))


# ---- report ---------------------------------------------------------------------------------------
COLUMNS = [
    ("TTFT p50 ms", lambda p: p["ttft_s"]["p50"] * 1e3), ("TTFT p99 ms", lambda p: p["ttft_s"]["p99"] * 1e3),
    ("TPOT p50 ms", lambda p: p["tpot_s"]["p50"] * 1e3), ("TPOT p99 ms", lambda p: p["tpot_s"]["p99"] * 1e3),
    ("ITL p50 ms", lambda p: p["itl_s"]["p50"] * 1e3), ("ITL p99 ms", lambda p: p["itl_s"]["p99"] * 1e3),
    ("E2E p50 s", lambda p: p["e2e_s"]["p50"]), ("req/s", lambda p: p["request_throughput"]),
    ("out tok/s", lambda p: p["output_tokens_per_s"]), ("tok/s/user", lambda p: p["tokens_per_s_per_user"]),
    ("tok/s/GPU", lambda p: p["tokens_per_s_per_gpu"]), ("goodput req/s", lambda p: p["goodput"]),
    ("errors", lambda p: sum(p["errors"].values())),
]


def _fmt(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def render_markdown(document: dict, plots: list[str]) -> str:
    w, slo = document["workload"], document["slo"]
    lines = [
        "# Aggregated vs disaggregated serving",
        "",
        f"Profile `{document['profile']}` on simulated TRT-LLM workers (time scale {document['time_scale']:g}; "
        "figures below are in simulated GPU time). Workload: input "
        f"{w['input_len']} tokens, output {w['output_len']} tokens, {w['requests']} requests per load point "
        f"(+{w['warmup']} warm-up), image share {w['image_share']:g}, seed {w['seed']}. "
        f"SLO for goodput: TTFT <= {slo['ttft_s']} s, TPOT <= {slo['tpot_s']} s. Run started {document['started']}.",
        "",
        "| topology | GPUs | load | " + " | ".join(name for name, _ in COLUMNS) + " |",
        "|---|---|---|" + "---|" * len(COLUMNS),
    ]
    for topology in document["topologies"]:
        for point in topology["points"]:
            load = f"{point['load_kind']} {point['load']:g}"
            cells = []
            for _, get in COLUMNS:
                try:
                    cells.append(_fmt(get(point)))
                except (TypeError, KeyError):
                    cells.append("-")
            lines.append(f"| {topology['name']} | {topology['gpus']} | {load} | " + " | ".join(cells) + " |")
    lines += ["", "## Who wins where", ""]
    lines += winners(document) or ["(a single topology: nothing to compare)"]
    lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in plots]
    return "\n".join(lines) + "\n"


TIE = 0.02  # within 2% of each other: no winner


def winners(document: dict) -> list[str]:
    topologies = document["topologies"]
    if len(topologies) < 2:
        return []
    lines = []
    metrics = [("TTFT p50", lambda p: p["ttft_s"]["p50"], min), ("TPOT p50", lambda p: p["tpot_s"]["p50"], min),
               ("goodput", lambda p: p["goodput"], max), ("tok/s/GPU", lambda p: p["tokens_per_s_per_gpu"], max)]
    loads = [(p["load_kind"], p["load"]) for p in topologies[0]["points"]]
    for kind, load in loads:
        parts = []
        for label, get, best in metrics:
            values = []
            for t in topologies:
                point = next((p for p in t["points"] if (p["load_kind"], p["load"]) == (kind, load)), None)
                value = get(point) if point else None
                if value is not None and not (isinstance(value, float) and math.isnan(value)):
                    values.append((value, t["name"]))
            if len(values) >= 2:
                ranked = sorted(values, reverse=best is max)
                (first, name), (second, _) = ranked[0], ranked[1]
                if abs(first - second) <= TIE * max(abs(first), abs(second)):
                    parts.append(f"{label}: tie")
                else:
                    parts.append(f"{label}: **{name}**")
        lines.append(f"- {kind} {load:g}: " + ", ".join(parts))
    return lines


def write_plots(document: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for topology in document["topologies"]:
        xs = [p["tokens_per_s_per_gpu"] for p in topology["points"]]
        ys = [p["tokens_per_s_per_user"] for p in topology["points"]]
        ax.plot(xs, ys, marker="o", label=topology["name"])
        for p, x, y in zip(topology["points"], xs, ys):
            ax.annotate(f"{p['load']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("output tokens/s per GPU (simulated GPU time)")
    ax.set_ylabel("output tokens/s per user (simulated GPU time)")
    ax.set_title("Throughput vs interactivity (labels: load)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "pareto.png", dpi=110)
    plt.close(fig)
    names.append("pareto.png")
    for key, label, filename in (("ttft_s", "TTFT", "ttft.png"), ("tpot_s", "TPOT", "tpot.png")):
        fig, ax = plt.subplots(figsize=(6.4, 4.8))
        for i, topology in enumerate(document["topologies"]):
            loads = [p["load"] for p in topology["points"]]
            for stat, style in (("p50", "-o"), ("p99", "--x")):
                ax.plot(loads, [p[key][stat] * 1e3 for p in topology["points"]], style, color=f"C{i}",
                        label=f"{topology['name']} {stat}")
        bound = document["slo"].get(key)
        if bound is not None:
            ax.axhline(bound * 1e3, color="red", linestyle=":", linewidth=1.2, label=f"SLO {bound * 1e3:g} ms")
        kind = document["topologies"][0]["points"][0]["load_kind"]
        ax.set_xlabel("concurrent users" if kind == "concurrency" else "requests/s (simulated GPU time)")
        ax.set_ylabel(f"{label} (ms, simulated GPU time)")
        ax.set_title(f"{label} against load")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / filename, dpi=110)
        plt.close(fig)
        names.append(filename)
    return names


def main_compare(path: Path, out_dir: Path) -> int:
    try:
        compare(path, out_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out_dir}/results.json, report.md, pareto.png, ttft.png, tpot.png")
    return 0
