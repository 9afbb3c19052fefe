"""The kv_aware policy (pure): prefix affinity, the cost's trade-off against load, the hot-prefix guard, DP ranks,
approximate mode, replicas, and its configuration."""

import contextlib

import attrs
import pytest

from orchestrator import config as config_module
from orchestrator.config import ConfigError
from orchestrator.workers.kv_index import KvIndex, prompt_block_keys
from orchestrator.workers.routing import KvAware, KvAwareKnobs, LoadSample, make_policy

BLOCK = 4


@attrs.define(eq=False)
class FakeWorker:
    address: str
    requests: int = 0  # running + queued, as a fresh GetLoad says
    used_kv: int | None = None
    total_kv: int | None = None
    inflight: int = 0
    sent_since_load: int = 0
    finished_since_load: int = 0
    targets_dp_rank: bool = False
    dp_size: int = 1
    queued: int = 0  # of `requests`, those the engine has not admitted yet (holding no KV blocks)

    def fresh_load(self, now, staleness):
        return LoadSample(now, self.requests, self.used_kv, self.total_kv, self.queued)


def keys(tokens):
    return prompt_block_keys(tokens, BLOCK)


SYSTEM = list(range(1000, 1040))  # 10 blocks
PROMPT = keys(SYSTEM + [1, 2, 3, 4])  # 11 blocks


def events_index(**held):
    """An index fed as events would: `worker=n` holds the first n blocks of PROMPT."""
    index = KvIndex()
    for address, n in held.items():
        index.set_mode(address, "events")
        index.stored((address, 0), PROMPT[:n])
    return index


def test_a_prompt_goes_where_its_prefix_is_cached():
    workers = [FakeWorker("a", requests=1), FakeWorker("b", requests=1), FakeWorker("c", requests=1)]
    decision = KvAware(events_index(a=0, b=10, c=3), 1.0).decide(workers, 0.0, PROMPT)
    assert decision.worker.address == "b" and decision.reason == "prefix"
    assert decision.cached_blocks == 10 and decision.prompt_blocks == 11 and decision.rank is None


def test_without_a_cached_prefix_anywhere_it_goes_least_loaded():
    workers = [FakeWorker("a", requests=3), FakeWorker("b", requests=1), FakeWorker("c", requests=2)]
    decision = KvAware(events_index(a=0, b=0, c=0), 1.0).decide(workers, 0.0, PROMPT)
    assert decision.worker.address == "b" and decision.reason == "load"


def test_the_cost_weighs_uncached_blocks_against_load_in_blocks():
    # KV usage reported everywhere: load = blocks in use. b holds 10 of 11 blocks but has 30 more in use than a:
    # cost a = 11 + 0, b = 1 + 30 -> a; with overlap_weight 4: a = 44, b = 34 -> b.
    workers = [FakeWorker("a", 0, used_kv=0, total_kv=1000), FakeWorker("b", 0, used_kv=30, total_kv=1000)]
    assert KvAware(events_index(a=0, b=10), 1.0).decide(workers, 0.0, PROMPT).worker.address == "a"
    chosen = KvAware(events_index(a=0, b=10), 1.0, KvAwareKnobs(overlap_weight=4.0)).decide(workers, 0.0, PROMPT)
    assert chosen.worker.address == "b" and chosen.reason == "prefix"


def test_the_load_in_blocks_charges_queued_requests_an_average_running_requests_blocks():
    # a: 1 running (40 blocks) and 4 queued behind it, which hold no blocks yet; b: 2 running (140 blocks).
    # The average running request holds 60: a = 40 + 4 x 60 = 280 > b = 140, though a has fewer in use.
    workers = [FakeWorker("a", 5, used_kv=40, total_kv=1000, queued=4), FakeWorker("b", 2, used_kv=140, total_kv=1000)]
    decision = KvAware(events_index(a=0, b=0), 1.0).decide(workers, 0.0, PROMPT)
    assert decision.worker.address == "b" and decision.reason == "load"


