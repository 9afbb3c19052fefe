"""The load generator: one workload against any OpenAI-compatible streaming endpoint.

Sweeps either concurrency (N users, each sending its next request when the last ends) or request
rate (Poisson arrivals). Prompts are synthetic and seeded: words drawn from the model's tokenizer so
that each prompt has the requested number of tokens; a share of requests can carry an image. Warm-up
requests run first and are not recorded.
"""

from __future__ import annotations

import base64
import json
import random
import sys
import time
from pathlib import Path

import attrs
import trio

from orchestrator.bench.metrics import Overhead, RequestRecord, aggregate, to_gpu_time
from orchestrator.bench.sse_client import Connection, HttpError
from orchestrator.synthetic import solid_png, word_pieces
from orchestrator.tokenizer import ModelTokenizer

IMAGE_URI = "data:image/png;base64," + base64.b64encode(solid_png()).decode()


@attrs.frozen
class Range:
    low: int
    high: int

    @classmethod
    def parse(cls, text: str | int) -> Range:
        if isinstance(text, int):
            return cls(text, text)
        low, _, high = str(text).partition(":")
        low_n = int(low)
        high_n = int(high) if high else low_n
        if low_n < 1 or high_n < low_n:
            raise ValueError(f"expected N or LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}")
        return cls(low_n, high_n)

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@attrs.frozen
class Workload:
    model: str
    input_len: Range
    output_len: Range
    requests: int = 32  # recorded requests per load point
    warmup: int = 2
    image_share: float = 0.0
    seed: int = 0
    timeout_s: float = 600.0


class PromptFactory:
    def __init__(self, tokenizer: ModelTokenizer, seed: int):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.words = sorted(word_pieces(tokenizer.tokenizer.get_vocab()))

    def text(self, tokens: int) -> str:
        """Words until the text encodes to `tokens` tokens (exactly, by trimming)."""
        words = [self.rng.choice(self.words) for _ in range(tokens)]
        ids = self.tokenizer.encode(" ".join(words))
        return self.tokenizer.decode(ids[:tokens])

    def request(self, workload: Workload) -> tuple[dict, int]:
        input_tokens = workload.input_len.draw(self.rng)
        content: object = self.text(input_tokens)
        if workload.image_share > 0 and self.rng.random() < workload.image_share:
            content = [{"type": "text", "text": content}, {"type": "image_url", "image_url": {"url": IMAGE_URI}}]
        body = {"model": workload.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": workload.output_len.draw(self.rng), "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.0}
        return body, input_tokens


async def send_one(connection: Connection, body: dict, input_tokens: int, tokenizer: ModelTokenizer,
                   timeout_s: float) -> RequestRecord:
    chunks: list[tuple[float, int]] = []
    usage: dict = {}
    stream_error: list[str] = []  # an error event after the stream started

    def on_data(payload: bytes, at: float) -> None:
        if payload == b"[DONE]":
            return
        event = json.loads(payload)
        if event.get("error"):
            stream_error.append(_error_message(payload))
        if event.get("usage"):
            usage.update(event["usage"])
        for choice in event.get("choices") or ():
            text = streamed_text(choice)
            if text:
                chunks.append((at, max(1, len(tokenizer.encode(text)))))

    start = time.perf_counter()
    error = message = None
    try:
        with trio.fail_after(timeout_s):
            await connection.post_stream("/v1/chat/completions", body, on_data)
    except HttpError as exc:
        error, message = f"http_{exc.status}", _error_message(exc.body)
    except trio.TooSlowError:
        error, message = "timeout", f"no complete answer within {timeout_s:g} s"
    except (OSError, ConnectionError, ValueError) as exc:
        error, message = f"connection:{type(exc).__name__}", str(exc)
    if error is None and stream_error:
        error, message = "stream_error", stream_error[0]
    end = time.perf_counter()
    output = usage.get("completion_tokens") or sum(k for _, k in chunks)
    if chunks and usage.get("completion_tokens"):  # rescale per-chunk estimates to the true total
        counted = sum(k for _, k in chunks)
        if counted != output:
            scaled = [max(1, round(k * output / counted)) for _, k in chunks]
            scaled[-1] = max(1, output - sum(scaled[:-1]))
            chunks = [(at, k) for (at, _), k in zip(chunks, scaled)]
    if error is None and not chunks:
        error = "no_content"
    return RequestRecord(start=start, end=end, chunks=tuple(chunks), output_tokens=output,
                         input_tokens=usage.get("prompt_tokens", input_tokens), error=error, error_message=message)


def streamed_text(choice: dict) -> str:
    """What one streamed choice delta generated: its content, its reasoning (`reasoning_content`), its tool calls'
    argument text (chat), or its text (completions). A thinking model's first tokens are reasoning, and a tool
    call's are arguments: each is output, and its first one the time to first token."""
    delta = choice.get("delta")
    if delta is None:
        return choice.get("text") or ""
    calls = delta.get("tool_calls") or ()
    return ((delta.get("reasoning_content") or "") + (delta.get("content") or "")
            + "".join((call.get("function") or {}).get("arguments") or "" for call in calls))


