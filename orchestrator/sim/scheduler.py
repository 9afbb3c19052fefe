"""Continuous batching, the way TRT-LLM's executor does it, with time from a cost profile.

Each step takes every decoding request (one token each) plus prefill chunks up to the step's token
budget; the step costs `profile.step_ms(...)` scaled by `time_scale`. KV blocks are reserved for
prompt + max_tokens at admission (TRT-LLM's GUARANTEED_NO_EVICT policy); requests queue while the
cache or the batch is full. In the aggregated role prefill chunks share steps with decodes: that
interference is what disaggregation removes.

Each attention-DP rank has its own share of the KV blocks and its own prefix cache (prefix_cache.py). A
request whose prompt starts with cached blocks reserves and prefills only the rest: its prefill starts at
the cached length, so the cost model prices only the uncached tokens (chunks are priced as they always
were, without the attention over the cached context, as a chunk of a long prompt already is). Blocks
the cache retains after their request ended are evicted when an admission needs the room, so a worker
that never reuses anything admits and prices exactly as it did without the cache.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from collections.abc import Awaitable, Callable

import attrs

from orchestrator.sim import gpu_sleep
from orchestrator.sim.output import Vocabulary, advance
from orchestrator.sim.prefix_cache import Event, PrefixCache, PrefixLease, Token
from orchestrator.sim.profiles import Profile

log = logging.getLogger(__name__)

FULL, CONTEXT_ONLY, GENERATION_ONLY = "full", "context_only", "generation_only"


@attrs.define(eq=False)
class SimRequest:
    request_id: str
    kind: str
    prompt_len: int  # prompt tokens including image tokens
    key: int  # the output state: every token so far, hashed (output.request_key, output.advance)
    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    include_stop: bool = False
    first_gen_tokens: tuple[int, ...] = ()  # generation_only: what the prefill already produced
    # callbacks into the server: on_token(request, token_id), on_finish(request, reason, match)
    on_token: Callable[[SimRequest, int], None] = lambda r, t: None
    on_finish: Callable[[SimRequest, str, tuple[str, int | str] | None], None] = lambda r, why, m: None
    on_context_done: Callable[[SimRequest, int], None] = lambda r, t: None
    prefilled: int = 0
    generated: int = 0
    blocks: int = 0
    state: str = "waiting"  # waiting | prefill | decode | stalled | done
    output_ids: list[int] = attrs.field(factory=list)
    # the prompt as the prefix cache keys it (prefix_cache.prompt_tokens); None: the request takes no part
    tokens: tuple[Token, ...] | None = None
    rank: int = 0  # its attention-DP rank
    target_rank: int | None = None  # the rank the caller asked for (openengine-target-dp-rank), else balanced
    # the scripted answer (orchestrator.sim.answers.Plan): its first tokens, EOS right after them or free words,
    # the answer tokens already in the prompt (migration), and the natural length that ends free words with EOS
    script: tuple[int, ...] = ()
    script_ends: bool = False
    answer_offset: int = 0
    natural_length: int | None = None
    cache_salt: str | None = None  # kv.cache_salt: its prefix-cache namespace
    lora: tuple[int, str] | None = None  # its LoRA adapter (lora_id, lora_name): a namespace of its own too
    cached: int = 0  # prompt tokens found in the prefix cache at admission
    lease: PrefixLease | None = None


@attrs.frozen
class Step:
    """One continuous-batching iteration: its decodes, its prefill chunks, and what it costs."""

    decodes: tuple[SimRequest, ...]
    chunks: tuple[tuple[SimRequest, int], ...]
    ms: float


@attrs.define
class Faults:
    crash_after_tokens: int | None = None  # whole process exits after this many tokens
    stall_after_tokens: int | None = None  # each request stops producing after this many tokens
    eos_probability: float = 0.0


class Rank:
    """One attention-DP rank: its share of the KV blocks, what live requests reserved of them, its cache."""

    def __init__(self, index: int, total_blocks: int, cache: PrefixCache):
        self.index, self.total_blocks, self.cache = index, total_blocks, cache
        self.used_blocks = 0
        self.active = 0  # requests admitted here and not yet released

    def make_room(self, need: int) -> bool:
        """Whether `need` more blocks fit, evicting retained cache blocks if that is what it takes."""
        over = self.used_blocks + need + self.cache.retained - self.total_blocks
        if over <= 0:
            return True
        if over > self.cache.unpinned:
            return False
        self.cache.evict(over)
        return True


class Scheduler:
    def __init__(self, profile: Profile, role: str, vocab: Vocabulary, *, time_scale: float = 1.0,
                 faults: Faults | None = None, total_kv_blocks: int | None = None, context_stops: bool = False,
                 attention_dp_size: int = 1, prefix_caching: bool = True, mm_keys: bool = False,
                 id_offset: int = 0, sleep: Callable[[float], Awaitable[None]] | None = None):
        self.profile = profile
        self.sleep = sleep or gpu_sleep.GpuSleep()  # how the step loop spends a step's (scaled) GPU time
        self.context_stops = context_stops
        self.role = role
        self.vocab = vocab
        self.time_scale = time_scale
        self.faults = faults or Faults()
        total = total_kv_blocks or profile.total_kv_blocks
        # the worker's KV capacity is shared out among its ranks; each rank caches on its own
        self.ranks = [Rank(i, total // attention_dp_size + (i < total % attention_dp_size),
                           PrefixCache(profile.kv_block_size, enabled=prefix_caching, mm_keys=mm_keys,
                                       id_offset=id_offset))
                      for i in range(attention_dp_size)]
        # on_kv_events(rank, events): what each rank's cache did in a step, once per step (an iteration)
        self.on_kv_events: Callable[[int, list[Event]], None] | None = None
        self.prompt_tokens_total = 0  # prompts admitted, and how much of them was found cached
        self.cached_tokens_total = 0
        self.prefill_tokens_computed = 0  # what the cost model priced for prefill: tokens and ms
        self.prefill_ms_total = 0.0
        self.waiting: collections.deque[SimRequest] = collections.deque()
        self.prefilling: list[SimRequest] = []
        self.decoding: list[SimRequest] = []
        self.stalled: list[SimRequest] = []
        self.tokens_emitted = 0
        self.steps = 0
        self.last_step = (0, 0)  # (prefill tokens, decode batch) of the last step, for GetLoad
        self._wake = asyncio.Event()

    @property
    def total_blocks(self) -> int:
        return sum(rank.total_blocks for rank in self.ranks)

    @property
    def used_blocks(self) -> int:
        return sum(rank.used_blocks for rank in self.ranks)

    # ---- requests in and out -------------------------------------------------------------------
    def blocks_needed(self, request: SimRequest) -> int:
        tokens = request.prompt_len if request.kind == CONTEXT_ONLY else request.prompt_len + request.max_tokens
        return self.profile.blocks_for(tokens)

    def submit(self, request: SimRequest) -> None:
        self.waiting.append(request)
        self._wake.set()

    def cancel(self, request: SimRequest) -> bool:
        """Remove a request wherever it is and free its blocks. False if it had already finished."""
        if request.state == "done":
            return False
        for queue in (self.prefilling, self.decoding, self.stalled):
            if request in queue:
                queue.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        return True

    def release_blocks(self, blocks: int, rank: int = 0, lease: PrefixLease | None = None) -> None:
        """Blocks held outside a request (a KV session) are given back; what of them the session's prefill
        stored stays cached."""
        target = self.ranks[rank]
        target.used_blocks -= blocks
        if lease is not None:
            target.cache.release(lease)
        self._wake.set()

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding) + len(self.stalled)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running)

    def _release(self, request: SimRequest) -> None:
        rank = self.ranks[request.rank]
        if request.state != "waiting":
            rank.active -= 1
        request.state = "done"
        rank.used_blocks -= request.blocks
        request.blocks = 0
        if request.lease is not None:
            rank.cache.release(request.lease)
            request.lease = None
        self._wake.set()

    def _choose_rank(self, request: SimRequest) -> Rank:
        if request.target_rank is not None:
            return self.ranks[request.target_rank]
        # TensorRT-LLM's attention-DP scheduler balances ranks by load; a single rank is the usual case
        return min(self.ranks, key=lambda rank: (rank.active, rank.index))

    def _flush_events(self) -> None:
        for rank in self.ranks:
            if rank.cache.events:
                events = rank.cache.take_events()
                if self.on_kv_events is not None:
                    self.on_kv_events(rank.index, events)

    # ---- the step loop -------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and self.running < self.profile.max_batch_size:
            request = self.waiting[0]
            rank = self._choose_rank(request)
            lease = (rank.cache.acquire(request.tokens, request.cache_salt, request.lora)
                     if request.tokens is not None else None)
            reused = lease.cached_tokens // self.profile.kv_block_size if lease is not None else 0
            need = self.blocks_needed(request) - reused  # cached blocks are shared, not allocated again
            if not rank.make_room(need):
                if lease is not None:
                    rank.cache.release(lease)
                return  # queue until blocks come back
            self.waiting.popleft()
            rank.used_blocks += need
            rank.active += 1
            request.blocks, request.rank, request.lease = need, rank.index, lease
            if request.kind == GENERATION_ONLY:
                if lease is not None and request.tokens is not None:  # the pulled KV is resident here now,
                    rank.cache.store(lease, request.tokens)  # and cached like any other
                request.state = "decode"
                self.decoding.append(request)
                self._emit(request)  # the prefill's first token, carried in the KV session
            else:
                request.cached = lease.cached_tokens if lease is not None else 0
                request.prefilled = request.cached
                self.prompt_tokens_total += request.prompt_len
                self.cached_tokens_total += request.cached
                request.state = "prefill"
                self.prefilling.append(request)

    def plan_step(self) -> Step | None:
        """Admit what fits, then choose the next step's work: every decoding request and prefill chunks up
        to the token budget. None when there is nothing to do."""
        profile = self.profile
        self._admit()
        decodes = self.decoding[: profile.max_batch_size]
        budget = profile.max_num_tokens - len(decodes)
        chunks: list[tuple[SimRequest, int]] = []
        for request in self.prefilling:
            if budget <= 0:
                break
            n = min(request.prompt_len - request.prefilled, budget)
            chunks.append((request, n))
            budget -= n
        if not decodes and not chunks:
            return None
        contexts = [r.prompt_len + r.generated for r in decodes]
        step = Step(tuple(decodes), tuple(chunks), profile.step_ms([n for _, n in chunks], contexts))
        self.last_step = (sum(n for _, n in chunks), len(decodes))
        return step

    def _account_prefill(self, step: Step) -> None:
        if step.chunks:
            self.prefill_tokens_computed += sum(n for _, n in step.chunks)
            self.prefill_ms_total += self.profile.prefill_ms([n for _, n in step.chunks])

    def finish_step(self, step: Step) -> None:
        """The step's GPU time has passed: emit its tokens and advance its prefills."""
        self.steps += 1
        self._account_prefill(step)
        for request in step.decodes:
            if request.state == "decode":
                self._emit(request)
        for request, n in step.chunks:
            if request.state != "prefill":
                continue  # cancelled during the step
            request.prefilled += n
            if request.prefilled < request.prompt_len:
                continue
            self.prefilling.remove(request)
            if request.lease is not None and request.tokens is not None:  # the prompt's KV is computed:
                self.ranks[request.rank].cache.store(request.lease, request.tokens)  # its full blocks are reusable
            if request.kind == CONTEXT_ONLY:
                self._context_token(request)
            else:
                request.state = "decode"
                self.decoding.append(request)
                self._emit(request)
        self._flush_events()

    async def run(self) -> None:
        """The worker's step loop in real time (scaled); orchestrator.bench.plan drives the same steps on a
        virtual clock."""
        while True:
            step = self.plan_step()
            if step is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            # The step's GPU time, to the microsecond and on average however late this host wakes us (gpu_sleep:
            # the loop's own timers count whole milliseconds). The first step after idle starts here: no wait for a
            # step boundary, no batching window.
            wanted = step.ms * self.time_scale / 1000.0
            if wanted > 0:
                await self.sleep(wanted)
            else:
                await asyncio.sleep(0)  # zero cost: still let the server's other tasks run between steps
            self.finish_step(step)

    def _context_token(self, request: SimRequest) -> None:
        """The context phase samples the first token; it travels in the KV session. With
        `context_stops`, a first token that stops the request (EOS, a stop token) finishes it here,
        as TensorRT-LLM's context phase does: there is no KV to hand off then."""
        token = self._sampled(request)
        if self.context_stops and request.min_tokens == 0:
            if not request.ignore_eos and (token is None or self._ends(request)):
                self._release(request)
                request.on_finish(request, "stop", ("eos_token_id", self.vocab.eos_id))
                return
            if token in request.stop_token_ids:
                if request.include_stop:
                    self._output(request, token)
                self._release(request)
                request.on_finish(request, "stop", ("stop_token_id", token))
                return
        if token is None:  # EOS suppressed (min_tokens, ignore_eos) or not ended here: the words go on
            token = self.vocab.next_token(request.key)
        # The request is over here; its blocks and lease now belong to the KV session (on_context_done).
        request.state = "done"
        self.ranks[request.rank].active -= 1
        request.on_context_done(request, token)

    def _emit(self, request: SimRequest) -> None:
        """Produce the token at the request's next position, then apply stop rules."""
        position = request.generated
        if position == 0 and request.first_gen_tokens:
            token = request.first_gen_tokens[0]
        else:
            sampled = self._sampled(request)
            token = self.vocab.next_token(request.key) if sampled is None else sampled
            if sampled is None and not request.ignore_eos and position >= request.min_tokens:
                self._finish(request, "stop", ("eos_token_id", self.vocab.eos_id))
                return
        may_stop = position >= request.min_tokens
        if may_stop and not request.ignore_eos and self._ends(request):
            self._finish(request, "stop", ("eos_token_id", self.vocab.eos_id))
            return
        if may_stop and token in request.stop_token_ids:
            if request.include_stop:
                self._output(request, token)
            self._finish(request, "stop", ("stop_token_id", token))
            return
        self._output(request, token)
        if request.state == "done":  # a stop string matched inside on_token
            return
        if request.generated >= request.max_tokens:
            self._finish(request, "length", None)
            return
        stall = self.faults.stall_after_tokens
        if stall is not None and request.generated >= stall:
            self.decoding.remove(request)
            request.state = "stalled"
            self.stalled.append(request)

    def _sampled(self, request: SimRequest) -> int | None:
        """The token at the request's next position: the script's, then None (EOS) after a script that ends, else
        a word that is a function of everything before it."""
        position = request.answer_offset + request.generated
        if position < len(request.script):
            return request.script[position]
        if request.script_ends:
            return None
        return self.vocab.next_token(request.key)

    def _ends(self, request: SimRequest) -> bool:
        """Whether the model stops here of its own accord: the answer reached its natural length, or the
        --eos-probability draw says so."""
        natural = request.natural_length
        if natural is not None and request.answer_offset + request.generated >= natural:
            return True
        return self.vocab.ends(request.key, self.faults.eos_probability)

    def _output(self, request: SimRequest, token: int) -> None:
        request.key = advance(request.key, token)
        request.generated += 1
        request.output_ids.append(token)
        request.on_token(request, token)
        self.tokens_emitted += 1
        crash = self.faults.crash_after_tokens
        if crash is not None and self.tokens_emitted >= crash:
            log.error("fault injection: crashing after %d tokens", self.tokens_emitted)
            logging.shutdown()
            os._exit(3)

    def _finish(self, request: SimRequest, reason: str, match: tuple[str, int | str] | None) -> None:
        if request in self.decoding:
            self.decoding.remove(request)
        if request.lease is not None and request.tokens is not None and request.output_ids:
            # every token but the last has KV now: a follow-up that resends the answer reuses it
            self.ranks[request.rank].cache.store(request.lease, (*request.tokens, *request.output_ids[:-1]))
        self._release(request)
        request.on_finish(request, reason, match)
