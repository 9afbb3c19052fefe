"""The simulated worker's prefix cache (orchestrator/sim/prefix_cache.py), pure: keys, reuse, pinning,
eviction and the events it queues. Upstream facts are cited in the module's docstring; the key and hash
checks below recompute them independently from those descriptions."""

import hashlib
from typing import Any

import pytest

from orchestrator.sim.prefix_cache import (
    ROOT_KEY,
    BlockRemoved,
    BlockStored,
    MmKey,
    PrefixCache,
    block_key,
    expanded_image,
    image_digest,
    prompt_tokens,
    wire_hash,
)

BS = 4  # tokens per block in these tests


def seq(n, start=100):
    return tuple(range(start, start + n))


def test_keys_are_the_v2_block_keys_and_the_wire_hash_is_their_first_8_bytes_signed():
    # RootBlock.make_key(ReuseScope()) = sha256(b"\x00"); Block.make_key = sha256(parent key + 4-byte LE tokens)
    assert ROOT_KEY == hashlib.sha256(b"\x00").digest()
    first = block_key(ROOT_KEY, (1, 2, 3, 4))
    assert first == hashlib.sha256(ROOT_KEY + b"".join(t.to_bytes(4, "little") for t in (1, 2, 3, 4))).digest()
    second = block_key(first, (5, 6, 7, 8))
    assert second != block_key(ROOT_KEY, (5, 6, 7, 8))  # chained to the parent
    # StreamingEventSink::wireHash: big-endian uint64 of the first 8 bytes, two's complement
    high = bytes([0xFF] * 8) + bytes(24)
    assert wire_hash(high) == -1 and wire_hash(bytes(7) + b"\x05" + bytes(24)) == 5


def test_an_image_is_keyed_by_its_digest_then_ids_above_the_vocabulary():
    content = "sha256:" + "ab" * 32
    assert image_digest(content) == bytes([0xAB] * 32)  # a content digest is used as it is
    assert image_digest("user-uuid-1") == hashlib.sha256(b"user-uuid-1").digest()
    assert expanded_image("user-uuid-1", 4, id_offset=1000) == [image_digest("user-uuid-1"), 1001, 1002, 1003]
    # placeholders keep their place; each image's tokens follow its own placeholder
    tokens = prompt_tokens((7, 9, 8, 9), ["a", "b"], image_tokens=2, id_offset=50, placeholder=9)
    assert tokens == (7, 9, image_digest("a"), 51, 8, 9, image_digest("b"), 51)
    # without a placeholder, images come first, in order
    assert prompt_tokens((7,), ["a"], image_tokens=2, id_offset=50, placeholder=None) == (image_digest("a"), 51, 7)


def test_a_second_request_reuses_the_full_blocks_of_a_shared_prefix_but_never_its_last_token():
    cache = PrefixCache(BS)
    first = cache.acquire(seq(10))
    assert first.cached_tokens == 0
    cache.store(first, seq(10))  # two full blocks; the tail of 2 is not cached
    assert cache.resident == 2 and first.owned == 2
    cache.release(first)
    assert cache.acquire(seq(9)).cached_tokens == 8  # shares both blocks
    assert cache.acquire(seq(8)).cached_tokens == 4  # the last token is always computed: one block only
    assert cache.acquire(seq(10, start=5)).cached_tokens == 0  # another prefix
    assert cache.acquire((*seq(4), 0, 0, 0, 0, 1)).cached_tokens == 4  # diverges in the second block


def test_images_hit_only_with_the_same_image_at_the_same_place():
    cache = PrefixCache(BS, id_offset=1000)

    def tokens(image):
        return prompt_tokens((1, 2, 9, 3, 4, 5, 6, 7, 8), [image], image_tokens=6, id_offset=1000, placeholder=9)

    lease = cache.acquire(tokens("cat"))
    cache.store(lease, tokens("cat"))
    cache.release(lease)
    assert cache.acquire(tokens("cat")).cached_tokens == 12
    assert cache.acquire(tokens("dog")).cached_tokens == 0  # the image is in the first block already


