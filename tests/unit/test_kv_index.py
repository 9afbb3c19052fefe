"""The KV prefix index (orchestrator/workers/kv_index.py), pure: what its keys and answers must be.

The engine side of the image cases is the simulated worker's prefix cache (orchestrator/sim/prefix_cache.py),
which keys and publishes image blocks as TensorRT-LLM's KV cache manager V2 does (its docstring cites the
upstream files): the events it emits, decoded as the feed decodes them, must give the keys a prompt gives.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys

import pytest

from orchestrator.sim.kv_events import wire_event
from orchestrator.sim.prefix_cache import PrefixCache, prompt_tokens
from orchestrator.workers.kv_event_codec import apply_now, decode_wire_batch
from orchestrator.workers.kv_index import (
    IMAGE_BIT,
    MAX_IMAGE_LENGTHS,
    MAX_IMAGE_POSITIONS,
    EventBlockError,
    KvIndex,
    MmSegment,
    PromptImage,
    engine_layout,
    event_block_keys,
    image_digest,
    image_identity,
    prompt_block_keys,
)

A, B = ("a", 0), ("b", 0)


def ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(length)]


def events_index(*workers: str) -> KvIndex:
    index = KvIndex(ttl_s=10.0)
    for worker in workers:
        index.set_mode(worker, "events")
    return index


# ---- keys ---------------------------------------------------------------------------------------------------

def test_keys_cover_full_blocks_only_and_chain_on_their_parent():
    tokens = ids(1, 100)
    keys = prompt_block_keys(tokens, 32)
    assert len(keys) == 3  # the trailing 4 tokens are no block
    assert prompt_block_keys(tokens[:96], 32) == keys
    assert prompt_block_keys(tokens[:95], 32) == keys[:2]
    assert prompt_block_keys([], 32) == [] and prompt_block_keys(tokens, 200) == []
    changed = list(tokens)
    changed[0] += 1  # a change in the first block changes every key after it: they are chained
    assert all(a != b for a, b in zip(prompt_block_keys(changed, 32), keys))
    changed = list(tokens)
    changed[40] += 1
    assert prompt_block_keys(changed, 32)[0] == keys[0] and prompt_block_keys(changed, 32)[1:] != keys[1:]
    # the same block after another prefix is another key
    assert prompt_block_keys(tokens[32:64], 32)[0] != keys[1]
    assert all(not key & IMAGE_BIT for key in keys)
    assert prompt_block_keys(tuple(tokens), 32) == keys
    with pytest.raises(ValueError):
        prompt_block_keys(tokens, 0)


def test_keys_are_the_same_in_every_process_whatever_its_hash_seed():
    # replicas compute keys independently; ints hash the same everywhere, and image identities are hashed
    # with sha256 first, so PYTHONHASHSEED must not matter
    script = ("from orchestrator.workers.kv_index import prompt_block_keys, PromptImage\n"
              "print(prompt_block_keys(list(range(300)), 16, [PromptImage('img', 40, 50)]))")
    outputs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outputs) == 1
    assert outputs.pop().strip() == str(prompt_block_keys(list(range(300)), 16, [PromptImage("img", 40, 50)]))


def test_an_image_keys_its_blocks_by_identity_not_by_the_ids_at_its_positions():
    tokens = ids(2, 200)
    image = [PromptImage("uuid-1", 40, 70)]  # covers blocks 1..3 of 32 (40..110)
    keys = prompt_block_keys(tokens, 32, image)
    other_ids = list(tokens)
    other_ids[50:100] = [7] * 50
    assert prompt_block_keys(other_ids, 32, image) == keys  # image positions: the identity, not the ids
    other_image = prompt_block_keys(tokens, 32, [PromptImage("uuid-2", 40, 70)])
    assert other_image[0] == keys[0] and all(a != b for a, b in zip(other_image[1:], keys[1:]))
    moved = prompt_block_keys(tokens, 32, [PromptImage("uuid-1", 41, 70)])
    assert moved[0] == keys[0] and moved[1] != keys[1]
    text_only = prompt_block_keys(tokens, 32)
    assert keys[0] == text_only[0] and keys[1] != text_only[1]
    # the image bit: set on the first block the image covers and on every block after it
    assert [bool(k & IMAGE_BIT) for k in keys] == [False, True, True, True, True, True]
    # an empty image is no image
    assert prompt_block_keys(tokens, 32, [PromptImage("uuid-1", 40, 0)]) == text_only


def test_images_must_not_overlap_or_leave_the_sequence():
    tokens = ids(3, 100)
    with pytest.raises(ValueError):
        prompt_block_keys(tokens, 32, [PromptImage("x", 10, 20), PromptImage("y", 25, 5)])
    with pytest.raises(ValueError):
        prompt_block_keys(tokens, 32, [PromptImage("x", 90, 20)])
    # several images in one block, and images in any order
    two = [PromptImage("y", 50, 3), PromptImage("x", 40, 5)]
    assert prompt_block_keys(tokens, 32, two) == prompt_block_keys(tokens, 32, two[::-1])


def test_an_image_identity_is_its_uuid_else_the_digest_of_its_bytes():
    assert image_identity(uuid="u1", data=b"png") == "u1"
    by_bytes = image_identity(data=b"png")
    assert by_bytes == "sha256:" + hashlib.sha256(b"png").hexdigest()
    assert image_digest(by_bytes) == hashlib.sha256(b"png").digest()  # the engine's media hash of the bytes
    assert image_digest("u1") == hashlib.sha256(b"u1").digest()
    assert image_identity(url="https://x/y.png") != image_identity(data=b"https://x/y.png")
    with pytest.raises(ValueError):
        image_identity()


def sim_events_index(tokens, images, *, block_size, image_tokens, id_offset, placeholder):
    """Run one request through the simulated worker's prefix cache and feed its events to an index."""
    cache = PrefixCache(block_size, mm_keys=True, id_offset=id_offset)
    sequence = prompt_tokens(tokens, images, image_tokens=image_tokens, id_offset=id_offset,
                             placeholder=placeholder)
    lease = cache.acquire(sequence)
    cache.store(lease, sequence)
    index = events_index("w")
    apply_wire_events(index, ("w", 0), [wire_event(event, mm_keys=True) for event in cache.take_events()])
    return index, sequence


