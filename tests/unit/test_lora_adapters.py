"""LoRA adapters without processes: the catalog, each worker's adapter state, where an adapter's leg may go, the
pool loading an adapter where none is held, and the KV keys of an adapter's prompt apart from the base model's."""

from __future__ import annotations

from typing import cast

import attrs
import pytest
import trio

from orchestrator.config import RoutingConfig
from orchestrator.engine import EngineClient, EngineError, LoopThread, NoLoraSurface
from orchestrator.engine.capabilities import MAX_LORAS, WorkerCapabilities
from orchestrator.errors import NoWorkerAvailable
from orchestrator.flow.worker_choice import WorkerChoice
from orchestrator.metrics import Metrics
from orchestrator.openengine.v1 import kv_pb2, lora_pb2, model_pb2, server_pb2
from orchestrator.roles import Role
from orchestrator.testkit.fakes import FakeEngineClient, capabilities, fake_worker
from orchestrator.workers.adapters import (
    MAX_ADAPTER_NAME,
    MAX_WORKER_ADAPTERS,
    AdapterCatalog,
    WorkerAdapters,
    adapter_id,
    listed,
    room,
)
from orchestrator.workers.kv_event_codec import Stored, apply_now, decode_proto_batch, event_adapter
from orchestrator.workers.kv_index import KvIndex
from orchestrator.workers.pool import WorkerPool
from orchestrator.workers.prompt_keys import request_block_keys

CATALOG = AdapterCatalog.of([("sql", "/adapters/sql", None), ("poet", "/adapters/poet", 7)])


# ---- the catalog -----------------------------------------------------------------------------------------------

def test_an_adapters_lora_id_is_derived_from_its_name_unless_configured():
    """The sibling server binds an id to one name for the life of its process: every replica must send the same id
    for a name, and never 0 (the KV events' 'no adapter')."""
    assert CATALOG.get("poet") is not None and CATALOG.get("poet").lora_id == 7  # type: ignore[union-attr]
    sql = CATALOG.get("sql")
    assert sql is not None and sql.lora_id == adapter_id("sql") >= 1
    assert adapter_id("sql") != adapter_id("sqL")
    assert all(adapter_id(f"a{i}") >= 1 for i in range(200))


def test_an_adapter_name_must_be_printable_and_bounded():
    with pytest.raises(ValueError):
        AdapterCatalog.of([("", "/p", None)])
    with pytest.raises(ValueError):
        AdapterCatalog.of([("x" * (MAX_ADAPTER_NAME + 1), "/p", None)])
    with pytest.raises(ValueError):
        AdapterCatalog.of([("bad\nname", "/p", None)])


# ---- what a worker says ----------------------------------------------------------------------------------------

def test_a_workers_list_of_adapters_is_trusted_only_within_bounds():
    state = listed(["a", "", "b" * (MAX_ADAPTER_NAME + 1), "c\x00", "d"])
    assert state.surface and state.names == frozenset({"a", "d"}) and "3 adapter name(s)" in state.detail
    many = listed([f"n{i}" for i in range(MAX_WORKER_ADAPTERS + 50)])
    assert len(many.names) == MAX_WORKER_ADAPTERS and "first" in many.detail


def test_room_needs_the_lora_surface_and_supports_lora_and_counts_against_max_loras():
    assert room(WorkerAdapters(), supports_lora=True, max_loras=4) == 0  # no LoRA RPCs (revision 1)
    assert room(listed([]), supports_lora=False, max_loras=4) == 0
    assert room(listed(["a"]), supports_lora=True, max_loras=4) == 3
    assert room(listed(["a", "b"]), supports_lora=True, max_loras=2) == 0
    assert room(listed(["a", "b"]), supports_lora=True, max_loras=None) == 1  # one at a time when not said


def test_capabilities_read_supports_lora_and_bound_max_loras():
    server = server_pb2.ServerInfo(schema_revision=3, capacity=server_pb2.DeploymentCapacity(max_loras=10 ** 9))
    caps = WorkerCapabilities.from_protos(server, model_pb2.ModelInfo(supports_lora=True))
    assert caps.supports_lora and caps.max_loras == MAX_LORAS
    bare = WorkerCapabilities.from_protos(server_pb2.ServerInfo(schema_revision=1), model_pb2.ModelInfo())
    assert not bare.supports_lora and bare.max_loras is None


# ---- the pool places an adapter ---------------------------------------------------------------------------------

