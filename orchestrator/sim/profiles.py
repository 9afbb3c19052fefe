"""GPU cost profiles for the simulated worker: what one continuous-batching step costs.

    step_ms = prefill(a + b*L + c*sum(l_i^2))   if the step has prefill tokens (L = sum of chunks l_i)
            + decode(d + e*sum(context) + f*batch)  if the step has decoding requests

Pure data and arithmetic; the scheduler in scheduler.py decides what goes into each step.
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs

# aiconfigurator's reference latencies and the coefficients fitted to them (benchmarks/calibrate_profiles.py)
CALIBRATION_FILE = Path(__file__).with_name("calibration.json")


@attrs.frozen
class Profile:
    name: str
    source: str
    # prefill fit (ms): a + b*L + c*sum(l_i^2)
    prefill_a: float
    prefill_b: float
    prefill_c: float
    # decode fit (ms): d + e*sum(context tokens) + f*batch
    decode_d: float
    decode_e: float
    decode_f: float
    max_batch_size: int
    max_num_tokens: int  # tokens per step (prefill chunk tokens + one per decoding request)
    kv_block_size: int
    total_kv_blocks: int
    kv_bytes_per_token: int
    kv_bandwidth_bytes_per_s: float  # prefill -> decode transfer
    image_tokens: int  # prompt tokens one image expands into
    max_context_length: int
    max_output_tokens: int
    attention_dp_size: int = 1  # attention-DP ranks: each has its share of the KV blocks and its own prefix cache

    def prefill_ms(self, chunks: list[int]) -> float:
        if not chunks:
            return 0.0
        total = sum(chunks)
        return self.prefill_a + self.prefill_b * total + self.prefill_c * sum(c * c for c in chunks)

    def decode_ms(self, contexts: list[int]) -> float:
        if not contexts:
            return 0.0
        return self.decode_d + self.decode_e * sum(contexts) + self.decode_f * len(contexts)

    def step_ms(self, prefill_chunks: list[int], decode_contexts: list[int]) -> float:
        return self.prefill_ms(prefill_chunks) + self.decode_ms(decode_contexts)

    def kv_transfer_ms(self, tokens: int) -> float:
        return 1000.0 * tokens * self.kv_bytes_per_token / self.kv_bandwidth_bytes_per_s

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.kv_block_size)


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in [
        Profile(
            name="opt-13b-a100",
            # DistServe (Zhong et al., OSDI 2024), latency model fitted for OPT-13B on one A100-80GB.
            source="DistServe, OSDI 2024: public fit for OPT-13B on one A100 (ms)",
            prefill_a=16.46, prefill_b=0.0926, prefill_c=6.47e-6,
            decode_d=19.93, decode_e=6.27e-4, decode_f=0.0385,
            max_batch_size=128, max_num_tokens=4096,
            # 80 GB - 26 GB of fp16 weights, 90% for KV; OPT-13B: 2 * 40 layers * 5120 * 2 B per token
            kv_block_size=32, total_kv_blocks=1850, kv_bytes_per_token=819_200,
            kv_bandwidth_bytes_per_s=25e9,  # 200 Gb/s InfiniBand between the two GPUs' hosts
            image_tokens=576, max_context_length=2048, max_output_tokens=1024,
        ),
        # Llama-3.1-8B on one GPU under TensorRT-LLM, fitted to NVIDIA's aiconfigurator 0.12.0 (its perf database
        # of kernel timings collected on the GPU, backend trtllm 1.3.0rc20) by benchmarks/calibrate_profiles.py;
        # the reference grid is orchestrator/sim/calibration.json, and tests/unit/test_sim_calibration.py keeps every
        # point within 15%. KV: 32 layers x 8 KV heads x 128 dims x 2 (K and V) per token.
        Profile(
            name="llama3-8b-h100",
            source="aiconfigurator 0.12.0, h100_sxm, trtllm 1.3.0rc20, Llama-3.1-8B BF16 (calibration.json)",
            prefill_a=4.298, prefill_b=0.01907, prefill_c=7.125e-07,
            decode_d=6.669, decode_e=4.293e-05, decode_f=0.006598,
            max_batch_size=256, max_num_tokens=8192,
            # (80 GB x 0.9 - 16 GB of BF16 weights) / (32 tokens x 128 KiB) ~ 12,000 blocks
            kv_block_size=32, total_kv_blocks=12000, kv_bytes_per_token=131_072,
            kv_bandwidth_bytes_per_s=50e9,  # 400 Gb/s InfiniBand
            image_tokens=576, max_context_length=8192, max_output_tokens=4096,
        ),
        Profile(
            name="llama3-8b-h100-fp8",
            source="aiconfigurator 0.12.0, h100_sxm, trtllm 1.3.0rc20, Llama-3.1-8B FP8 GEMM/FMHA/KV "
                   "(calibration.json)",
            prefill_a=4.334, prefill_b=0.01349, prefill_c=4.203e-07,
            decode_d=5.223, decode_e=2.13e-05, decode_f=0.007102,
            max_batch_size=256, max_num_tokens=8192,
            # (80 GB x 0.9 - 8 GB of FP8 weights) / (32 tokens x 64 KiB of FP8 KV) ~ 30,000 blocks
            kv_block_size=32, total_kv_blocks=30000, kv_bytes_per_token=65_536,
            kv_bandwidth_bytes_per_s=50e9,
            image_tokens=576, max_context_length=8192, max_output_tokens=4096,
        ),
        Profile(
            name="llama3-8b-h200",
            source="aiconfigurator 0.12.0, h200_sxm, trtllm 1.3.0rc20, Llama-3.1-8B BF16 (calibration.json)",
            prefill_a=3.231, prefill_b=0.01873, prefill_c=5.959e-07,
            decode_d=5.195, decode_e=2.886e-05, decode_f=0.008804,
            max_batch_size=256, max_num_tokens=8192,
            # (141 GB x 0.9 - 16 GB of BF16 weights) / (32 tokens x 128 KiB) ~ 26,000 blocks
            kv_block_size=32, total_kv_blocks=26000, kv_bytes_per_token=131_072,
            kv_bandwidth_bytes_per_s=50e9,
            image_tokens=576, max_context_length=8192, max_output_tokens=4096,
        ),
    ]
}
DEFAULT_PROFILE = "llama3-8b-h100"