def _error_message(body: bytes) -> str:
    """The message of an OpenAI error body, else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300].decode(errors="replace").strip() or "(empty body)"


class Progress:
    """A progress bar redrawn in place on a terminal; elsewhere (a log, a pipe) one line when the point is done."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.done, self.errors = label, total, 0, 0
        self._last = 0.0
        self._redraw = sys.stderr.isatty()

    def tick(self, record: RequestRecord) -> None:
        self.done += 1
        self.errors += record.error is not None
        if not self._redraw:
            if self.done == self.total:
                print(f"{self.label}: {self.done}/{self.total} requests, errors {self.errors}", file=sys.stderr,
                      flush=True)
            return
        now = time.monotonic()
        if now - self._last > 0.2 or self.done == self.total:
            self._last = now
            width = 30
            filled = int(width * self.done / max(self.total, 1))
            sys.stderr.write(f"\r{self.label:28} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
                             f" errors {self.errors}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def run_concurrency(url: str, workload: Workload, tokenizer: ModelTokenizer, concurrency: int,
                          label: str = "") -> list[RequestRecord]:
    factory = PromptFactory(tokenizer, workload.seed)
    warm = [factory.request(workload) for _ in range(workload.warmup)]
    todo = [factory.request(workload) for _ in range(workload.requests)]
    records: list[RequestRecord] = []
    progress = Progress(label or f"concurrency {concurrency}", len(todo))

    async def user(queue: list, record: bool) -> None:
        connection = Connection(url)
        try:
            while queue:
                body, input_tokens = queue.pop()
                result = await send_one(connection, body, input_tokens, tokenizer, workload.timeout_s)
                if record:
                    records.append(result)
                    progress.tick(result)
        finally:
            await connection.aclose()

    for phase, queue in (("warmup", warm), ("measure", todo[::-1])):
        async with trio.open_nursery() as nursery:
            for _ in range(min(concurrency, max(len(queue), 1))):
                nursery.start_soon(user, queue, phase == "measure")
    return records


async def run_rate(url: str, workload: Workload, tokenizer: ModelTokenizer, rate: float,
                   label: str = "") -> list[RequestRecord]:
    factory = PromptFactory(tokenizer, workload.seed)
    rng = random.Random(workload.seed + 1)
    await run_concurrency(url, attrs.evolve(workload, requests=0), tokenizer, max(1, workload.warmup))
    todo = [factory.request(workload) for _ in range(workload.requests)]
    records: list[RequestRecord] = []
    progress = Progress(label or f"rate {rate:g}/s", len(todo))
    idle: list[Connection] = []

    async def one(body: dict, input_tokens: int) -> None:
        connection = idle.pop() if idle else Connection(url)
        result = await send_one(connection, body, input_tokens, tokenizer, workload.timeout_s)
        idle.append(connection)
        records.append(result)
        progress.tick(result)

    async with trio.open_nursery() as nursery:
        for body, input_tokens in todo:
            nursery.start_soon(one, body, input_tokens)
            await trio.sleep(rng.expovariate(rate))
    for connection in idle:
        await connection.aclose()
    return records


async def sweep(url: str, workload: Workload, tokenizer: ModelTokenizer, *, concurrency: list[int] | None = None,
                rates: list[float] | None = None, gpus: int = 1, slo_ttft: float | None = None,
                slo_tpot: float | None = None, time_scale: float = 1.0, label: str = "",
                baseline_url: str | None = None) -> list[dict]:
    """One result dict per load point, in GPU time for a simulated run at `time_scale`.

    `baseline_url`: the same topology on workers at time scale 0. The workload runs there first, one request at
    a time: its latencies are the deployment's own time per request (Overhead), which the conversion then leaves
    unscaled. One user, because at higher loads zero-cost workers crowd the CPU as no paced run does. Without
    it, all of a request's time is taken for GPU time.
    """
    points = []
    loads = [("concurrency", c) for c in (concurrency or [])] + [("rate", r) for r in (rates or [])]
    overhead = None
    if baseline_url is not None and loads:
        overhead = Overhead.measure(await run_concurrency(baseline_url, workload, tokenizer, 1,
                                                          f"{label} baseline".strip()))
    for kind, load in loads:
        tag = f"{label} {kind} {load:g}".strip()
        if kind == "concurrency":
            records = await run_concurrency(url, workload, tokenizer, int(load), tag)
        else:
            records = await run_rate(url, workload, tokenizer, float(load) * time_scale, tag)
        scaled = to_gpu_time(records, time_scale, overhead, closed_loop=kind == "concurrency")
        points.append({"load_kind": kind, "load": load,
                       **({"overhead_s": attrs.asdict(overhead)} if overhead is not None else {}),
                       **aggregate(scaled, gpus=gpus, slo_ttft=slo_ttft, slo_tpot=slo_tpot)})
    return points


def load_tokenizer(model_dir: str | Path) -> ModelTokenizer:
    from orchestrator.config import ModelConfig

    return ModelTokenizer.from_dir(ModelConfig(dir=str(model_dir)).resolved_dir(Path.cwd()))