class LoraClient(FakeEngineClient):
    """A fake worker with the LoRA RPCs: `refuse` makes LoadLora fail with that error."""

    def __init__(self, name: str, caps: WorkerCapabilities, refuse: EngineError | None = None,
                 holds: tuple[str, ...] = (), surface: bool = True):
        super().__init__(name, caps)
        self.surface = surface
        self.refuse = refuse
        self.holds = holds
        self.loads: list[tuple[str, str, int]] = []

    async def list_loras(self, *, timeout: float | None = 5.0):
        await trio.lowlevel.checkpoint()
        if not self.surface:
            raise NoLoraSurface("no LoRA surface: runtime LoRA enumeration is not supported", worker=self.name,
                                rpc="ListLoras")
        return [lora_pb2.LoraAdapter(lora_name=name) for name in self.holds]

    async def load_lora(self, name: str, source_path: str, lora_id: int, *, timeout: float | None = 60.0):
        self.loads.append((name, source_path, lora_id))
        await trio.sleep(0.01)
        if self.refuse is not None:
            raise self.refuse


def lora_caps(max_loras: int | None = 2, supports_lora: bool = True) -> WorkerCapabilities:
    return attrs.evolve(capabilities("aggregated"), supports_lora=supports_lora, max_loras=max_loras)


def pool_of(*clients: tuple[LoraClient, list[str] | None]) -> WorkerPool:
    """A pool (not running) whose READY workers are these clients, each with these adapters (None: no surface)."""
    pool = WorkerPool(loop_thread=cast(LoopThread, None), metrics=Metrics(), routing=RoutingConfig(), model="m")
    for client, names in clients:
        worker = fake_worker("aggregated", client)
        if names is not None:
            worker.adapters, worker.adapters_read = listed(names), True
        pool.workers[worker.spec] = worker
    return pool


def worker_of(pool: WorkerPool, client: LoraClient):
    return next(w for w in pool.workers.values() if w.address == f"grpc://{client.name}")


def holders(pool: WorkerPool, name: str) -> list[str]:
    """The routable workers holding the adapter, as the pool knows them."""
    return sorted(w.address for w in pool.workers.values() if w.routable and w.adapters.holds(name))


async def test_an_adapter_a_worker_holds_is_not_loaded_again():
    holder, other = LoraClient("w1", lora_caps()), LoraClient("w2", lora_caps())
    pool = pool_of((holder, ["sql"]), (other, []))
    await pool.place_adapter("aggregated", "sql", CATALOG.get("sql"))
    assert holder.loads == other.loads == []
    assert holders(pool, "sql") == ["grpc://w1"]


async def test_a_worker_that_just_connected_is_asked_for_its_adapters_before_one_is_loaded():
    """Its adapter watch has not read ListLoras yet: loading elsewhere would put a second copy beside its own."""
    fresh, other = LoraClient("fresh", lora_caps(), holds=("sql",)), LoraClient("other", lora_caps(4))
    pool = pool_of((fresh, None), (other, []))
    await pool.place_adapter("aggregated", "sql", CATALOG.get("sql"))
    assert other.loads == [] and holders(pool, "sql") == ["grpc://fresh"]


async def test_an_adapter_no_worker_holds_is_loaded_on_the_one_with_the_most_room():
    full, roomy, revision_1 = (LoraClient("full", lora_caps(max_loras=1)), LoraClient("roomy", lora_caps(4)),
                               LoraClient("r1", lora_caps(supports_lora=False), surface=False))
    pool = pool_of((full, ["poet"]), (roomy, ["poet"]), (revision_1, None))
    await pool.place_adapter("aggregated", "sql", CATALOG.get("sql"))
    assert roomy.loads == [("sql", "/adapters/sql", adapter_id("sql"))] and full.loads == revision_1.loads == []
    assert worker_of(pool, roomy).adapters.names == {"poet", "sql"}
    assert holders(pool, "sql") == ["grpc://roomy"]


async def test_a_failed_load_moves_on_to_the_next_worker_and_a_worker_without_the_surface_loses_it():
    gone = NoLoraSurface("no LoRA surface", worker="a", rpc="LoadLora")
    first, second = LoraClient("a", lora_caps(4), refuse=gone), LoraClient("b", lora_caps(3))
    pool = pool_of((first, []), (second, []))
    await pool.place_adapter("aggregated", "sql", CATALOG.get("sql"))
    assert first.loads and second.loads and holders(pool, "sql") == ["grpc://b"]
    assert not worker_of(pool, first).adapters.surface


