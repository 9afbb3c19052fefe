"""`orchestrator bench reuse FILE`: prefix-cache hit rates and TTFT by turn for workloads that reuse KV.

Workloads (seeded, sizes as public chat and agent traces report them):
- conversations: multi-turn chats behind a long system prompt; each turn resends the whole history, the
  answers included, plus a new user message; optionally an image in the first turn, which every later
  turn carries again in its history;
- shared-prefix: single requests in groups, each group behind its own long system prompt.

Each workload runs on every topology and routing policy of the file, on a **virtual clock**: the simulated
worker's own scheduler, prefix cache and cost profile (orchestrator.sim), driven step by step like `bench
plan` does, with today's routing policies from orchestrator.workers.routing (round robin; least loaded, scored by
the running and queued requests a fresh GetLoad would report). A conversation is a closed-loop user: its
next turn goes out when the last answer has finished. The hit rate is cached prompt tokens / prompt tokens,
counted where the prompt is prefilled (usage.cached_prompt_tokens of the simulated workers).

`kv_aware` routes with the orchestrator's KvAware policy over a KV index (orchestrator.workers.kv_index) fed
by the simulated workers' own KV events (each step's BlockStored/BlockRemoved, translated to our block keys
as the live event feed does); `oracle` is the same cost function over an index that reads every worker's
cache directly, the best any index could know. Decode legs of both go least loaded.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import yaml

from orchestrator.bench.compare import _fmt, _json_default
from orchestrator.bench.loadgen import Range
from orchestrator.bench.metrics import percentile
from orchestrator.bench.plan import VirtualClock
from orchestrator.config import ConfigError, build_attrs
from orchestrator.sim.output import Vocabulary, request_key
from orchestrator.sim.prefix_cache import (
    DIGEST_SIZE,
    ROOT_KEY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Token,
    expanded_image,
)
from orchestrator.sim.prefix_cache import block_key as engine_block_key
from orchestrator.sim.profiles import PROFILES, Profile
from orchestrator.sim.scheduler import CONTEXT_ONLY, FULL, GENERATION_ONLY, Scheduler, SimRequest, Step
from orchestrator.workers.kv_index import KvIndex, MmSegment, PromptImage, prompt_block_keys
from orchestrator.workers.routing import POLICY_NAMES, KvAwareKnobs, LoadSample, make_policy

WORKLOAD_KINDS = ("conversations", "shared-prefix")
TOPOLOGY_MODES = ("aggregated", "disaggregated")
VOCABULARY = range(100, 30_000)  # user and answer token ids (a Llama-sized vocabulary's ordinary ids)
POLICIES = (*POLICY_NAMES, "oracle")  # oracle: kv_aware's cost over every cache as it is (a bench-only policy)


@attrs.frozen
class ReuseWorkload:
    name: str
    kind: str = "conversations"
    sessions: int = 64  # conversations, or requests of a shared-prefix workload
    concurrency: int = 16  # closed-loop users
    system_prompt: str = "1000:4000"  # tokens
    groups: int = 8  # distinct system prompts (shared-prefix; conversations get one each)
    turns: str = "3:6"  # conversations: turns per conversation
    user_len: str = "100:500"  # tokens of each new user message
    output_len: str = "100:300"  # tokens of each answer
    image_share: float = 0.0  # conversations: share with an image in the first turn, resent every turn
    think_time_s: float = 0.0  # mean (exponential) pause between an answer and the user's next request
    seed: int = 1


@attrs.frozen
class ReuseTopology:
    mode: str = "aggregated"
    workers: int = 4  # aggregated workers, or prefill workers
    decode_workers: int = 0  # disaggregated

    @property
    def name(self) -> str:
        if self.mode == "aggregated":
            return f"aggregated {self.workers}x"
        return f"disaggregated {self.workers}P:{self.decode_workers}D"

    @property
    def gpus(self) -> int:
        return self.workers + self.decode_workers


@attrs.frozen
class ReuseSpec:
    profile: str = "llama3-8b-h100"
    policies: tuple[str, ...] = ("round_robin", "least_loaded")
    topologies: tuple[ReuseTopology, ...] = (ReuseTopology(),)
    workloads: tuple[ReuseWorkload, ...] = ()
    kv_aware: KvAwareKnobs = KvAwareKnobs()  # kv_aware's and the oracle's knobs (routing.kv_aware)
    # How long a worker's KV events take to reach the index (publication, transport, decoding): kv_aware routes
    # on what it knew that long ago; the oracle reads the caches as they are.
    event_delay_ms: float = 10.0


def load_reuse_spec(path: Path) -> ReuseSpec:
    file = str(path)
    spec = build_attrs(ReuseSpec, yaml.safe_load(path.read_text()), file, "")
    if spec.profile not in PROFILES:
        raise ConfigError(file, "profile", " or ".join(sorted(PROFILES)), spec.profile)
    for i, policy in enumerate(spec.policies):
        if policy not in POLICIES:
            raise ConfigError(file, f"policies[{i}]", " or ".join(POLICIES), policy)
    for i, topology in enumerate(spec.topologies):
        key = f"topologies[{i}]"
        if topology.mode not in TOPOLOGY_MODES:
            raise ConfigError(file, f"{key}.mode", " or ".join(TOPOLOGY_MODES), topology.mode)
        if topology.workers < 1:
            raise ConfigError(file, f"{key}.workers", "an integer >= 1", topology.workers)
        if (topology.mode == "disaggregated") != (topology.decode_workers > 0):
            raise ConfigError(file, f"{key}.decode_workers", "> 0 for disaggregated, 0 for aggregated",
                              topology.decode_workers)
    if not spec.workloads:
        raise ConfigError(file, "workloads", "at least one workload")
    for i, workload in enumerate(spec.workloads):
        key = f"workloads[{i}]"
        if workload.kind not in WORKLOAD_KINDS:
            raise ConfigError(file, f"{key}.kind", " or ".join(WORKLOAD_KINDS), workload.kind)
        for name in ("sessions", "concurrency", "groups"):
            if getattr(workload, name) < 1:
                raise ConfigError(file, f"{key}.{name}", "an integer >= 1", getattr(workload, name))
        for name in ("system_prompt", "turns", "user_len", "output_len"):
            try:
                Range.parse(getattr(workload, name))
            except ValueError:
                raise ConfigError(file, f"{key}.{name}", "N or LOW:HIGH", getattr(workload, name)) from None
        if workload.think_time_s < 0:
            raise ConfigError(file, f"{key}.think_time_s", "a number >= 0", workload.think_time_s)
        if not 0.0 <= workload.image_share <= 1.0:
            raise ConfigError(file, f"{key}.image_share", "a number from 0 to 1", workload.image_share)
    return spec


# ---- the workload: sessions of turns --------------------------------------------------------------------

@attrs.frozen
class Session:
    """One closed-loop user's unit of work: a conversation's turns, or one shared-prefix request."""

    index: int
    system: tuple[int, ...]
    messages: tuple[tuple[int, ...], ...]  # the new user tokens of each turn
    outputs: tuple[int, ...]  # answer length of each turn
    image: str | None = None  # identity of the image its first turn carries
    thinks: tuple[float, ...] = ()  # seconds between each answer and the next turn


def draw_sessions(workload: ReuseWorkload, profile: Profile) -> list[Session]:
    """The seeded sessions of a workload; conversations are cut where the next turn would not fit."""
    rng = random.Random(workload.seed)
    system_len, user_len = Range.parse(workload.system_prompt), Range.parse(workload.user_len)
    output_len, turns = Range.parse(workload.output_len), Range.parse(workload.turns)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.choice(VOCABULARY) for _ in range(n))

    groups = workload.groups if workload.kind == "shared-prefix" else workload.sessions
    systems = [tokens(system_len.draw(rng)) for _ in range(groups)]
    sessions = []
    for index in range(workload.sessions):
        if workload.kind == "shared-prefix":
            session = Session(index, rng.choice(systems), (tokens(user_len.draw(rng)),), (output_len.draw(rng),))
            if workload.think_time_s > 0:  # the user's pause after the answer, before its next request
                session = attrs.evolve(session, thinks=(rng.expovariate(1.0 / workload.think_time_s),))
            sessions.append(session)
            continue
        image = f"conversation-{workload.seed}-{index}" if rng.random() < workload.image_share else None
        length = len(systems[index]) + (profile.image_tokens if image else 0)
        messages, outputs, thinks = [], [], []
        for _ in range(turns.draw(rng)):
            message, answer = user_len.draw(rng), output_len.draw(rng)
            think = rng.expovariate(1.0 / workload.think_time_s) if workload.think_time_s > 0 else 0.0
            if length + message + answer >= profile.max_context_length:
                break
            messages.append(tokens(message))
            outputs.append(answer)
            thinks.append(think)
            length += message + answer
        sessions.append(Session(index, systems[index], tuple(messages), tuple(outputs), image, tuple(thinks)))
    return sessions


# ---- the virtual cluster --------------------------------------------------------------------------------

class _Worker:
    """A simulated worker on the virtual clock, and the candidate the routing policy scores."""

    def __init__(self, role: str, index: int, profile: Profile, id_offset: int):
        self.role, self.address = role, f"{role}-{index}"
        self.scheduler = Scheduler(profile, role, Vocabulary(list(VOCABULARY), eos_id=0), id_offset=id_offset,
                                   mm_keys=True)  # image segments in the KV events, as a revision-3 worker
        self.step: Step | None = None
        self.busy_s = 0.0  # virtual time spent in steps
        # the load is read fresh on every choice here
        self.inflight = self.sent_since_load = self.finished_since_load = 0

    def fresh_load(self, now: float, staleness: float) -> LoadSample:
        # GetLoad as TensorRT-LLM answers it with load metrics on (UPSTREAM load-kv): requests, the queued ones
        # counted in but not told apart, and KV blocks
        s = self.scheduler
        return LoadSample(now, s.running + len(s.waiting), s.used_blocks, s.total_blocks)


class _EventFeed:
    """One simulated worker's KV events into the index, as orchestrator.workers.kv_events does for live ones
    (a digest token as its hex text, mm_keys as segments; the index keys the blocks and keeps the engine
    hash -> our key map for removals)."""

    def __init__(self, index: KvIndex, address: str, clock: VirtualClock | None = None, delay_s: float = 0.0):
        self.index, self.address, self.clock, self.delay_s = index, address, clock, delay_s
        index.set_mode(address, "events")

    def __call__(self, rank: int, events: list) -> None:
        if self.clock is not None and self.delay_s > 0:
            self.clock._at(self.clock.now + self.delay_s, self.apply, rank, events)
        else:
            self.apply(rank, events)

    def apply(self, rank: int, events: list) -> None:
        where = (self.address, rank)
        for event in events:
            if isinstance(event, BlockStored):
                tokens = [t.hex() if isinstance(t, bytes) else t for t in event.token_ids]
                mm = [[MmSegment(k.hash, k.start_offset) for k in block] for block in event.mm_keys] or None
                self.index.stored_engine(where, event.block_hashes, event.parent_block_hash, tokens,
                                         event.block_size, mm)
            elif isinstance(event, BlockRemoved):
                self.index.removed_engine(where, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.index.cleared(self.address, rank)


def _engine_prompt_keys(prompt: Sequence[Token], block_size: int) -> list[int]:
    """The simulated engine's own keys of the prompt's full blocks (sha256 chained from ROOT_KEY), each as
    the int of its digest: exact, and of the key type the routing policy takes (_OracleIndex reads them)."""
    keys: list[int] = []
    key = ROOT_KEY
    for start in range(0, len(prompt) // block_size * block_size, block_size):
        key = engine_block_key(key, prompt[start:start + block_size])
        keys.append(int.from_bytes(key, "big"))
    return keys


class _OracleIndex:
    """Knows every cache as it is: the overlap of a prompt (given as the engine's own block keys,
    _engine_prompt_keys) is read from the simulated workers' prefix caches directly."""

    def __init__(self, workers: list[_Worker]):
        self.workers = workers

    def overlap(self, keys: Sequence[int], now: float) -> dict[tuple[str, int], int]:
        digests = [key.to_bytes(DIGEST_SIZE, "big") for key in keys]
        result = {}
        for worker in self.workers:
            for rank in worker.scheduler.ranks:
                cache, parent, depth = rank.cache, None, 0
                for digest in digests:
                    block = cache.blocks.get(digest)
                    if block is None or block.parent is not parent:
                        break
                    parent, depth = block, depth + 1
                if depth:
                    result[(worker.address, rank.index)] = depth
        return result

    def mode(self, worker: str) -> str:
        return "events"

    def routed(self, where: tuple[str, int], keys: Sequence[int], now: float) -> None:
        pass

    def computing(self, where: tuple[str, int], keys: Sequence[int], depth: int, now: float) -> bool:
        return False  # the oracle sees the caches as they are


