"""Calibrate the simulator's GPU profiles against NVIDIA's aiconfigurator (TensorRT-LLM on H100/H200).

    python -m venv /tmp/aic && /tmp/aic/bin/pip install aiconfigurator==0.12.0 numpy
    /tmp/aic/bin/python benchmarks/calibrate_profiles.py [--out FILE]

aiconfigurator models each operation of a forward pass from kernel timings collected on the real GPU
(its perf database: system h100_sxm / h200_sxm, backend trtllm 1.3.0rc20). For Llama-3.1-8B this script
asks it for
- prefill: one context-only forward of a batch of chunks (static_ctx), on a grid of lengths and batches;
- decode: one generation step (static_gen with osl=2) on a grid of batch sizes and context lengths;
fits our step formula to those points by least squares on relative error
    prefill(a + b*L + c*sum(l_i^2)),   decode(d + e*sum(context) + f*batch)
prints the coefficients (paste them into orchestrator/sim/profiles.py) and writes the reference grid
with its provenance to --out, which tests/unit/test_sim_calibration.py checks the profiles against (15%).
aiconfigurator itself is not a dependency of the project: only this script imports it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

MODEL = "meta-llama/Meta-Llama-3.1-8B"
BACKEND, VERSION = "trtllm", "1.3.0rc20"
TARGETS = {  # profile name -> (aiconfigurator system, precision)
    "llama3-8b-h100": ("h100_sxm", "bf16"),
    "llama3-8b-h100-fp8": ("h100_sxm", "fp8"),
    "llama3-8b-h200": ("h200_sxm", "bf16"),
}
PREFILL_GRID = [(1, n) for n in (128, 256, 512, 1024, 2048, 4096, 8192)] + [(4, 512), (2, 2048), (8, 1024)]
DECODE_GRID = [(b, ctx) for b in (1, 4, 16, 32, 64, 128, 256) for ctx in (512, 1024, 2048, 4096)]
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "orchestrator" / "sim" / "calibration.json"  # CALIBRATION_FILE


def measure(system: str, precision: str) -> dict:
    from aiconfigurator_core.sdk import common, config
    from aiconfigurator_core.sdk.backends.factory import get_backend
    from aiconfigurator_core.sdk.models import get_model
    from aiconfigurator_core.sdk.perf_database import get_database

    quant = {} if precision == "bf16" else {"gemm_quant_mode": common.GEMMQuantMode.fp8,
                                             "kvcache_quant_mode": common.KVCacheQuantMode.fp8,
                                             "fmha_quant_mode": common.FMHAQuantMode.fp8}
    database = get_database(system, BACKEND, VERSION)
    model = get_model(MODEL, config.ModelConfig(tp_size=1, pp_size=1, **quant), BACKEND)
    backend = get_backend(BACKEND)

    def latency(batch: int, isl: int, osl: int, mode: str) -> float:
        runtime = config.RuntimeConfig(batch_size=batch, isl=isl, osl=osl)
        return round(backend.run_static_latency_only(model, database, runtime, mode, stride=1), 4)

    return {"prefill": [[batch, length, latency(batch, length, 1, "static_ctx")] for batch, length in PREFILL_GRID],
            "decode": [[batch, ctx, latency(batch, ctx, 2, "static_gen")] for batch, ctx in DECODE_GRID]}


def fit(points: dict) -> dict:
    import numpy as np

    def solve(rows, ys):
        rows, ys = np.array(rows, dtype=float), np.array(ys, dtype=float)
        weights = 1.0 / ys  # least squares on relative error
        coefficients, *_ = np.linalg.lstsq(rows * weights[:, None], ys * weights, rcond=None)
        return [float(c) for c in coefficients]

    a, b, c = solve([[1.0, batch * n, batch * n * n] for batch, n, _ in points["prefill"]],
                    [ms for *_, ms in points["prefill"]])
    d, e, f = solve([[1.0, batch * ctx, batch] for batch, ctx, _ in points["decode"]],
                    [ms for *_, ms in points["decode"]])
    return {"prefill_a": a, "prefill_b": b, "prefill_c": c, "decode_d": d, "decode_e": e, "decode_f": f}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    import aiconfigurator

    document: dict[str, Any] = {
        "source": f"aiconfigurator {aiconfigurator.__version__}, model {MODEL}, backend {BACKEND} "
                  f"{VERSION}, tp=1, static_ctx / static_gen(osl=2) latencies in ms",
        "profiles": {}}
    for name, (system, precision) in TARGETS.items():
        points = measure(system, precision)
        coefficients = fit(points)
        document["profiles"][name] = {"system": system, "precision": precision, **points,
                                      "fitted": coefficients}
        print(f"{name} ({system}, {precision}):")
        print("  " + ", ".join(f"{k}={v:.4g}" for k, v in coefficients.items()))
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