def test_stores_that_extend_a_chain_are_one_event_and_removals_coalesce():
    cache = PrefixCache(BS)
    lease = cache.acquire(seq(12))
    cache.store(lease, seq(8))  # prefill done: 2 blocks
    cache.store(lease, seq(12))  # the answer: 1 more block, same chain
    (stored,) = cache.take_events()
    assert isinstance(stored, BlockStored) and stored.parent_block_hash is None
    assert len(stored.block_hashes) == 3 and stored.token_ids == seq(12) and stored.block_size == BS
    assert set(stored.block_hashes) == cache.hashes()
    cache.release(lease)
    assert cache.evict(3) == 3
    (removed,) = cache.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == tuple(reversed(stored.block_hashes))
    assert cache.take_events() == [] and cache.resident == 0


def test_a_chain_stored_under_an_existing_parent_names_that_parent():
    cache = PrefixCache(BS)
    a = cache.acquire(seq(9))
    cache.store(a, seq(8))
    cache.release(a)
    root_events = cache.take_events()
    b = cache.acquire((*seq(8), 1, 2, 3, 4, 5))
    cache.store(b, (*seq(8), 1, 2, 3, 4, 5))
    (stored,) = cache.take_events()
    assert isinstance(stored, BlockStored) and isinstance(root_events[0], BlockStored)
    assert stored.parent_block_hash == root_events[0].block_hashes[-1] and stored.token_ids == (1, 2, 3, 4)


def test_pinned_blocks_are_never_evicted_and_unpinned_ones_go_least_recently_used_first():
    cache = PrefixCache(BS)
    leases = {}
    for name, start in (("old", 0), ("mid", 100), ("new", 200)):
        leases[name] = cache.acquire(seq(5, start))
        cache.store(leases[name], seq(5, start))
    cache.release(leases["old"])
    cache.release(leases["mid"])
    assert cache.retained == 2 and cache.unpinned == 2
    cache.take_events()
    assert cache.evict(5) == 2  # "new" is still in use
    (removed,) = cache.take_events()
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == (wire_hash(block_key(ROOT_KEY, seq(4, 0))),
                                    wire_hash(block_key(ROOT_KEY, seq(4, 100))))
    assert cache.resident == 1 and cache.acquire(seq(5, 200)).cached_tokens == 4


def test_reuse_refreshes_recency_and_leaves_go_before_their_parents():
    cache = PrefixCache(BS)
    long_ = cache.acquire(seq(13))
    cache.store(long_, seq(13))  # blocks A B C
    cache.release(long_)
    other = cache.acquire(seq(5, 500))
    cache.store(other, seq(5, 500))  # block D, newer than A B C
    cache.release(other)
    again = cache.acquire(seq(5))  # touches A only
    cache.release(again)
    cache.take_events()
    cache.evict(2)  # C then B: leaves first, even though A was touched last among them
    (removed,) = cache.take_events()
    assert isinstance(removed, BlockRemoved)
    a = block_key(ROOT_KEY, seq(4))
    b = block_key(a, seq(4, 104))
    c = block_key(b, seq(4, 108))
    assert removed.block_hashes == (wire_hash(c), wire_hash(b))
    cache.evict(1)
    (removed,) = cache.take_events()
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == (wire_hash(block_key(ROOT_KEY, seq(4, 500))),)  # D is older than A


def test_a_reservation_pays_for_what_its_request_stored_and_the_cache_retains_it_afterwards():
    cache = PrefixCache(BS)
    a = cache.acquire(seq(9))
    cache.store(a, seq(9))
    assert cache.retained == 0  # paid for by a's reservation
    b = cache.acquire(seq(9))  # shares a's blocks while a still runs
    cache.store(b, seq(9))
    assert b.owned == 0 and b.cached_tokens == 8
    cache.release(a)
    assert cache.retained == 2 and cache.unpinned == 0  # b still uses them
    assert cache.evict(2) == 0
    cache.release(b)
    assert cache.unpinned == 2 and cache.evict(2) == 2 and cache.retained == 0


