"""`orchestrator bench trace`: the Mooncake-format replay (trace reading, prompt synthesis, the infinite-cache
oracle) and a short real-time run of the shipped synthetic trace against simulated workers with KV events."""

import json
from pathlib import Path

import pytest

from orchestrator.bench.trace import (
    TraceRequest,
    load_trace,
    oracle_cached,
    prompt_ids,
    replay,
    report,
    sample_conversations,
    summarize,
)
from orchestrator.testkit.plugin import write_config

SHIPPED = Path(__file__).resolve().parents[2] / "benchmarks" / "traces" / "synthetic_conversations.jsonl"


def test_equal_hash_ids_give_equal_token_blocks_and_the_rest_is_the_request_s_own():
    a = TraceRequest(0, 100, 8, (7, 8, 9), "x")
    b = TraceRequest(1, 90, 8, (7, 8, 5), "y")
    ids_a, ids_b = prompt_ids(a, 32, 1.0, salt=1), prompt_ids(b, 32, 1.0, salt=2)
    assert len(ids_a) == 100 and len(ids_b) == 90
    assert ids_a[:64] == ids_b[:64] and ids_a[64:90] != ids_b[64:90]
    assert prompt_ids(a, 32, 0.5, salt=1)[:16] == prompt_ids(b, 32, 0.5, salt=2)[:16]  # scaled blocks too


def test_the_oracle_counts_the_leading_blocks_an_earlier_request_had():
    first = TraceRequest(0, 100, 8, (1, 2, 3, 4), "x")
    again = TraceRequest(1, 130, 8, (1, 2, 3, 9, 10), "x")
    other = TraceRequest(2, 100, 8, (5, 2, 3, 4), "y")  # the same ids after a different first: a different chain
    assert oracle_cached([first, again, other], 32, 1.0) == [0, 96, 0]


def test_the_trace_is_read_in_time_order_and_sampled_by_whole_conversations(tmp_path):
    requests = load_trace(SHIPPED)
    assert len(requests) == 48 and [r.at_ms for r in requests] == sorted(r.at_ms for r in requests)
    half = sample_conversations(requests, 0.5, seed=3)
    kept = {r.conversation for r in half}
    assert len(kept) == 6 and all(r in half for r in requests if r.conversation in kept)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 5}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: expected timestamp"):
        load_trace(bad)


async def test_a_short_replay_of_the_shipped_trace_reports_hits_against_the_oracle(
        tmp_path, sim_workers, orchestrator_in_process):
    workers = [sim_workers.start("aggregated", "--time-scale", "0.02", "--kv-events") for _ in range(2)]
    config = write_config(tmp_path / "trace.yaml", "aggregated", {"aggregated": [w.address for w in workers]},
                          routing={"aggregated": "kv_aware"})
    requests = sample_conversations(load_trace(SHIPPED), 1.0, seed=0)[:16]
    async with orchestrator_in_process(config) as url:
        outcomes = await replay(url, requests, model="tiny-chat", block_size=512, time_scale=0.05,
                                length_scale=1 / 16)
    run = summarize("kv_aware", outcomes)
    assert run["completed"] == 16 and run["errors"] == 0, [o.error for o in outcomes if o.error]
    assert run["oracle_cached_tokens"] > 0 and 0 < run["cached_tokens"] <= run["oracle_cached_tokens"] * 1.05, run
    assert run["ttft_s"]["p50"] > 0 and run["itl_s"]["p99"] > 0  # (fast sim tokens often share one read)
    text = report([run], tmp_path / "out")
    assert "| kv_aware | 16/16 |" in text and (tmp_path / "out" / "report.md").exists()