def test_ties_go_to_the_worker_holding_more_of_the_prompt_then_in_rotation():
    workers = [FakeWorker("a", 0, used_kv=10, total_kv=1000), FakeWorker("b", 0, used_kv=20, total_kv=1000)]
    index = events_index(a=0, b=10)  # a: 11 + 10 = 21; b: 1 + 20 = 21: a tie, b computes less
    assert KvAware(index, 1.0).decide(workers, 0.0, PROMPT).worker.address == "b"
    idle = [FakeWorker("a"), FakeWorker("b")]
    policy = KvAware(KvIndex(), 1.0)
    assert {policy.decide(idle, 0.0, ()).worker.address for _ in range(2)} == {"a", "b"}


def test_the_hot_prefix_guard_sends_a_hot_prompt_elsewhere_when_its_holder_is_far_busier():
    knobs = KvAwareKnobs(overlap_weight=100.0, max_imbalance=4)  # a cache hit would win against any load
    busy = [FakeWorker("a", requests=5), FakeWorker("b", requests=0)]
    decision = KvAware(events_index(a=10, b=0), 1.0, knobs).decide(busy, 0.0, PROMPT)
    assert decision.worker.address == "b" and decision.reason == "hot_prefix_guard"
    within = [FakeWorker("a", requests=4), FakeWorker("b", requests=0)]
    assert KvAware(events_index(a=10, b=0), 1.0, knobs).decide(within, 0.0, PROMPT).worker.address == "a"
    # a request sent since the last sample counts as load too (a burst planned at once)
    burst = [FakeWorker("a", requests=4, sent_since_load=1), FakeWorker("b", requests=0)]
    assert KvAware(events_index(a=10, b=0), 1.0, knobs).decide(burst, 0.0, PROMPT).worker.address == "b"


def test_the_load_ceiling_voids_a_hit_on_a_worker_whose_kv_cache_is_nearly_full():
    index = events_index(a=10, b=0)
    knobs = KvAwareKnobs(overlap_weight=100.0, max_kv_usage=0.9)
    full = [FakeWorker("a", 1, used_kv=950, total_kv=1000), FakeWorker("b", 1, used_kv=900, total_kv=1000)]
    decision = KvAware(index, 1.0, knobs).decide(full, 0.0, PROMPT)
    assert decision.worker.address == "b" and decision.reason == "hot_prefix_guard"


def test_an_attention_dp_worker_that_takes_a_target_rank_gets_the_rank_holding_the_prefix():
    def ranks_index():
        index = events_index(b=0)
        index.set_mode("a", "events")
        index.stored(("a", 2), PROMPT[:8])
        index.stored(("a", 0), PROMPT[:2])
        return index

    targeting = FakeWorker("a", targets_dp_rank=True, dp_size=4)
    decision = KvAware(ranks_index(), 1.0).decide([targeting, FakeWorker("b")], 0.0, PROMPT)
    assert decision.worker is targeting and decision.rank == 2 and decision.cached_blocks == 8
    # without targeting the engine picks the rank: expect the mean over its 4 ranks, (8 + 2) / 4 -> 2 blocks
    plain = FakeWorker("a", dp_size=4)
    decision = KvAware(ranks_index(), 1.0).decide([plain, FakeWorker("b")], 0.0, PROMPT)
    assert decision.rank is None and decision.cached_blocks == 2


def test_a_worker_without_events_is_routed_by_what_we_sent_it():
    index = KvIndex()  # nobody set a mode: both approximate
    policy = KvAware(index, 1.0)
    workers = [FakeWorker("a"), FakeWorker("b")]
    first = policy.decide(workers, 0.0, PROMPT)
    assert first.reason == "load" and index.mode(first.worker.address) == "approximate"
    for i in range(3):  # the same prefix follows it, whatever the rotation says
        again = policy.decide(workers, 1.0, keys(SYSTEM + [9, 9, 9, i]))
        assert again.worker is first.worker and again.reason == "prefix" and again.cached_blocks == 10
    # the entries expire after the TTL
    assert policy.decide(workers, 1.0 + index.ttl_s + 1, keys(SYSTEM + [5, 5, 5, 5])).reason == "load"


