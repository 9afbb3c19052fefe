"""`orchestrator bench reuse`: seeded reuse workloads and the hit rates of today's routing, on the virtual clock."""

import attrs
import pytest

from orchestrator.bench.reuse import (
    ReuseCluster,
    ReuseTopology,
    ReuseWorkload,
    Session,
    draw_sessions,
    load_reuse_spec,
    main_reuse,
    summarize,
)
from orchestrator.config import ConfigError
from orchestrator.sim.profiles import PROFILES

PROFILE = PROFILES["llama3-8b-h100"]  # 32 tokens per block
CHAT = ReuseWorkload(name="chat", sessions=1, concurrency=1, system_prompt="1000", turns="3", user_len="100",
                     output_len="50", seed=4)


def run(workload, topology=ReuseTopology(workers=1), policy="round_robin"):
    return ReuseCluster(topology, policy, PROFILE).run(draw_sessions(workload, PROFILE), workload.concurrency)


def test_sessions_are_seeded_sized_as_asked_and_fit_the_context_window():
    workload = ReuseWorkload(name="w", sessions=20, system_prompt="1000:4000", turns="3:6", user_len="100:500",
                             output_len="100:300", image_share=0.5, seed=9)
    sessions = draw_sessions(workload, PROFILE)
    assert sessions == draw_sessions(workload, PROFILE)
    assert sessions != draw_sessions(attrs.evolve(workload, seed=10), PROFILE)
    for s in sessions:
        assert 1000 <= len(s.system) <= 4000 and all(100 <= len(m) <= 500 for m in s.messages)
        assert all(100 <= o <= 300 for o in s.outputs) and 1 <= len(s.messages) <= 6
        total = len(s.system) + (PROFILE.image_tokens if s.image else 0) + sum(map(len, s.messages)) + sum(s.outputs)
        assert total < PROFILE.max_context_length
    assert any(s.image for s in sessions) and not all(s.image for s in sessions)
    shared = draw_sessions(attrs.evolve(workload, kind="shared-prefix", groups=3), PROFILE)
    assert len({s.system for s in shared}) == 3 and all(len(s.messages) == 1 for s in shared)