def test_a_disabled_cache_reuses_nothing_and_says_nothing():
    cache = PrefixCache(BS, enabled=False)
    lease = cache.acquire(seq(9))
    cache.store(lease, seq(9))
    cache.release(lease)
    assert cache.acquire(seq(9)).cached_tokens == 0 and cache.resident == 0 and cache.take_events() == []


def test_image_segments_of_stored_blocks_are_listed_per_block_when_asked_for():
    cache = PrefixCache(BS, mm_keys=True, id_offset=1000)
    tokens = prompt_tokens((1, 9, 2, 3, 4), ["cat"], image_tokens=6, id_offset=1000, placeholder=9)
    # (1, 9, D, 1001) (1002, 1003, 1004, 1005) (2, 3, 4) - the last block is not full
    lease = cache.acquire(tokens)
    cache.store(lease, tokens)
    (stored,) = cache.take_events()
    assert isinstance(stored, BlockStored)
    digest = image_digest("cat").hex()
    assert stored.mm_keys == ((MmKey(digest, 0),), (MmKey(digest, 2),))
    assert stored.token_ids[2] == image_digest("cat")


@pytest.mark.parametrize("size", [0, -1])
def test_a_block_size_below_one_is_refused(size):
    with pytest.raises(ValueError):
        PrefixCache(size)


# ---- through the scheduler: what reuse buys in simulated time, and what capacity pressure does ----------

from orchestrator.sim.output import Vocabulary  # noqa: E402
from orchestrator.sim.profiles import PROFILES  # noqa: E402
from orchestrator.sim.scheduler import CONTEXT_ONLY, FULL, GENERATION_ONLY, Scheduler, SimRequest  # noqa: E402

PROFILE = PROFILES["llama3-8b-h100"]  # 32 tokens per block


def run(scheduler):
    """Step until idle; returns the priced ms of every step."""
    steps = []
    while (step := scheduler.plan_step()) is not None:
        steps.append(step.ms)
        scheduler.finish_step(step)
    return steps


def request(rid, tokens, kind=FULL, max_tokens=4):
    return SimRequest(request_id=rid, kind=kind, prompt_len=len(tokens), key=len(tokens), max_tokens=max_tokens,
                      ignore_eos=True, tokens=tuple(tokens))


def scheduler(**kw):
    return Scheduler(PROFILE, "aggregated", Vocabulary([1, 2, 3], eos_id=0), **kw)


def test_a_request_sharing_a_prefix_reports_it_cached_and_prefills_faster_in_simulated_time():
    s = scheduler()
    system = tuple(range(1000, 3000))  # a 2000-token system prompt
    first = request("a", system + tuple(range(10, 110)))
    s.submit(first)
    run(s)
    first_ms, first_tokens = s.prefill_ms_total, s.prefill_tokens_computed
    second = request("b", system + tuple(range(200, 300)))
    s.submit(second)
    run(s)
    assert first.cached == 0 and second.cached == 2000 - 2000 % 32  # the shared full blocks
    assert s.prefill_tokens_computed - first_tokens == second.prompt_len - second.cached
    assert s.prefill_ms_total - first_ms < first_ms / 5  # 128 tokens priced instead of 2100
    assert s.cached_tokens_total == second.cached and s.prompt_tokens_total == first.prompt_len + second.prompt_len


def test_without_reuse_admission_and_prices_are_those_of_a_worker_without_a_cache():
    def priced(**kw):
        s = scheduler(total_kv_blocks=40, **kw)
        for i in range(6):
            s.submit(request(f"r{i}", tuple(range(i * 10_000, i * 10_000 + 500)), max_tokens=200))
        return run(s)

    assert priced() == priced(prefix_caching=False)