@pytest.mark.parametrize("seed", range(40))
def test_the_engines_events_give_the_keys_the_same_prompt_gives(seed):
    rng = random.Random(seed)
    block, image_tokens, vocab, placeholder = rng.choice([4, 16, 32]), rng.choice([2, 5, 40, 100]), 1000, 999
    text: list[int] = []
    identities = []
    for _ in range(rng.randrange(0, 4)):
        text += [rng.randrange(vocab - 1) for _ in range(rng.randrange(0, 50))]
        text.append(placeholder)
        identities.append(rng.choice(["u1", "u2", image_identity(data=bytes([rng.randrange(3)]))]))
    text += [rng.randrange(vocab - 1) for _ in range(rng.randrange(1, 80))]
    index, sequence = sim_events_index(text, identities, block_size=block, image_tokens=image_tokens,
                                       id_offset=vocab, placeholder=placeholder)
    # the prompt as the engine lays it out: each image's positions right after its placeholder
    engine_ids, images = [], []
    pending = iter(identities)
    for token in text:
        engine_ids.append(token)
        if token == placeholder:
            images.append(PromptImage(next(pending), len(engine_ids), image_tokens))
            engine_ids += [0] * image_tokens
    assert len(engine_ids) == len(sequence)
    keys = prompt_block_keys(engine_ids, block, images)
    assert index.overlap(keys, 0.0) == ({("w", 0): len(keys)} if keys else {})
    assert index.blocks() == len(keys)