def test_two_replicas_fed_the_same_events_decide_alike():
    def replica():
        index = KvIndex()
        for address, n in (("a", 3), ("b", 10), ("c", 6)):
            index.set_mode(address, "events")
            index.stored((address, 0), PROMPT[:n])
        return KvAware(index, 1.0)

    # requests x 11 blocks of load: (1, 6, 2): a 8 + 11, b guarded (5 above the least), c 5 + 22 -> a; then the
    # prompt is being computed on a (routed there, no event yet): (0, 9, 0) goes there too, where c would compute 5
    one, two = replica(), replica()
    loads = [[FakeWorker("a", r1), FakeWorker("b", r2), FakeWorker("c", r3)]
             for r1, r2, r3 in ((0, 0, 0), (1, 6, 2), (2, 3, 9), (0, 9, 0))]
    assert [one.decide(w, 0.0, PROMPT).worker.address for w in loads] == \
           [two.decide(w, 0.0, PROMPT).worker.address for w in loads] == ["b", "a", "a", "a"]


def test_make_policy_needs_an_index_for_kv_aware():
    with pytest.raises(ValueError, match="KV index"):
        make_policy("kv_aware", 1.0)
    assert isinstance(make_policy("kv_aware", 1.0, index=KvIndex()), KvAware)


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_kv_aware_is_configured_for_the_roles_that_prefill_and_its_knobs_are_checked(tmp_path):
    config = config_module.load(write(tmp_path, "mode: aggregated\nrouting:\n  aggregated: kv_aware\n  kv_aware:\n"
                                                "    overlap_weight: 2\n    max_imbalance: 8\n"))
    assert config.routing.kv_aware_roles == ("aggregated",) and config.routing.kv_aware.overlap_weight == 2
    assert config_module.load(write(tmp_path, "routing: {prefill: kv_aware}\n")).routing.kv_aware_roles == \
        ("prefill",)
    assert config_module.load(write(tmp_path, "mode: aggregated\n")).routing.kv_aware_roles == ()
    for text, key, expected in [
        ("routing: {decode: kv_aware}\n", "routing.decode", "round_robin or least_loaded"),
        ("routing: {prefill: kv_aware, kv_aware: {max_imbalance: -1}}\n", "routing.kv_aware.max_imbalance",
         "an integer >= 0"),
        ("routing: {prefill: kv_aware, kv_aware: {max_kv_usage: 1.5}}\n", "routing.kv_aware.max_kv_usage",
         "a number > 0 and <= 1"),
        ("routing: {prefill: kv_aware, kv_aware: {overlap_weight: 0}}\n", "routing.kv_aware.overlap_weight",
         "a number > 0"),
        ("routing: {prefill: kv_aware, kv_aware: {overlap: 1}}\n", "routing.kv_aware", "overlap"),
    ]:
        path = write(tmp_path, text)
        with pytest.raises(ConfigError) as error:
            config_module.load(path)
        assert error.value.file == str(path) and error.value.key.startswith(key), (text, error.value)
        assert expected in str(error.value), (text, error.value)