@attrs.frozen
class TurnRecord:
    session: int
    turn: int  # 1-based
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    e2e_s: float
    output_tokens: int = 0
    done_at: float = 0.0  # virtual time the answer finished


class ReuseCluster(VirtualClock[_Worker]):
    def __init__(self, topology: ReuseTopology, policy: str, profile: Profile,
                 knobs: KvAwareKnobs = KvAwareKnobs(), event_delay_s: float = 0.0):
        super().__init__()
        self.topology, self.profile, self.policy = topology, profile, policy
        # image tokens after the first are ids above the vocabulary, as in the worker (prefix_cache.py)
        self.id_offset = VOCABULARY.stop
        roles = {"aggregated": topology.workers} if topology.mode == "aggregated" else {
            "prefill": topology.workers, "decode": topology.decode_workers}
        self.workers = {role: [_Worker(role, i, profile, self.id_offset) for i in range(n)]
                        for role, n in roles.items()}
        self.prefill_role = "aggregated" if topology.mode == "aggregated" else "prefill"
        self.index: KvIndex | None = None
        self.reasons: dict[str, int] = {}
        self.policies = {}
        for role in roles:
            name = policy if role == self.prefill_role else ("least_loaded" if policy in ("kv_aware", "oracle")
                                                             else policy)
            if name == "kv_aware":
                self.index = KvIndex()
                for worker in self.workers[role]:
                    worker.scheduler.on_kv_events = _EventFeed(self.index, worker.address, self, event_delay_s)
                self.policies[role] = make_policy("kv_aware", 1.0, index=self.index, knobs=knobs)
            elif name == "oracle":
                self.policies[role] = make_policy("kv_aware", 1.0, index=_OracleIndex(self.workers[role]),
                                                  knobs=knobs)
            else:
                self.policies[role] = make_policy(name, staleness_s=1.0)

    def _pick(self, role: str, prompt: tuple[Token, ...] = (), image: str | None = None,
              image_at: int = 0) -> _Worker:
        keys: list[int] = []
        if role == self.prefill_role and self.policy in ("kv_aware", "oracle"):
            size = self.profile.kv_block_size
            if self.policy == "oracle":
                keys = _engine_prompt_keys(prompt, size)
            else:  # the plan's computation: token ids, and each image by identity where its tokens are
                ids = [0 if isinstance(t, bytes) else t for t in prompt]  # image positions: any id
                images = [PromptImage(image, image_at, self.profile.image_tokens)] if image else []
                keys = prompt_block_keys(ids, size, images)
        decision = self.policies[role].decide(self.workers[role], self.now, keys)
        self.reasons[decision.reason] = self.reasons.get(decision.reason, 0) + 1
        return decision.worker

    def _start_step(self, worker: _Worker) -> None:
        super()._start_step(worker)
        if worker.step is not None:
            worker.busy_s += worker.step.ms / 1000.0

    def utilization(self, role: str) -> float:
        """Busy virtual time of the role's workers over the run's."""
        workers = self.workers[role]
        return sum(w.busy_s for w in workers) / (len(workers) * self.now) if self.now else math.nan

    def run(self, sessions: list[Session], concurrency: int) -> list[TurnRecord]:
        queue = list(reversed(sessions))
        records: list[TurnRecord] = []

        def next_session() -> None:
            if queue:
                start_turn(queue.pop(), 0, ())

        def start_turn(session: Session, turn: int, history: tuple[Token, ...]) -> None:
            if turn == len(session.messages):
                next_session()
                return
            if turn == 0:
                image = (expanded_image(session.image, self.profile.image_tokens, self.id_offset) if session.image
                         else [])
                history = (*session.system, *image)
            prompt = (*history, *session.messages[turn])

            def answered(answer: tuple[int, ...]) -> None:  # the user reads, thinks, and sends the next turn
                think = session.thinks[turn] if turn < len(session.thinks) else 0.0
                self._at(self.now + think, start_turn, session, turn + 1, (*prompt, *answer))

            self._send(session, turn, prompt, records, answered)

        for _ in range(concurrency):
            next_session()
        self.run_events()
        return records

    def _send(self, session: Session, turn: int, prompt: tuple[Token, ...], records: list[TurnRecord],
              then: Callable[[tuple[int, ...]], None]) -> None:
        start = self.now
        first: list[float] = []
        key = request_key([session.index, turn], [], None)

        def on_token(request: SimRequest, token: int) -> None:
            if not first:
                first.append(self.now)

        def finished_after(prefilled: SimRequest):
            """The answer's on_finish; the cached tokens are counted where the prompt was prefilled."""
            def on_finish(request: SimRequest, reason: str, match) -> None:
                records.append(TurnRecord(session.index, turn + 1, len(prompt), prefilled.cached, first[0] - start,
                                          self.now - start, session.outputs[turn], self.now))
                then(tuple(request.output_ids))
            return on_finish

        def leg(kind: str, **extra) -> SimRequest:
            return SimRequest(request_id=f"s{session.index}t{turn}", kind=kind, prompt_len=len(prompt), key=key,
                              max_tokens=session.outputs[turn], ignore_eos=True, tokens=prompt, on_token=on_token,
                              **extra)

        image, image_at = session.image, len(session.system)  # the image follows the system prompt
        if self.topology.mode == "aggregated":
            worker = self._pick("aggregated", prompt, image, image_at)
            request = leg(FULL)
            request.on_finish = finished_after(request)
            self._submit(worker, request)
            return

        owner = self._pick("prefill", prompt, image, image_at)

        def on_context_done(context: SimRequest, first_token: int) -> None:
            # the client sees the first token when the decode streams it, after the pull
            blocks, lease, rank = context.blocks, context.lease, context.rank
            context.blocks, context.lease = 0, None

            def pulled() -> None:  # the decode pulled the KV session: the prefill's blocks are free, cached
                owner.scheduler.release_blocks(blocks, rank, lease)
                decode = self._pick("decode")
                generation = leg(GENERATION_ONLY, first_gen_tokens=(first_token,))
                generation.on_finish = finished_after(context)
                self._submit(decode, generation)

            self._at(self.now + self.profile.kv_transfer_ms(len(prompt)) / 1000.0, pulled)

        context = leg(CONTEXT_ONLY, on_context_done=on_context_done)
        context.max_tokens = 1
        self._submit(owner, context)


