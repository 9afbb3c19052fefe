"""Write benchmarks/traces/synthetic_conversations.jsonl: a small trace in the Mooncake format (FAST'25
conversation trace: timestamp ms, input_length, output_length, hash_ids of 512-token blocks, plus session_id).

    python benchmarks/traces/make_synthetic_trace.py [--conversations 12] [--turns 4] [--seed 0] [--out PATH]

Multi-turn conversations over long shared documents: each conversation opens on one of a few documents
(4-8 blocks, shared by several conversations), each turn resends the history (the previous prompt and its
answer) plus a new question, as a chat does; conversations start spread over the trace and their turns
follow a few seconds apart. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

BLOCK = 512


def conversations(count: int, turns: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    documents = [list(range(1000 * d, 1000 * d + rng.randint(4, 8))) for d in range(1, 4)]
    next_id = 100_000
    rows = []
    for c in range(count):
        history = list(documents[c % len(documents)])
        at = c * 1500.0 + rng.uniform(0, 500)
        for _ in range(turns):
            question = rng.randint(64, 400)
            input_length = len(history) * BLOCK + question
            blocks = -(-input_length // BLOCK)
            hash_ids = history + list(range(next_id, next_id + blocks - len(history)))
            next_id += blocks - len(history)
            output = rng.randint(32, 200)
            rows.append({"timestamp": round(at), "input_length": input_length, "output_length": output,
                         "hash_ids": hash_ids, "session_id": f"conversation-{c}"})
            # the next turn resends this prompt: its full blocks keep their ids (a partial last block's id is
            # never reused: grown by the answer it is other tokens, as in the Mooncake traces)
            history = hash_ids[: input_length // BLOCK]
            at += rng.uniform(2000, 5000)
    return sorted(rows, key=lambda row: row["timestamp"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("synthetic_conversations.jsonl"))
    args = parser.parse_args()
    rows = conversations(args.conversations, args.turns, args.seed)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{args.out}: {len(rows)} requests")


if __name__ == "__main__":
    main()