def test_a_prompts_keys_place_each_image_after_its_placeholder_and_key_it_by_identity():
    import base64
    import hashlib

    from orchestrator.convert.media import ImageRef
    from orchestrator.workers.kv_index import PromptImage
    from orchestrator.workers.prompt_keys import identity_of, request_block_keys

    png = b"\x89PNG fake bytes"
    by_bytes = ImageRef(data_uri="data:image/png;base64," + base64.b64encode(png).decode())
    assert identity_of(by_bytes) == "sha256:" + hashlib.sha256(png).hexdigest()
    assert identity_of(ImageRef(url="http://x/cat.jpg", uuid="cat-1")) == "cat-1"
    assert identity_of(ImageRef(url="http://x/cat.jpg")) != identity_of(ImageRef(url="http://x/dog.jpg"))
    placeholder, text = 7, list(range(1000, 1040))
    prompt = text[:10] + [placeholder] + text[10:]
    # the length the events showed for this image wins over the configured one
    keys = request_block_keys(prompt, BLOCK, [by_bytes], placeholder, image_tokens=3, learned=lambda _: 6)
    engine = text[:10] + [placeholder] + [0] * 6 + text[10:]
    assert keys == prompt_block_keys(engine, BLOCK, [PromptImage(identity_of(by_bytes), 11, 6)])
    assert request_block_keys(prompt, BLOCK, [by_bytes], placeholder, image_tokens=6) == keys
    # another image: the blocks before it agree, the one covering it and every later one do not
    other = request_block_keys(prompt, BLOCK, [ImageRef(url="http://x/dog.jpg")], placeholder, image_tokens=6)
    assert other[:2] == keys[:2] and all(a != b for a, b in zip(other[2:], keys[2:]))
    assert request_block_keys(text, BLOCK) == prompt_block_keys(text, BLOCK)  # no images: the text's keys


@contextlib.asynccontextmanager
async def conditional_deployment(tmp_path, prefill_block: int, decode_block: int):
    """A WorkerPool of scripted workers (one prefill, two decode: the given KV block sizes), conditional mode with
    routing.prefill: kv_aware and max_local_prefill_length 40, and a Coordinator over it."""
    from orchestrator.engine import LoopThread
    from orchestrator.flow.coordinator import Coordinator
    from orchestrator.metrics import Metrics
    from orchestrator.models import TINY_CHAT
    from orchestrator.testkit.fakes import FakeEngineClient, capabilities, fake_worker
    from orchestrator.testkit.plugin import write_config
    from orchestrator.tokenizer import ModelTokenizer
    from orchestrator.workers.kv_routing import KvRouting
    from orchestrator.workers.pool import WorkerPool

    config = config_module.load(write_config(tmp_path / "c.yaml", "conditional", {}, routing={"prefill": "kv_aware"},
                                             conditional={"max_local_prefill_length": 40}))

    def worker(role: str, name: str, block_size: int):
        caps = attrs.evolve(capabilities(role), models=("tiny-chat",), model_id="tiny-chat", kv_block_size=block_size)
        return fake_worker(role, FakeEngineClient(name, caps))

    workers = [worker("prefill", "p0", prefill_block), worker("decode", "d0", decode_block),
               worker("decode", "d1", decode_block)]
    async with LoopThread.open() as loop_thread:
        pool = WorkerPool(loop_thread=loop_thread, metrics=Metrics(), routing=config.routing, model="tiny-chat",
                          kv=KvRouting(KvIndex(), None, roles=config.kv_aware_roles, follow_roles=()))
        pool.workers.update((w.spec, w) for w in workers)
        yield pool, Coordinator(config, pool, ModelTokenizer.from_dir(TINY_CHAT), Metrics())


def completion(ids: list[int]):
    from orchestrator.convert import parse_completion

    return parse_completion({"model": "tiny-chat", "prompt": ids, "max_tokens": 1})


async def test_conditional_mode_finds_the_decode_holder_when_its_blocks_differ_from_the_prefill_ones(tmp_path):
    """The keys a decode worker's holding is asked with are cut in ITS block size (16 here; prefill's is 32),
    and its held blocks count in that size: the decode worker holding the prompt's prefix (its events key
    blocks of 16) runs the request itself, the remainder being within max_local_prefill_length."""
    ids = list(range(100, 300))  # 200 tokens: 12 blocks of 16 (8 left), 6 of 32 (8 left)
    async with conditional_deployment(tmp_path, prefill_block=32, decode_block=16) as (pool, coordinator):
        index = pool.kv_index
        assert index is not None
        holder = "grpc://d1"
        index.set_mode(holder, "events")
        index.stored((holder, 0), prompt_block_keys(ids, 16)[:11])  # all but the last full block: 24 to compute
        plan = await coordinator.plan(completion(ids), "r1")
        assert (plan.path, [w.address for w in plan.workers]) == ("local", [holder])