async def test_no_worker_able_to_hold_the_adapter_is_a_503_naming_it():
    revision_1 = LoraClient("r1", lora_caps(supports_lora=False), surface=False)
    with pytest.raises(NoWorkerAvailable, match="'sql'") as refused:
        await pool_of((revision_1, None)).place_adapter("aggregated", "sql", CATALOG.get("sql"))
    assert refused.value.code == "adapter_unavailable"
    failing = LoraClient("f", lora_caps(), refuse=EngineError("bad path", worker="f", rpc="LoadLora"))
    with pytest.raises(NoWorkerAvailable, match="could load the LoRA adapter 'sql'"):
        await pool_of((failing, [])).place_adapter("aggregated", "sql", CATALOG.get("sql"))
    with pytest.raises(NoWorkerAvailable, match="not among the model's configured adapters"):  # nothing to load
        await pool_of((LoraClient("x", lora_caps()), [])).place_adapter("aggregated", "nope", None)


async def test_requests_for_an_adapter_being_loaded_wait_for_that_load():
    one, two = LoraClient("a", lora_caps(4)), LoraClient("b", lora_caps(4))
    pool = pool_of((one, []), (two, []))
    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(pool.place_adapter, "aggregated", "sql", CATALOG.get("sql"))
    assert len(one.loads) + len(two.loads) == 1


async def test_an_adapters_leg_goes_only_to_a_worker_holding_it():
    pool = pool_of(*[(LoraClient(f"w{i}", lora_caps()), ["sql"] if i == 2 else []) for i in range(4)])
    choice = WorkerChoice(pool, (), lambda size: [], adapter="sql")
    assert {choice.pick(Role.AGGREGATED).address for _ in range(8)} == {"grpc://w2"}
    base = WorkerChoice(pool, (), lambda size: [])
    assert len({base.pick(Role.AGGREGATED).address for _ in range(8)}) == 4
    assert "lora_adapters" in pool.snapshot()[2] and pool.snapshot()[2]["lora_adapters"] == ["sql"]


# ---- KV keys ------------------------------------------------------------------------------------------------------

PROMPT = list(range(100, 164))


def test_an_adapters_prompt_keys_are_apart_from_the_base_models_and_every_other_adapters():
    base = request_block_keys(PROMPT, 16)
    sql, again, poet = (request_block_keys(PROMPT, 16, adapter=a) for a in ("sql", "sql", "poet"))
    assert len(base) == len(sql) == 4 and sql == again
    assert not set(sql) & set(base) and not set(sql) & set(poet)


def test_the_index_keys_an_adapters_events_as_that_adapters_prompts():
    """kv_aware finds an adapter's own prefix (the events name it by lora_name) and never offers it to the base
    model or another adapter."""
    index = KvIndex()
    stored = kv_pb2.KvEvent(block_stored=kv_pb2.BlockStored(
        block_hashes=[kv_pb2.KvBlockHash(value=str(h).encode(), encoding="decimal_int64") for h in (1, 2, 3, 4)],
        token_ids=PROMPT, block_size=16, lora_id=adapter_id("sql"), lora_name="sql"))
    apply_now(index, ("w", 0), decode_proto_batch(kv_pb2.KvEventBatch(events=[stored]), [0]))
    now = 0.0
    assert index.overlap(request_block_keys(PROMPT, 16, adapter="sql"), now) == {("w", 0): 4}
    assert index.overlap(request_block_keys(PROMPT, 16), now) == {}
    assert index.overlap(request_block_keys(PROMPT, 16, adapter="poet"), now) == {}


def test_an_event_of_an_adapter_it_does_not_name_is_not_indexed():
    assert event_adapter(None, None) == event_adapter(0, "") == ""
    assert event_adapter(5, "sql") == "sql"
    assert event_adapter(5, "") is None  # a lora_id without a name: its scope is unknown to us
    index = KvIndex()
    apply_now(index, ("w", 0), _batch(Stored([1, 2, 3, 4], None, PROMPT, 16, adapter=None)))
    assert index.blocks("w") == 0  # not keyed as the base model's, which it is not


def _batch(event: Stored):
    from orchestrator.workers.kv_event_codec import Batch

    return Batch((event,))


async def test_a_restarted_worker_holds_none_of_its_old_processes_adapters_until_it_says_so():
    client = LoraClient("w", lora_caps(4), holds=())
    pool = pool_of((client, ["sql"]))
    worker = worker_of(pool, client)
    worker.adapters_instance = client.caps.instance_id
    worker.identity_checked_at = trio.current_time()  # (no identity RPC: the capabilities say the instance)
    await pool.monitor._check_identity(worker, cast(EngineClient, client))
    assert worker.adapters.holds("sql")  # the same process
    client.caps = attrs.evolve(client.caps, instance_id="restarted")
    await pool.monitor._check_identity(worker, cast(EngineClient, client))
    assert not worker.adapters.holds("sql") and not worker.adapters_read
    await pool.place_adapter("aggregated", "sql", CATALOG.get("sql"))  # read again, then loaded anew
    assert client.loads == [("sql", "/adapters/sql", adapter_id("sql"))]
