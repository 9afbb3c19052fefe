"""How fast the KV prefix index is (orchestrator/workers/kv_index.py), and how much memory it takes.

    python benchmarks/kv_index.py [--workers 8] [--block-size 32] [--prompt-tokens 8192] [--seconds 2]

Printed:
- block events applied per second: BlockStored events as the feed applies them (engine hashes, parent,
  token ids per block; chains of 4 blocks per event, as a step's coalesced stores), then BlockRemoved of
  the same blocks; target >= 500k/s. Our keys are computed from the token ids, so this includes hashing.
- CPU per routing decision for an `--prompt-tokens` prompt: computing its block keys, then overlap()
  against an index where every worker holds a part of the prefix (the worst case walks every block);
  target <= 100 us together.
- memory per indexed block (tracemalloc, event-fed entries, one rank).
Timings are process CPU time (time.process_time), best of a few rounds. The first line times a fixed
pure-Python loop, so that figures from a loaded or slower machine can be scaled.
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

from orchestrator.workers.kv_index import KvIndex, PromptImage, prompt_block_keys


def _best(rounds: int, run) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    return best


def events_per_second(block_size: int, seconds: float) -> tuple[float, float]:
    """(stored blocks/s, removed blocks/s)."""
    rng = random.Random(1)
    chains, per_event = 2000, 4
    # (engine hashes, parent hash, token ids) chained 4 blocks at a time
    events: list[tuple[list[int], int | None, list[int]]] = []
    for _ in range(chains):
        parent = None
        for _ in range(4):
            hashes = [rng.getrandbits(63) for _ in range(per_event)]
            tokens = [rng.randrange(32000) for _ in range(per_event * block_size)]
            events.append((hashes, parent, tokens))
            parent = hashes[-1]
    blocks = len(events) * per_event
    index = KvIndex()
    index.set_mode("w", "events")
    where = ("w", 0)
    stored_s = removed_s = 0.0
    rounds = 0
    started = time.process_time()
    while time.process_time() - started < seconds or rounds < 2:
        t0 = time.process_time()
        for hashes, parent, tokens in events:
            index.stored_engine(where, hashes, parent, tokens, block_size)
        t1 = time.process_time()
        for hashes, _, _ in events:
            index.removed_engine(where, hashes)
        t2 = time.process_time()
        stored_s += t1 - t0
        removed_s += t2 - t1
        rounds += 1
    return blocks * rounds / stored_s, blocks * rounds / removed_s


def decision_cost(workers: int, block_size: int, prompt_tokens: int, images: int) -> tuple[float, float, int]:
    """(seconds to key the prompt, seconds for overlap(), blocks), best of rounds."""
    rng = random.Random(2)
    tokens = [rng.randrange(32000) for _ in range(prompt_tokens)]
    prompt_images = [PromptImage(f"uuid-{i}", 100 + i * 700, 576) for i in range(images)]
    keys = prompt_block_keys(tokens, block_size, prompt_images)
    index = KvIndex()
    for w in range(workers):
        index.set_mode(f"w{w}", "events")
        # worker w holds a leading part of the prompt, the last one all of it: overlap walks every block
        held = keys[: len(keys) * (w + 1) // workers]
        index.stored((f"w{w}", 0), held)
        index.routed((f"w{w}", 0), held, 0.0)
    # other prompts' blocks, so that the dicts are not tiny
    for _ in range(20_000):
        index.stored(("w0", 0), [rng.getrandbits(63)])
    keying = _best(200, lambda: prompt_block_keys(tokens, block_size, prompt_images))
    answer = index.overlap(keys, 1.0)
    if answer.get((f"w{workers - 1}", 0)) != len(keys):
        raise RuntimeError(f"overlap is wrong: {answer}")
    lookup = _best(200, lambda: index.overlap(keys, 1.0))
    return keying, lookup, len(keys)


def memory_per_block(block_size: int, blocks: int = 100_000) -> tuple[float, float]:
    """(bytes per event-fed block, bytes per approximate entry)."""
    rng = random.Random(3)
    tokens = [rng.randrange(32000) for _ in range(blocks * block_size)]
    keys = prompt_block_keys(tokens, block_size)
    hashes = [rng.getrandbits(63) for _ in range(blocks)]
    index = KvIndex()
    index.set_mode("w", "events")
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index.stored_engine(("w", 0), hashes, None, tokens, block_size)
    after_events = tracemalloc.get_traced_memory()[0]
    index.routed(("approximate", 0), keys, 0.0)  # a worker without events: every routed block is kept
    after_routed = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after_events - before) / blocks, (after_routed - after_events) / blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()

    calibration = _best(20, lambda: sum(range(1_000_000)))
    print(f"calibration: sum(range(1_000_000)) takes {calibration * 1e3:.1f} ms of CPU here")
    stored, removed = events_per_second(args.block_size, args.seconds)
    print(f"block events applied: stored {stored / 1e3:,.0f}k blocks/s, removed {removed / 1e3:,.0f}k blocks/s "
          f"(block size {args.block_size}; target >= 500k/s)")
    for images in (0, 4):
        keying, lookup, blocks = decision_cost(args.workers, args.block_size, args.prompt_tokens, images)
        print(f"decision, {args.prompt_tokens}-token prompt ({blocks} blocks, {images} images, {args.workers} "
              f"workers): keys {keying * 1e6:.1f} us + overlap {lookup * 1e6:.1f} us = "
              f"{(keying + lookup) * 1e6:.1f} us CPU (target <= 100 us)")
    event_bytes, routed_bytes = memory_per_block(args.block_size)
    print(f"memory per indexed block: {event_bytes:.0f} B from events (with its engine-hash map), "
          f"{routed_bytes:.0f} B per approximate entry")


if __name__ == "__main__":
    main()