def test_each_turn_resends_the_history_with_the_answers_and_reuses_all_of_it_on_one_worker():
    records = run(CHAT)
    assert [r.turn for r in records] == [1, 2, 3]
    assert [r.prompt_tokens for r in records] == [1100, 1250, 1400]  # + the last answer and a new message
    # a turn finds cached every full block of the previous prompt and its answer but the answer's last token
    assert [r.cached_tokens for r in records] == [0, (1100 + 49) // 32 * 32, (1250 + 49) // 32 * 32]
    assert records[1].ttft_s < records[0].ttft_s / 2  # in simulated time: about 100 tokens priced, not 1100


def test_round_robin_sends_the_next_turn_to_another_worker_where_nothing_is_cached():
    records = run(CHAT, ReuseTopology(workers=2))
    assert [r.cached_tokens for r in records] == [0, 0, (1100 + 49) // 32 * 32]  # back on the first worker
    assert summarize(records)["hit_rate"] == pytest.approx(records[2].cached_tokens / (1100 + 1250 + 1400))


def test_a_disaggregated_topology_counts_the_hits_of_the_prefill_which_caches_prompts_not_answers():
    records = run(CHAT, ReuseTopology(mode="disaggregated", workers=1, decode_workers=1))
    assert [r.prompt_tokens for r in records] == [1100, 1250, 1400]
    assert [r.cached_tokens for r in records] == [0, 1100 // 32 * 32, 1250 // 32 * 32]


def test_an_image_is_part_of_the_cached_prefix_by_its_identity():
    system, message = tuple(range(100, 1100)), tuple(range(5000, 5100))
    sessions = [Session(i, system, (message,), (20,), image=image) for i, image in enumerate(["cat", "dog", "cat"])]
    records = ReuseCluster(ReuseTopology(workers=1), "round_robin", PROFILE).run(sessions, 1)
    length = 1000 + PROFILE.image_tokens + 100
    # another image: only the system prompt's blocks before the image; the same image: everything reusable
    assert [r.cached_tokens for r in records] == [0, 1000 // 32 * 32, (length - 1) // 32 * 32]


def test_the_report_prints_hit_rates_and_ttft_by_turn(tmp_path, capsys):
    spec = tmp_path / "reuse.yaml"
    spec.write_text("policies: [round_robin, least_loaded]\ntopologies: [{mode: aggregated, workers: 2}]\n"
                    "workloads:\n  - {name: chat, sessions: 4, concurrency: 2, system_prompt: '1000', turns: '2', "
                    "user_len: '100', output_len: '20'}\n")
    assert main_reuse(spec, tmp_path / "out") == 0
    printed = capsys.readouterr().out
    assert "chat | aggregated 2x | round_robin: hit rate" in printed and "least_loaded" in printed
    assert "turn 1" in printed and "turn 2" in printed
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| aggregated 2x | round_robin | 8 |" in report and "TTFT p50 ms by turn" in report


@pytest.mark.parametrize("text, key, expected", [
    ("workloads: []", "workloads", "at least one workload"),
    ("policies: [kv]\nworkloads: [{name: a}]", "policies[0]", "round_robin or least_loaded"),
    ("workloads: [{name: a, kind: agents}]", "workloads[0].kind", "conversations or shared-prefix"),
    ("workloads: [{name: a, turns: '5:2'}]", "workloads[0].turns", "N or LOW:HIGH"),
    ("topologies: [{mode: disaggregated, workers: 1}]\nworkloads: [{name: a}]", "topologies[0].decode_workers",
     "> 0 for disaggregated"),
    ("workloads: [{name: a, image_share: 2}]", "workloads[0].image_share", "a number from 0 to 1"),
])
def test_a_bad_spec_names_the_file_the_key_and_what_was_expected(tmp_path, text, key, expected):
    spec = tmp_path / "bad.yaml"
    spec.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_reuse_spec(spec)
    assert error.value.key == key and expected in error.value.expected and error.value.file == str(spec)


@pytest.mark.parametrize("policy", ["kv_aware", "oracle"])
def test_kv_aware_and_the_oracle_keep_a_conversation_on_the_worker_that_holds_it(policy):
    one_worker = run(CHAT)
    records = run(CHAT, ReuseTopology(workers=2), policy)
    assert [r.cached_tokens for r in records] == [r.cached_tokens for r in one_worker]  # as if it had one worker
    image = attrs.evolve(CHAT, image_share=1.0)
    assert [r.cached_tokens > 1000 + PROFILE.image_tokens for r in run(image, ReuseTopology(workers=2), policy)] \
        == [False, True, True]  # the image is part of the prefix found cached
    split = run(CHAT, ReuseTopology(mode="disaggregated", workers=2, decode_workers=1), policy)
    assert [r.cached_tokens for r in split] == [0, 1100 // 32 * 32, 1250 // 32 * 32]


def test_the_kv_routing_report_compares_with_least_loaded_and_the_oracle(tmp_path):
    spec = tmp_path / "kv.yaml"
    spec.write_text("policies: [least_loaded, kv_aware, oracle]\ntopologies: [{mode: aggregated, workers: 2}]\n"
                    "event_delay_ms: 5\nkv_aware: {overlap_weight: 2}\n"
                    "workloads:\n  - {name: chat, sessions: 4, concurrency: 2, system_prompt: '1000', turns: '3', "
                    "user_len: '100', output_len: '20'}\n")
    assert main_reuse(spec, tmp_path / "out") == 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "overlap_weight 2" in report and "applied 5 ms after" in report
    assert "| aggregated 2x | kv_aware | " in report and "hit rate / oracle's" in report
    assert (tmp_path / "out" / "ttft.png").stat().st_size > 0 and (tmp_path / "out" / "hit_rate.png").exists()


def test_without_the_oracle_the_report_has_no_oracle_column_and_no_nan(tmp_path):
    spec = tmp_path / "kv.yaml"
    spec.write_text("policies: [round_robin, kv_aware]\ntopologies: [{mode: aggregated, workers: 2}]\n"
                    "workloads:\n  - {name: chat, sessions: 4, concurrency: 2, system_prompt: '1000', turns: '2', "
                    "user_len: '100', output_len: '20'}\n")
    assert main_reuse(spec, tmp_path / "out") == 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| aggregated 2x | kv_aware | " in report  # the ratios table is there
    assert "nan" not in report.lower() and "oracle's" not in report
    assert "| aggregated 2x | kv_aware | - | - | - |" in report  # least loaded was not run either: no ratio