def test_a_one_position_image_is_exact_once_the_workers_id_offset_is_known():
    # a one-position image followed by text: its end shows only with the engine's id_offset, which the index
    # learns from a block that starts inside an image
    text = [5, 999, 6, 7, 8, 9, 10, 11, 12, 13]
    index, _ = sim_events_index(text, ["u1"], block_size=4, image_tokens=1, id_offset=1000, placeholder=999)
    keys = prompt_block_keys([5, 999, 0, 6, 7, 8, 9, 10, 11, 12, 13], 4, [PromptImage("u1", 2, 1)])
    assert index.overlap(keys, 0.0) != {("w", 0): 2}  # unknown id_offset: a miss, never a false hit
    cache = PrefixCache(4, mm_keys=True, id_offset=1000)
    events = []
    for images, ids_ in ((["big"], [999, 1, 2]), (["u1"], text)):
        sequence = prompt_tokens(ids_, images, image_tokens=6 if images == ["big"] else 1, id_offset=1000,
                                 placeholder=999)
        lease = cache.acquire(sequence)
        cache.store(lease, sequence)
        events += [wire_event(event, mm_keys=True) for event in cache.take_events()]
    index = events_index("w")
    apply_wire_events(index, ("w", 0), events)
    assert index.overlap(keys, 0.0) == {("w", 0): 2}


def test_the_index_learns_how_many_positions_an_image_expanded_into_and_lays_prompts_out_alike():
    # the first image ends inside a block; the second at a block's end, shown by the next block not continuing it
    text = [5, 6, 999, 7, 8, 999, 9, 10, 11, 12, 13]
    identities = ["u1", image_identity(data=b"png")]
    index, sequence = sim_events_index(text, identities, block_size=4, image_tokens=7, id_offset=1000,
                                       placeholder=999)
    assert [index.image_length(identity) for identity in identities] == [7, 7]
    assert index.image_length("never-seen") is None
    engine_ids, images = engine_layout(text, [(i, index.image_length(i)) for i in identities], 999)
    assert len(engine_ids) == len(sequence)
    assert images == [PromptImage("u1", 3, 7), PromptImage(identities[1], 13, 7)]
    keys = prompt_block_keys(engine_ids, 4, images)
    assert index.overlap(keys, 0.0) == {("w", 0): len(keys)}
    # no placeholder in the model: images go ahead of the text
    assert engine_layout([1, 2], [("u1", 2)], None) == ([0, 0, 1, 2], [PromptImage("u1", 0, 2)])


def test_an_image_length_no_engine_expands_into_is_never_learned():
    """A worker's mm_keys set the length a prompt's image is laid out with (for every worker: the lengths are
    shared); a start_offset of 2**62 made the next prompt with that image allocate 2**62 positions."""
    from orchestrator.workers.prompt_keys import request_block_keys

    identity = image_identity(url="https://example.com/cat.png")
    index = KvIndex()
    for n, offset in enumerate((2**62, 10**9, MAX_IMAGE_POSITIONS)):
        # a block that starts inside the image at `offset` and shows its end after one position (one worker each:
        # a worker's first such block also teaches its id offset)
        index.set_mode(f"w{n}", "events")
        index.stored_engine((f"w{n}", 0), [1], None, [5000, 7, 8, 9], 4,
                            [[MmSegment(image_digest(identity).hex(), offset)]])
    assert index.image_length(identity) is None
    index.set_mode("honest", "events")
    index.stored_engine(("honest", 0), [1], None, [5000, 7, 8, 9], 4,
                        [[MmSegment(image_digest(identity).hex(), MAX_IMAGE_POSITIONS - 1)]])
    assert index.image_length(identity) == MAX_IMAGE_POSITIONS

    class Image:
        uuid, data_uri, url = None, None, "https://example.com/cat.png"

    assert len(request_block_keys([1, 2, 999, 3], 4, [Image()], 999, learned=index.image_length)) < 10_000