# ---- the run and its report ------------------------------------------------------------------------------

def summarize(records: list[TurnRecord]) -> dict:
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    by_turn = {}
    for turn in sorted({r.turn for r in records}):
        of_turn = [r for r in records if r.turn == turn]
        ttfts = [r.ttft_s for r in of_turn]
        by_turn[turn] = {"requests": len(of_turn), "hit_rate": _ratio(sum(r.cached_tokens for r in of_turn),
                                                                      sum(r.prompt_tokens for r in of_turn)),
                         "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90)}
    ttfts = [r.ttft_s for r in records]
    makespan = max((r.done_at for r in records), default=0.0)
    output = sum(r.output_tokens for r in records)
    return {"requests": len(records), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": _ratio(cached, prompt), "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p90_s": percentile(ttfts, 90), "ttft_p99_s": percentile(ttfts, 99),
            "duration_s": max((r.e2e_s for r in records), default=0.0), "makespan_s": makespan,
            "throughput_tok_s": output / makespan if makespan else math.nan,
            "throughput_req_s": len(records) / makespan if makespan else math.nan,
            "by_turn": by_turn}


def _ratio(a: int, b: int) -> float:
    return a / b if b else math.nan


def reuse(spec: ReuseSpec) -> dict:
    profile = PROFILES[spec.profile]
    results = []
    for workload in spec.workloads:
        sessions = draw_sessions(workload, profile)
        for topology in spec.topologies:
            for policy in spec.policies:
                cluster = ReuseCluster(topology, policy, profile, spec.kv_aware, spec.event_delay_ms / 1000.0)
                records = cluster.run(sessions, workload.concurrency)
                results.append({"workload": workload.name, "topology": topology.name, "policy": policy,
                                **summarize(records), "utilization": cluster.utilization(cluster.prefill_role),
                                "utilization_by_role": {role: cluster.utilization(role) for role in cluster.workers},
                                "reasons": dict(sorted(cluster.reasons.items())),
                                "index_blocks": cluster.index.blocks() if cluster.index is not None else None})
    return {"profile": spec.profile, "workloads": [attrs.asdict(w) for w in spec.workloads],
            "kv_aware": attrs.asdict(spec.kv_aware), "event_delay_ms": spec.event_delay_ms, "results": results}


def comparison(document: dict) -> list[dict]:
    """Per workload and topology: each policy against least loaded (the ratios the targets are stated in),
    and kv_aware's hit rate against the oracle's. A ratio without its reference (least loaded or the oracle not
    run, or a zero) is None: no figure rather than a nan."""
    rows = []
    keyed = {(r["workload"], r["topology"], r["policy"]): r for r in document["results"]}

    def ratio(r: dict, reference: dict | None, key: str) -> float | None:
        return r[key] / reference[key] if reference and reference[key] else None

    for (workload, topology, policy), r in keyed.items():
        base = keyed.get((workload, topology, "least_loaded"))
        oracle = keyed.get((workload, topology, "oracle"))
        rows.append({"workload": workload, "topology": topology, "policy": policy,
                     "ttft_p50_vs_least_loaded": ratio(r, base, "ttft_p50_s"),
                     "ttft_p99_vs_least_loaded": ratio(r, base, "ttft_p99_s"),
                     "throughput_vs_least_loaded": ratio(r, base, "throughput_tok_s"),
                     "hit_rate_vs_oracle": ratio(r, oracle, "hit_rate")})
    return rows


def _times(value: float | None, suffix: str = "x") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


def render_markdown(document: dict) -> str:
    lines = ["# Prefix-cache hit rates and TTFT by routing policy", "",
             f"Command: `{document['command']}`. Machine: {document['machine']}.", "",
             f"Profile `{document['profile']}`, virtual clock (the simulated worker's scheduler, prefix cache and "
             "cost model; figures in simulated GPU time). Hit rate = cached prompt tokens / prompt tokens. Load = "
             "the share of the workers' time spent in engine steps (P prefill, D decode). Throughput = output "
             "tokens / the run's simulated duration.", ""]
    if any(r["policy"] in ("kv_aware", "oracle") for r in document["results"]):
        knobs = ", ".join(f"{k} {v:g}" for k, v in document["kv_aware"].items())
        lines += [f"kv_aware: {knobs}; its index is fed by the simulated workers' own KV events, applied "
                  f"{document['event_delay_ms']:g} ms after the step that caused them. oracle: the same cost over "
                  "every worker's cache as it is at the decision. Decode legs of both go least loaded.", ""]
    for workload in document["workloads"]:
        rows = [r for r in document["results"] if r["workload"] == workload["name"]]
        shape = (f"{workload['sessions']} conversations of {workload['turns']} turns" if workload["kind"] ==
                 "conversations" else f"{workload['sessions']} requests in {workload['groups']} groups")
        lines += [f"## {workload['name']}", "",
                  f"{shape}, system prompt {workload['system_prompt']} tokens, user messages {workload['user_len']}, "
                  f"answers {workload['output_len']}, image share {workload['image_share']:g}, think time "
                  f"{workload['think_time_s']:g} s (mean), "
                  f"{workload['concurrency']} users, seed {workload['seed']}.", "",
                  "| topology | routing | requests | hit rate | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | "
                  "throughput tok/s | load | TTFT p50 ms by turn |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            turns = ", ".join(f"{t}: {_fmt(v['ttft_p50_s'] * 1e3)}" for t, v in r["by_turn"].items())
            lines.append(f"| {r['topology']} | {r['policy']} | {r['requests']} | {r['hit_rate']:.1%} | "
                         f"{_fmt(r['ttft_p50_s'] * 1e3)} | {_fmt(r['ttft_p90_s'] * 1e3)} | "
                         f"{_fmt(r['ttft_p99_s'] * 1e3)} | {_fmt(r['throughput_tok_s'])} | "
                         f"{_load(r)} | {turns} |")
        lines.append("")
        ratios = [c for c in comparison(document) if c["workload"] == workload["name"]]
        if any(c["policy"] in ("kv_aware", "oracle") for c in ratios):
            with_oracle = any(c["policy"] == "oracle" for c in ratios)  # no oracle run: no column of dashes
            lines += ["Against least loaded (TTFT: lower is better; throughput: higher)"
                      + (" and the oracle's hit rate:" if with_oracle else ":"), "",
                      "| topology | routing | TTFT p50 | TTFT p99 | throughput | "
                      + ("hit rate / oracle's | " if with_oracle else "") + "decisions |",
                      "|---|---|---|---|---|" + ("---|" if with_oracle else "") + "---|"]
            for c in ratios:
                r = next(x for x in rows if x["topology"] == c["topology"] and x["policy"] == c["policy"])
                reasons = ", ".join(f"{k} {v}" for k, v in r.get("reasons", {}).items() if k != "policy")
                oracle_cell = f"{_times(c['hit_rate_vs_oracle'], '')} | " if with_oracle else ""
                lines.append(f"| {c['topology']} | {c['policy']} | {_times(c['ttft_p50_vs_least_loaded'])} | "
                             f"{_times(c['ttft_p99_vs_least_loaded'])} | {_times(c['throughput_vs_least_loaded'])} | "
                             f"{oracle_cell}{reasons} |")
            lines.append("")
    return "\n".join(lines)


def _load(result: dict) -> str:
    """Busy share of the workers' time, per role (P prefill, D decode) where there are two."""
    roles = result.get("utilization_by_role") or {"": result["utilization"]}
    if len(roles) == 1:
        return f"{next(iter(roles.values())):.0%}"
    return " / ".join(f"{role[0].upper()} {share:.0%}" for role, share in roles.items())


def main_reuse(path: Path, out_dir: Path | None) -> int:
    try:
        spec = load_reuse_spec(path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    document = reuse(spec)
    document["command"] = f"orchestrator bench reuse {path}" + (f" --out {out_dir}" if out_dir else "")
    document["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    for r in document["results"]:
        turns = ", ".join(f"turn {t} {v['ttft_p50_s'] * 1e3:.0f}" for t, v in r["by_turn"].items())
        print(f"{r['workload']} | {r['topology']} | {r['policy']}: hit rate {r['hit_rate']:.1%} "
              f"({r['cached_tokens']}/{r['prompt_tokens']} tokens), TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms "
              f"p99 {r['ttft_p99_s'] * 1e3:.0f} ms, {r['throughput_tok_s']:.0f} tok/s, load "
              f"{r['utilization']:.0%} [{turns}]")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(document, indent=1, default=_json_default) + "\n")
        (out_dir / "report.md").write_text(render_markdown(document))
        if any(r["policy"] in ("kv_aware", "oracle") for r in document["results"]):
            plot(document, out_dir)
        print(f"wrote {out_dir / 'report.md'}")
    return 0


def plot(document: dict, out_dir: Path) -> None:
    """ttft.png (p50 and p99 by policy) and hit_rate.png, one panel per topology, grouped by workload;
    needs matplotlib (the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = document["results"]
    workloads = [w["name"] for w in document["workloads"]]
    topologies = list(dict.fromkeys(r["topology"] for r in results))
    policies = list(dict.fromkeys(r["policy"] for r in results))
    keyed = {(r["workload"], r["topology"], r["policy"]): r for r in results}
    width = 0.8 / len(policies)
    for name, metrics, label in (("ttft.png", ("ttft_p50_s", "ttft_p99_s"), "TTFT ms (bar p50, mark p99)"),
                                 ("hit_rate.png", ("hit_rate",), "prefix-cache hit rate")):
        figure, axes = plt.subplots(1, len(topologies), figsize=(6.5 * len(topologies), 4.5), squeeze=False)
        for axis, topology in zip(axes[0], topologies):
            for j, policy in enumerate(policies):
                xs = [i + (j - (len(policies) - 1) / 2) * width for i in range(len(workloads))]
                scale = 1e3 if metrics[0].startswith("ttft") else 1.0
                values = [keyed[(w, topology, policy)][metrics[0]] * scale if (w, topology, policy) in keyed
                          else math.nan for w in workloads]
                axis.bar(xs, values, width, label=policy)
                if len(metrics) > 1:
                    tails = [keyed[(w, topology, policy)][metrics[1]] * scale if (w, topology, policy) in keyed
                             else math.nan for w in workloads]
                    axis.scatter(xs, tails, marker="_", s=120, color="black")
            axis.set_xticks(range(len(workloads)))
            axis.set_xticklabels([w.replace(" ", "\n", 2) for w in workloads], fontsize=7)
            axis.set_title(topology)
            axis.set_ylabel(label)
            if metrics[0].startswith("ttft"):
                axis.set_yscale("log")
            axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(out_dir / name, dpi=110)
        plt.close(figure)
