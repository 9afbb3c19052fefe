"""`orchestrator bench trace`: replay a Mooncake-format trace in real time against a running deployment.

The trace is JSONL, one request a line (kvcache-ai/Mooncake FAST25-release/traces): `timestamp` (ms from the
start), `input_length` and `output_length` (tokens), `hash_ids` (one id per `--block-size` tokens of the prompt:
equal ids, equal blocks), and optionally `session_id` (a conversation; without it a conversation is the
requests sharing their first hash id). Each request is sent at its timestamp x `--time-scale` as a streamed
/v1/completions call whose prompt is token ids synthesised from its hash ids (each id always gives the same
`--block-size` ids, so equal hash ids give equal token blocks whatever the tokenizer), the rest of
`input_length` filled with ids of its own; lengths are scaled by `--length-scale` (block size too, so the hash
ids keep their meaning). `--sample` keeps that fraction of the conversations, whole.

The report: TTFT and ITL percentiles, request and output-token throughput, the prompt tokens the engines found
cached (usage.prompt_tokens_details.cached_tokens) and those an infinite cache would have held (every block
whose hash-id chain appeared in an earlier request), and a plot. Policies are compared by running the same
trace against deployments routed differently, in turns (`--label` names each run; `--report` joins the runs).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs
import trio

from orchestrator.bench.metrics import percentile
from orchestrator.bench.sse_client import Connection, HttpError

# Synthesised ids stay inside every shipped model's vocabulary and clear of its special tokens.
_ID_LOW, _ID_SPAN = 300, 20_000


@attrs.frozen
class TraceRequest:
    at_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    conversation: str


def load_trace(path: Path) -> list[TraceRequest]:
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            hash_ids = tuple(int(h) for h in row.get("hash_ids", ()))
            session = row.get("session_id")
            requests.append(TraceRequest(float(row["timestamp"]), int(row["input_length"]),
                                         int(row["output_length"]), hash_ids,
                                         str(session) if session is not None else
                                         f"first-block-{hash_ids[0] if hash_ids else number}"))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: expected timestamp, input_length, output_length, hash_ids "
                             f"({exc})") from None
    return sorted(requests, key=lambda r: r.at_ms)


def sample_conversations(requests: Sequence[TraceRequest], fraction: float, seed: int) -> list[TraceRequest]:
    """Whole conversations, `fraction` of them (their order of first appearance kept)."""
    if fraction >= 1.0:
        return list(requests)
    names = sorted({r.conversation for r in requests})
    keep = set(random.Random(seed).sample(names, max(1, round(len(names) * fraction))))
    return [r for r in requests if r.conversation in keep]


def block_ids(hash_id: int, block_size: int) -> list[int]:
    """The token ids one hash id stands for: the same for the same id, every time."""
    rng = random.Random(hash_id * 1_000_003 + block_size)
    return [_ID_LOW + rng.randrange(_ID_SPAN) for _ in range(block_size)]


def prompt_ids(request: TraceRequest, block_size: int, length_scale: float, salt: int) -> list[int]:
    """The request's prompt: its hash ids' blocks (at the scaled block size), then ids of its own up to its
    scaled input length (`salt` tells requests apart)."""
    size = max(1, round(block_size * length_scale))
    length = max(1, round(request.input_length * length_scale))
    ids: list[int] = []
    for hash_id in request.hash_ids:
        if len(ids) >= length:
            break
        ids.extend(block_ids(hash_id, size))
    rng = random.Random(salt)
    ids.extend(_ID_LOW + rng.randrange(_ID_SPAN) for _ in range(length - len(ids)))
    return ids[:length]


def oracle_cached(requests: Iterable[TraceRequest], block_size: int, length_scale: float) -> list[int]:
    """Per request, the prompt tokens an infinite cache shared by all workers would hold when it arrives: its
    leading blocks whose chain of hash ids an earlier request had (at least up to that block)."""
    size = max(1, round(block_size * length_scale))
    seen: set[tuple[int, ...]] = set()
    result = []
    for request in requests:
        length = max(1, round(request.input_length * length_scale))
        chain: tuple[int, ...] = ()
        hit = 0
        leading = True
        for hash_id in request.hash_ids:
            chain = (*chain, hash_id)
            if leading and chain in seen:
                hit += 1
            else:
                leading = False
            seen.add(chain)
        # (an engine reuses full blocks only, never the prompt's last token)
        result.append(min(hit * size, (length - 1) // size * size))
    return result


@attrs.define
class Outcome:
    sent_at: float
    prompt_tokens: int
    oracle_cached: int
    ttft_s: float | None = None
    itl_s: list[float] = attrs.Factory(list)
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    done_at: float = 0.0


async def replay(url: str, requests: Sequence[TraceRequest], *, model: str, block_size: int, time_scale: float,
                 length_scale: float, timeout_s: float = 600.0) -> list[Outcome]:
    """Send every request at its (scaled) time, streamed; their outcomes in trace order."""
    oracle = oracle_cached(requests, block_size, length_scale)
    outcomes: list[Outcome] = []
    start = trio.current_time()
    first_ms = requests[0].at_ms if requests else 0.0

    async def one(request: TraceRequest, outcome: Outcome, index: int) -> None:
        body = {"model": model, "prompt": prompt_ids(request, block_size, length_scale, salt=index),
                "max_tokens": max(1, round(request.output_length * length_scale)), "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        last: list[float] = []

        def on_data(payload: bytes, arrived: float) -> None:
            if payload == b"[DONE]":
                return
            chunk = json.loads(payload)
            usage = chunk.get("usage")
            if usage:
                outcome.output_tokens = usage.get("completion_tokens", 0)
                outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                if outcome.ttft_s is None:
                    outcome.ttft_s = arrived - outcome.sent_at
                else:
                    outcome.itl_s.append(arrived - last[0])
                last[:] = [arrived]

        connection = Connection(url)
        try:
            with trio.fail_after(timeout_s):
                await connection.post_stream("/v1/completions", body, on_data)
        except (HttpError, OSError, ConnectionError, trio.TooSlowError, ValueError) as exc:
            outcome.error = type(exc).__name__ + ": " + str(exc)[:200]
        finally:
            outcome.done_at = time.perf_counter()
            await connection.aclose()

    async with trio.open_nursery() as nursery:
        for index, (request, hit) in enumerate(zip(requests, oracle)):
            await trio.sleep_until(start + (request.at_ms - first_ms) * time_scale / 1000.0)
            outcome = Outcome(time.perf_counter(), max(1, round(request.input_length * length_scale)), hit)
            outcomes.append(outcome)
            nursery.start_soon(one, request, outcome, index)
    return outcomes


def summarize(label: str, outcomes: Sequence[Outcome]) -> dict:
    done = [o for o in outcomes if not o.error and o.ttft_s is not None]
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    itl = [gap for o in done for gap in o.itl_s]
    span = (max(o.done_at for o in outcomes) - min(o.sent_at for o in outcomes)) if outcomes else 0.0
    prompt = sum(o.prompt_tokens for o in done)
    cached = sum(o.cached_tokens for o in done)
    oracle = sum(o.oracle_cached for o in done)

    def quantiles(values: list[float]) -> dict[str, float]:
        return {f"p{q}": percentile(values, q) if values else math.nan for q in (50, 90, 99)}

    return {"label": label, "requests": len(outcomes), "completed": len(done),
            "errors": len(outcomes) - len(done), "ttft_s": quantiles(ttft), "itl_s": quantiles(itl),
            "duration_s": span, "requests_per_s": len(done) / span if span else 0.0,
            "output_tokens_per_s": sum(o.output_tokens for o in done) / span if span else 0.0,
            "prompt_tokens": prompt, "cached_tokens": cached, "oracle_cached_tokens": oracle,
            "hit_rate": cached / prompt if prompt else 0.0, "oracle_hit_rate": oracle / prompt if prompt else 0.0,
            "hits_of_oracle": cached / oracle if oracle else math.nan,
            "ttft_values_s": ttft}


def report(runs: Sequence[dict], out: Path) -> str:
    """A markdown table of the runs (one row a run, in the order run) and, with matplotlib, ttft.png."""
    lines = ["| run | completed | TTFT p50 ms | p90 ms | p99 ms | ITL p50 ms | p90 ms | req/s | out tok/s | "
             "cached | oracle | of oracle |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        t, i = run["ttft_s"], run["itl_s"]
        lines.append(f"| {run['label']} | {run['completed']}/{run['requests']} | {t['p50'] * 1e3:.1f} | "
                     f"{t['p90'] * 1e3:.1f} | {t['p99'] * 1e3:.1f} | {i['p50'] * 1e3:.2f} | {i['p90'] * 1e3:.2f} | "
                     f"{run['requests_per_s']:.2f} | {run['output_tokens_per_s']:.0f} | {run['hit_rate']:.1%} | "
                     f"{run['oracle_hit_rate']:.1%} | {run['hits_of_oracle']:.2f} |")
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    try:
        import matplotlib
    except ImportError:
        return text
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for run in runs:
        values = sorted(run["ttft_values_s"])
        if values:
            axis.plot([v * 1e3 for v in values], [(k + 1) / len(values) for k in range(len(values))],
                      label=run["label"])
    axis.set_xlabel("TTFT (ms)")
    axis.set_ylabel("fraction of requests")
    axis.set_xscale("log")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "ttft.png", dpi=100)
    plt.close(figure)
    return text


def main_trace(trace: Path, url: str, *, label: str, model: str, block_size: int, time_scale: float,
               length_scale: float, sample: float, seed: int, limit: int | None, out: Path) -> int:
    requests = sample_conversations(load_trace(trace), sample, seed)
    if limit is not None:
        requests = requests[:limit]
    if not requests:
        print(f"error: {trace}: no request to replay")
        return 2
    outcomes = trio.run(lambda: replay(url, requests, model=model, block_size=block_size, time_scale=time_scale,
                                       length_scale=length_scale))
    run = summarize(label or url, outcomes)
    out.mkdir(parents=True, exist_ok=True)
    runs_file = out / "runs.jsonl"
    with runs_file.open("a") as runs:
        runs.write(json.dumps(run) + "\n")
    all_runs = [json.loads(line) for line in runs_file.read_text().splitlines() if line.strip()]
    print(report(all_runs, out), end="")
    return 1 if run["errors"] else 0