async def test_a_short_prompt_in_conditional_mode_computes_no_block_keys(tmp_path, monkeypatch):
    """The local path (a prompt within max_local_prefill_length) asks no kv_aware role: no keys are cut for it;
    a longer one is cut once per block size it is asked in (decode's for a holder, then prefill's)."""
    from orchestrator.flow import coordinator as coordinator_module

    cut: list[int] = []

    def counting(prompt_ids, block_size, *args, **kwargs):
        cut.append(block_size)
        return request_block_keys(prompt_ids, block_size, *args, **kwargs)
    request_block_keys = coordinator_module.request_block_keys
    monkeypatch.setattr(coordinator_module, "request_block_keys", counting)
    async with conditional_deployment(tmp_path, prefill_block=32, decode_block=16) as (_, coordinator):
        plan = await coordinator.plan(completion(list(range(100, 130))), "short")
        assert plan.path == "local" and cut == []
        plan = await coordinator.plan(completion(list(range(100, 300))), "long")
        assert plan.path == "disaggregated" and sorted(cut) == [16, 32]


def test_a_salted_prompt_matches_no_block_of_another_salt_or_of_none():
    from orchestrator.workers.prompt_keys import request_block_keys, salted

    plain = request_block_keys(list(range(64)), 16)
    a, b = salted(list(plain), "tenant-a"), salted(list(plain), "tenant-b")
    assert a[0] != plain[0] and b[0] != plain[0] and a[0] != b[0] and a[1:] == plain[1:]
    assert salted(list(plain), "tenant-a") == a and salted(list(plain), None) == plain
    index = KvIndex()
    index.stored(("w", 0), a)
    assert index.overlap(a, 0.0) == {("w", 0): 4} and index.overlap(b, 0.0) == {} and index.overlap(plain, 0.0) == {}


def test_a_request_of_ours_finished_since_the_load_sample_no_longer_counts_against_its_cached_prefix():
    # a's sample was read while our last request ran there (1 request, 40 blocks): it has finished since
    ran_there = FakeWorker("a", 1, used_kv=40, total_kv=1000, finished_since_load=1)
    decision = KvAware(events_index(a=10, b=0), 1.0).decide([ran_there, FakeWorker("b", 0, used_kv=0, total_kv=1000)],
                                                            0.0, PROMPT)
    assert decision.worker.address == "a" and decision.cached_blocks == 10
    # still running (nothing finished): 1 + 40 against 11, b
    running = FakeWorker("a", 1, used_kv=40, total_kv=1000)
    assert KvAware(events_index(a=10, b=0), 1.0).decide([running, FakeWorker("b", 0, used_kv=0, total_kv=1000)],
                                                        0.0, PROMPT).worker.address == "b"


def test_a_burst_follows_the_first_request_to_the_worker_computing_its_prefix():
    """Requests sharing a prompt decided one after another before any load sample or event: the first goes by
    load, the others follow it (the prefix counts as being computed there, and what it computes is not charged
    to them), within the hot-prefix guard (max_imbalance 4: the sixth goes elsewhere)."""
    index = events_index(a=0, b=0, c=0)
    policy = KvAware(index, 1.0)
    workers = [FakeWorker(name, 0, used_kv=0, total_kv=1000) for name in "abc"]
    chosen = []
    for _ in range(6):
        decision = policy.decide(workers, 0.0, PROMPT)
        decision.worker.sent_since_load += 1  # as the pool counts a pick
        chosen.append((decision.worker.address, decision.cached_blocks))
    first = chosen[0][0]
    assert chosen[:5] == [(first, 0)] + [(first, 11)] * 4, chosen
    assert chosen[5][0] != first, chosen