def test_capacity_pressure_evicts_unused_cached_blocks_and_never_ones_in_use():
    s = scheduler(total_kv_blocks=10)
    rank = s.ranks[0]
    s.submit(request("old", tuple(range(0, 200)), max_tokens=1))  # 7 blocks reserved, 6 cached after
    run(s)
    assert rank.used_blocks == 0 and rank.cache.retained == 6
    s.submit(request("new", tuple(range(5000, 5200)), max_tokens=1))  # needs 7 of the 4 free: 3 evicted
    run(s)
    assert rank.cache.evicted_total == 3 and rank.cache.retained == 9
    # what is left of "old" is its first three blocks (its leaves went first); they are pinned while
    # "again" runs, so making its room evicts three of "new"'s blocks instead
    again = request("again", tuple(range(0, 200)), max_tokens=1)
    s.submit(again)
    run(s)
    assert again.cached == 3 * 32 and rank.cache.evicted_total == 6


def test_a_request_waits_when_only_pinned_blocks_could_make_room():
    s = scheduler(total_kv_blocks=8)
    long_running = request("long", tuple(range(0, 160)), max_tokens=64)  # 7 blocks
    s.submit(long_running)
    step = s.plan_step()
    s.finish_step(step)  # prefilled: its 5 prompt blocks are cached and pinned
    blocked = request("blocked", tuple(range(900, 1000)), max_tokens=1)  # needs 4
    s.submit(blocked)
    s.plan_step()
    assert blocked.state == "waiting" and s.ranks[0].cache.evicted_total == 0


def test_prefill_then_decode_hold_the_blocks_on_both_workers_and_a_follow_up_reuses_the_answer():
    prefill, decode = scheduler(), scheduler()
    prompt = tuple(range(100, 300))
    context = request("ctx", prompt, kind=CONTEXT_ONLY, max_tokens=1)
    handed: dict[str, Any] = {}
    context.on_context_done = lambda r, token: handed.update(token=token, lease=r.lease, blocks=r.blocks)
    prefill.submit(context)
    run(prefill)
    assert prefill.ranks[0].cache.resident == 200 // 32
    prefill.release_blocks(handed["blocks"], 0, handed["lease"])  # the decode pulled the session
    assert prefill.ranks[0].cache.retained == 200 // 32
    generation = request("gen", prompt, kind=GENERATION_ONLY, max_tokens=60)
    generation.first_gen_tokens = (handed["token"],)
    decode.submit(generation)
    run(decode)
    cache = decode.ranks[0].cache
    assert cache.resident == (200 + 60 - 1) // 32  # the pulled prompt and the answer
    follow_up = request("turn2", (*prompt, *generation.output_ids, *range(7000, 7050)))
    decode.submit(follow_up)
    run(decode)
    assert follow_up.cached == (200 + 60 - 1) // 32 * 32


def test_attention_dp_ranks_split_the_blocks_and_cache_separately():
    s = scheduler(total_kv_blocks=101, attention_dp_size=2)
    assert [r.total_blocks for r in s.ranks] == [51, 50] and s.total_blocks == 101
    events = []
    s.on_kv_events = lambda rank, batch: events.append((rank, batch))
    a, b = request("a", tuple(range(0, 100))), request("b", tuple(range(0, 100)))
    s.submit(a)
    s.submit(b)
    run(s)
    # two requests at once land on different ranks: neither finds the other's blocks
    assert {a.rank, b.rank} == {0, 1} and a.cached == b.cached == 0
    assert sorted({rank for rank, _ in events}) == [0, 1]
    assert s.ranks[0].cache.hashes() == s.ranks[1].cache.hashes()


def test_requests_with_different_cache_salts_never_share_blocks():
    """UPSTREAM cache-salt: a salted request's chains start at its own reuse scope (TensorRT-LLM ReuseScope)."""
    cache = PrefixCache(BS)
    first = cache.acquire(seq(10), "tenant-a")
    cache.store(first, seq(10))
    cache.release(first)
    assert cache.acquire(seq(10), "tenant-a").cached_tokens == 8
    assert cache.acquire(seq(10), "tenant-b").cached_tokens == 0
    assert cache.acquire(seq(10)).cached_tokens == 0  # no salt is a scope of its own too