def test_learned_image_lengths_are_bounded_in_number_and_evicted_oldest_first():
    index = KvIndex()
    index.set_mode("w", "events")
    identities = [image_identity(uuid=f"img-{n}") for n in range(MAX_IMAGE_LENGTHS + 10)]
    for n, identity in enumerate(identities):
        index.stored_engine(("w", 0), [n + 1], None, [5000, 7, 8, 9], 4, [[MmSegment(image_digest(identity).hex(),
                                                                                     2)]])
    learned = [index.image_length(identity) for identity in identities]
    assert learned[-MAX_IMAGE_LENGTHS // 2:] == [3] * (MAX_IMAGE_LENGTHS // 2)  # the newest are kept
    assert learned[0] is None and sum(length is not None for length in learned) <= MAX_IMAGE_LENGTHS


def test_event_blocks_must_be_whole_and_their_mm_keys_must_fit():
    with pytest.raises(EventBlockError):
        event_block_keys(0, [1, 2, 3], 2)
    with pytest.raises(EventBlockError):
        event_block_keys(0, [1, 2, 3, 4], 2, [[]])
    with pytest.raises(EventBlockError):  # an mm_key at offset 0 needs its digest among the tokens
        event_block_keys(0, [1, 2], 2, [[MmSegment("ab" * 32, 0)]])
    assert event_block_keys(0, [1, 2, 3, 4], 2) == prompt_block_keys([1, 2, 3, 4], 2)
    assert event_block_keys(0, [1, 2, 3, 4], 2, [[], []]) == prompt_block_keys([1, 2, 3, 4], 2)


# ---- the index: events --------------------------------------------------------------------------------------

def test_overlap_counts_the_leading_blocks_each_worker_and_rank_holds():
    index = events_index("a", "b")
    keys = prompt_block_keys(ids(4, 160), 32)  # 5 blocks
    index.stored(A, keys[:3])
    index.stored(B, keys)
    index.stored(("b", 1), keys[:1])
    assert index.overlap(keys, 0.0) == {A: 3, B: 5, ("b", 1): 1}
    index.stored(("a", 1), keys[1:])  # no first block: nothing leading
    assert ("a", 1) not in index.overlap(keys, 0.0)
    index.removed(B, keys[2:3])  # a hole: only what leads up to it counts
    assert index.overlap(keys, 0.0)[B] == 2
    assert index.overlap([], 0.0) == {} and index.overlap(prompt_block_keys(ids(5, 64), 32), 0.0) == {}
    assert index.blocks() == 3 + 4 + 1 + 4 and index.blocks("a") == 7


def test_engine_events_are_keyed_through_the_parent_hash_and_removed_by_engine_hash():
    index = events_index("a")
    tokens = ids(6, 96)
    keys = prompt_block_keys(tokens, 32)
    assert index.stored_engine(A, [101, 102], None, tokens[:64], 32)
    assert index.stored_engine(A, [103], 102, tokens[64:], 32)
    assert index.overlap(keys, 0.0) == {A: 3}
    # a parent stored before we listened (or cleared since): its child cannot be keyed, nothing is stored
    assert not index.stored_engine(A, [204], 999, tokens[:32], 32)
    assert index.blocks() == 3
    index.removed_engine(A, [103, 555])  # an unknown hash is ignored
    assert index.overlap(keys, 0.0) == {A: 2}
    with pytest.raises(EventBlockError):
        index.stored_engine(A, [1, 2], None, tokens[:32], 32)  # two hashes for one block of tokens


def test_two_engine_blocks_with_one_key_stay_until_both_are_removed():
    # e.g. the same tokens under two cache salts: the engine holds two blocks, our key is one
    index = events_index("a")
    tokens = ids(7, 32)
    key = prompt_block_keys(tokens, 32)
    index.stored_engine(A, [1], None, tokens, 32)
    index.stored_engine(A, [2], None, tokens, 32)
    index.removed_engine(A, [1])
    assert index.overlap(key, 0.0) == {A: 1}
    index.removed_engine(A, [2])
    assert index.overlap(key, 0.0) == {}
    assert index.keys_indexed() == 0


def test_clearing_a_rank_or_a_worker_and_forgetting_it():
    index = events_index("a", "b")
    keys = prompt_block_keys(ids(8, 64), 32)
    for where in (A, ("a", 1), B):
        index.stored(where, keys)
    index.cleared("a", 1)
    assert index.overlap(keys, 0.0) == {A: 2, B: 2}
    index.cleared("a")
    assert index.overlap(keys, 0.0) == {B: 2}
    index.stored(A, keys)  # rebuilt from the events that follow
    assert index.overlap(keys, 0.0) == {A: 2, B: 2}
    index.forget("a")
    assert index.overlap(keys, 0.0) == {B: 2} and index.mode("a") == "approximate"
    assert set(index.workers()) == {"b"}
    index.stored(("c", 0), keys)  # a new worker reuses the forgotten one's place
    assert index.overlap(keys, 0.0) == {B: 2, ("c", 0): 2}


def test_the_index_tracks_at_most_255_worker_ranks():
    index = KvIndex()
    for n in range(255):
        index.stored((f"w{n}", 0), [n])
    with pytest.raises(ValueError):
        index.stored(("one-too-many", 0), [1])
    index.forget("w3")
    index.stored(("one-too-many", 0), [1])


def test_replicas_fed_the_same_events_answer_alike():
    tokens = ids(9, 128)
    events = [(A, [1, 2], None, tokens[:64]), (B, [3], None, tokens[:32]), (A, [4], 2, tokens[64:96])]
    answers = []
    for _ in range(2):
        index = events_index("a", "b")
        for where, hashes, parent, block in events:
            index.stored_engine(where, hashes, parent, block, 32)
        answers.append(index.overlap(prompt_block_keys(tokens, 32), 0.0))
    assert answers[0] == answers[1] == {A: 3, B: 1}


# ---- the index: approximate entries ---------------------------------------------------------------------------

def test_an_approximate_worker_is_answered_from_where_we_routed_until_the_ttl():
    index = KvIndex(ttl_s=10.0)
    assert index.mode("a") == "approximate"
    keys = prompt_block_keys(ids(10, 96), 32)
    index.routed(A, keys, now=100.0)
    assert index.overlap(keys, 105.0) == {A: 3}
    index.routed(A, keys[:1], now=108.0)  # routed there again: the first block lives longer
    assert index.overlap(keys, 112.0) == {A: 1}
    assert index.overlap(keys, 118.5) == {}
    assert index.routed_entries() == 0


def test_an_events_worker_keeps_no_approximate_entries_for_text():
    index = events_index("a")
    keys = prompt_block_keys(ids(11, 64), 32)
    index.routed(A, keys, now=0.0)
    assert index.confirmed_overlap(keys, 1.0) == {} and index.routed_entries() == 0


def test_a_prompt_routed_to_an_events_worker_counts_as_being_computed_there_until_its_events_settle_it():
    index = events_index("a")
    keys = prompt_block_keys(ids(11, 64), 32)
    index.routed(A, keys, now=0.0)
    assert index.overlap(keys, 1.0) == {A: 2} and index.computing(A, keys, 2, 1.0)
    index.stored(A, keys)  # its events show it computed: held from the events from now on
    assert index.overlap(keys, 1.0) == {A: 2} and not index.computing(A, keys, 2, 1.0)
    index.removed(A, keys)  # and evicted: nothing of the routing is left to answer
    assert index.overlap(keys, 2.0) == {}
    # never settled (the request failed): it lapses after computing_ttl_s
    index.routed(A, keys, now=10.0)
    assert index.overlap(keys, 10.0 + index.computing_ttl_s - 0.1) == {A: 2}
    assert index.overlap(keys, 10.0 + index.computing_ttl_s) == {} and not index.computing(A, keys, 2, 30.0)
    # a longer prompt sharing the first block: being computed for that block only
    longer = prompt_block_keys(ids(11, 32) + ids(99, 64), 32)
    index.routed(A, keys, now=40.0)
    assert index.overlap(longer, 40.0) == {A: 1}
    assert KvIndex(computing_ttl_s=0).computing_ttl_s == 0  # 0: routed prompts are not counted at all


def test_a_worker_whose_events_carry_no_image_keys_is_answered_approximately_from_its_first_image_block():
    index = KvIndex(ttl_s=10.0)
    index.set_mode("a", "events", image_keys=False)
    assert not index.image_keys("a")
    tokens = ids(12, 160)
    keys = prompt_block_keys(tokens, 32, [PromptImage("img", 64, 40)])  # blocks 2, 3 hold the image
    index.stored(A, keys[:2])  # its events know the text blocks before the image
    index.routed(A, keys, now=0.0)  # only the image blocks and after are kept
    assert index.routed_entries() == 3
    assert index.overlap(keys, 1.0) == {A: 5}
    assert index.overlap(keys, 11.0) == {A: 2}  # approximate entries expired, event entries did not
    index.set_mode("a", "events")  # its events key images after all: approximate entries no longer answer
    index.routed(A, keys, now=20.0)
    assert index.confirmed_overlap(keys, 21.0) == {A: 2}


def test_approximate_entries_are_bounded_and_forgotten_with_their_worker():
    index = KvIndex(ttl_s=100.0, max_approximate=5)
    first, second = prompt_block_keys(ids(13, 128), 32), prompt_block_keys(ids(14, 96), 32)
    index.routed(A, first, now=0.0)
    index.routed(B, second, now=1.0)  # over the bound: the oldest routing goes
    assert index.overlap(first, 2.0) == {} and index.overlap(second, 2.0) == {B: 3}
    assert index.routed_entries() <= 5
    index.cleared_routed("b")
    assert index.overlap(second, 2.0) == {} and index.routed_entries() == 0
    index.routed(A, first[:2], now=3.0)
    index.forget("a")
    assert index.overlap(first, 4.0) == {} and index.routed_entries() == 0


def test_modes_are_events_or_approximate():
    index = KvIndex()
    with pytest.raises(ValueError):
        index.set_mode("a", "magic")
    with pytest.raises(ValueError):
        KvIndex(ttl_s=0)
    index.set_mode("a", "events")
    index.set_mode("b", "approximate")
    assert index.workers() == {"a": "events", "b": "approximate"}
    assert index.image_keys("a") and not index.image_keys("b")


# ---- bounds (review of the merged change) ------------------------------------------------------------

def test_a_prompt_routed_again_and_again_keeps_the_expiry_queue_bounded():
    """Routing the same prompt adds no entry, but each decision queued its keys for expiry: without a bound
    on the queue, a hot prompt grew it with the request rate times the TTL."""
    index = KvIndex(ttl_s=120.0, max_approximate=10)
    keys = list(range(2, 12, 2))  # five text keys
    for step in range(200):
        index.routed(("w", 0), keys, now=float(step) * 0.01)
    assert index.routed_entries() <= 10
    queued = sum(len(item[1]) for item in index._expiry)  # the queue's memory, in keys
    assert queued <= 2 * 10
    assert index.overlap(keys, now=2.0) == {("w", 0): 5}  # the latest routing still answers


def test_a_routing_decision_past_the_index_capacity_is_not_recorded_and_does_not_fail():
    index = KvIndex()
    for worker in range(255):
        index.routed((f"w{worker}", 0), [2, 4], now=0.0)
    index.routed(("one-too-many", 0), [2, 4], now=0.0)  # raised ValueError, failing the request, before
    assert ("one-too-many", 0) not in index.overlap([2, 4], now=0.0)


def apply_wire_events(index: KvIndex, where: tuple[str, int], events: list) -> None:
    """Revision-1 wire events into the index, as the feed applies a batch of them."""
    import msgpack

    apply_now(index, where, decode_wire_batch(msgpack.packb([0.0, events, where[1]]), where[1]))
