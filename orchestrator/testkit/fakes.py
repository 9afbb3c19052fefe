"""A scripted fake engine client and pool, for unit tests of the stages that need no process and no gRPC.

    prefill = FakeEngineClient("prefill-0", capabilities("prefill"), script=lambda request: [
        Wait(0.05), Send(Tokens((42,))), Wait(0.01), Send(PrefillReady(session))])
    decode = FakeEngineClient("decode-0", capabilities("decode"), script=lambda request: [
        Send(Tokens((7,)), Finished(FinishReason.FINISH_REASON_LENGTH))])
    pool = FakePool([fake_worker("prefill", prefill), fake_worker("decode", decode)])

(`Tokens`, `PrefillReady`, `Finished` and `FinishReason` from orchestrator.engine.events; `session`: a
kv_pb2.KvSessionRef.)

A script maps each Generate request to steps: `Wait(seconds)` (on trio's clock, so `autojump_clock`
makes it instant), `Send(*events)`, `Fail(error)` (the RPC raises), `Hang()` (nothing more, ever). The
client records every call (`calls`), which streams were left before their script ended (`cancelled`),
and what Abort was asked (`aborts`). Exported by the testkit (orchestrator.testkit.plugin).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, cast

import attrs
import trio

from orchestrator.discovery.snapshots import WorkerSpec
from orchestrator.engine import EngineError
from orchestrator.engine.capabilities import FeatureSupport, WorkerCapabilities
from orchestrator.engine.events import Event, Failed, Finished, PrefillReady
from orchestrator.errors import NoWorkerAvailable
from orchestrator.openengine.v1 import generation_pb2, kv_pb2
from orchestrator.workers.states import WorkerState

if TYPE_CHECKING:
    from orchestrator.engine import EngineClient


@attrs.frozen
class Wait:
    seconds: float


@attrs.frozen(init=False)
class Send:
    events: tuple[Event, ...]

    def __init__(self, *events: Event):
        self.__attrs_init__(tuple(events))


@attrs.frozen
class Fail:
    error: EngineError


@attrs.frozen
class Hang:
    pass


Step = Wait | Send | Fail | Hang


def capabilities(role: str = "unspecified", *, abort_cleanup: bool = False, window: int = 4096,
                 schema_revision: int = 1, handoff_profile: str = "") -> WorkerCapabilities:
    return WorkerCapabilities(instance_id="fake", role=role, engine="fake", schema_revision=schema_revision,
                              models=("m",), model_id="m", max_context_length=window, max_output_tokens=None,
                              supports_multimodal=False, multimodal=None, supports_abort_cleanup=abort_cleanup,
                              total_kv_blocks=None, handoff_profile=handoff_profile,
                              output_logprobs=FeatureSupport(True, frozenset({"top_n"}), max_top_n=20),
                              supports_cache_salt=True)  # as revision 1 advertises (control.py GetModelInfo)


class _FakeStream:
    def __init__(self, steps: Sequence[Step]):
        self._steps = list(steps)
        self.finished = False

    async def next_batch(self) -> list[Event]:
        while self._steps:
            if isinstance(self._steps[0], Hang):  # stays: every later read hangs too
                await trio.sleep_forever()
            step = self._steps.pop(0)
            if isinstance(step, Wait):
                await trio.sleep(step.seconds)
            elif isinstance(step, Send):
                await trio.lowlevel.checkpoint()
                if any(isinstance(e, (Finished, Failed, PrefillReady)) for e in step.events):
                    self.finished = True  # a terminal event: the engine is done with this request
                return list(step.events)
            elif isinstance(step, Fail):
                self.finished = True
                raise step.error
        self.finished = True
        await trio.lowlevel.checkpoint()
        return []


class FakeEngineClient:
    def __init__(self, name: str, caps: WorkerCapabilities | None = None,
                 script: Callable[[generation_pb2.GenerateRequest], Sequence[Step]] = lambda request: []):
        self.name = self.address = name
        self.caps = caps or capabilities()
        self.script = script
        self.calls: list[tuple[str, Any]] = []  # (rpc, its request)
        self.cancelled: list[str] = []  # request ids whose stream was left before its script ended
        self.aborts: list[object] = []  # request ids and kv sessions asked to abort
        self.metadata: dict[str, tuple] = {}  # the gRPC metadata each Generate call was sent with, by request id

    @asynccontextmanager
    async def generate(self, request: generation_pb2.GenerateRequest, metadata: tuple[tuple[str, str], ...] = ()):
        copy = generation_pb2.GenerateRequest()
        copy.CopyFrom(request)
        self.calls.append(("Generate", copy))
        self.metadata[request.request_id] = tuple(metadata)
        stream = _FakeStream(self.script(copy))
        try:
            yield stream
        finally:
            if not stream.finished:
                self.cancelled.append(request.request_id)

    async def abort(self, *, request_id: str | None = None, kv_session: kv_pb2.KvSessionRef | None = None,
                    timeout: float | None = 5.0, metadata: tuple[tuple[str, str], ...] = ()):
        await trio.lowlevel.checkpoint()
        target = request_id if request_id is not None else kv_session
        self.calls.append(("Abort", target))
        self.aborts.append(target)

    async def capabilities(self) -> WorkerCapabilities:
        await trio.lowlevel.checkpoint()
        return self.caps

    @property
    def cached_capabilities(self) -> WorkerCapabilities:
        return self.caps

    def generated(self) -> list[generation_pb2.GenerateRequest]:
        return [request for rpc, request in self.calls if rpc == "Generate"]


def fake_worker(role: str, client: FakeEngineClient):
    """A pool Worker (orchestrator.workers.pool.Worker) that is READY and talks to `client`."""
    from orchestrator.workers.pool import Worker

    worker = Worker(WorkerSpec(address=f"grpc://{client.name}", role=role, model="m", instance_id=client.name))
    worker.client = cast("EngineClient", client)  # the calls the pool and the stages make, scripted
    worker.state = WorkerState.READY
    return worker


class FakePool:
    """The part of WorkerPool the stages and the coordinator use: pick (round robin per role), lease,
    report_unreachable, largest_window."""

    def __init__(self, workers):
        self.workers = list(workers)
        self.unreachable: list[tuple[object, EngineError]] = []
        self._turn = 0

    def pick(self, role: str, exclude=(), accepts=None):
        candidates = [w for w in self.workers if w.role == role and w.routable and w not in exclude
                      and (accepts is None or accepts(w))]
        if not candidates:
            raise NoWorkerAvailable(f"no {role} worker is available", code="no_worker_available", retry_after=1)
        self._turn += 1
        return candidates[self._turn % len(candidates)]

    def largest_window(self) -> int | None:
        return max((w.client.caps.max_context_length or 0 for w in self.workers), default=None) or None

    @contextmanager
    def lease(self, worker) -> Iterator[object]:
        worker.inflight += 1
        try:
            yield worker
        finally:
            worker.inflight -= 1

    def report_unreachable(self, worker, error: EngineError) -> None:
        worker.state = WorkerState.UNHEALTHY
        self.unreachable.append((worker, error))
