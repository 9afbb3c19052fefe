"""LoRA adapters: which the deployment serves, which each worker holds, and where an adapter's request may go.

Pure: no I/O. The pool (pool.py) reads each worker's adapters with Control.ListLoras and loads one with LoadLora;
this module says what those answers mean and which worker an adapter's leg may use.

What TensorRT-LLM's servers do (tests/e2e/test_trtllm_conformance.py, UPSTREAM lora-*): revision 1 answers the
LoRA RPCs UNIMPLEMENTED, reports supports_lora false and refuses a GenerateRequest naming a lora_name. The sibling
server keeps a logical registry: LoadLora validates the adapter's directory and binds its name, id and path for the
life of the process (TensorRT-LLM loads the weights on first use, into a GPU cache of lora_config.max_loras
adapters); a request naming an adapter it does not hold is refused FAILED_PRECONDITION. Its KV cache keys every
block in the adapter's reuse scope (ReuseScope(lora_id, salt)): a prefix cached under one adapter is never reused
by another or by the base model.

So a leg with an adapter goes to a worker that holds it; if none of its role does, the pool loads it on one that
supports LoRA and has room (fewer adapters than its max_loras: beyond it the engine would swap adapters in and out
of its GPU cache request by request). Both legs of a disaggregated request need it: the KV the decode leg pulls
was computed with it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import attrs

# What we keep of a worker's ListLoras answer: at most this many names, each at most MAX_ADAPTER_NAME characters;
# the rest is dropped (and said in /health), never trusted to size anything.
MAX_WORKER_ADAPTERS = 256
MAX_ADAPTER_NAME = 256


def adapter_id(name: str) -> int:
    """The lora_id LoadLora sends for an adapter the configuration gives none: derived from the name, so that
    every orchestrator replica loads it under the same id (the sibling server binds an id to one name for good)
    and 0, which TensorRT-LLM's KV events send for "no adapter", is never one."""
    return 1 + int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % ((1 << 31) - 1)


def _name(instance, attribute, value: str) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_ADAPTER_NAME or not value.isprintable():
        raise ValueError(f"{attribute.name}: a printable name of 1 to {MAX_ADAPTER_NAME} characters, got {value!r}")


@attrs.frozen
class AdapterSpec:
    """One adapter the deployment serves: its name (the API's and the engine's lora_name), the directory the
    workers load it from (their own filesystem: TensorRT-LLM checks for adapter_config.json and the weights there)
    and its lora_id."""

    name: str = attrs.field(validator=_name)
    source_path: str = attrs.field(validator=attrs.validators.min_len(1))
    lora_id: int = attrs.field(validator=attrs.validators.ge(1))


@attrs.frozen
class AdapterCatalog:
    """The adapters of one model, as the configuration names them (model.adapters)."""

    adapters: tuple[AdapterSpec, ...] = ()

    @classmethod
    def of(cls, entries: Sequence[tuple[str, str, int | None]]) -> AdapterCatalog:
        """From (name, source_path, lora_id or None) entries; the id defaults to adapter_id(name)."""
        return cls(tuple(AdapterSpec(name, path, adapter_id(name) if lora_id is None else lora_id)
                         for name, path, lora_id in entries))

    def get(self, name: str) -> AdapterSpec | None:
        return next((spec for spec in self.adapters if spec.name == name), None)



@attrs.frozen
class WorkerAdapters:
    """What one worker said about its adapters. `surface`: it answers the LoRA RPCs (False also before the first
    answer); `names`: the adapters it holds; `detail`: what was wrong with its last answer, for /health."""

    surface: bool = False
    names: frozenset[str] = frozenset()
    detail: str = ""

    def holds(self, name: str) -> bool:
        return name in self.names

    def with_loaded(self, name: str) -> WorkerAdapters:
        return attrs.evolve(self, surface=True, names=self.names | {name})


def listed(names: Sequence[str]) -> WorkerAdapters:
    """A ListLoras answer (its adapters' lora_name, in its order) as what we keep: valid names only, at most
    MAX_WORKER_ADAPTERS of them."""
    valid = [name for name in names if 0 < len(name) <= MAX_ADAPTER_NAME and name.isprintable()]
    problems = []
    if len(valid) < len(names):
        problems.append(f"{len(names) - len(valid)} adapter name(s) empty, too long or not printable")
    if len(valid) > MAX_WORKER_ADAPTERS:
        problems.append(f"{len(valid)} adapters listed, the first {MAX_WORKER_ADAPTERS} kept")
        valid = valid[:MAX_WORKER_ADAPTERS]
    return WorkerAdapters(surface=True, names=frozenset(valid), detail="; ".join(problems))


def room(adapters: WorkerAdapters, supports_lora: bool, max_loras: int | None) -> int:
    """How many more adapters a worker may be given (0: none). It must serve the LoRA RPCs and say supports_lora;
    without a max_loras it is given one at a time beyond what it holds (the engine's own default cache size is
    unknown to us, and a worker that holds none yet is the first choice anyway)."""
    if not (adapters.surface and supports_lora):
        return 0
    if max_loras is None:
        return 1
    return max(0, max_loras - len(adapters.names))


def no_worker_message(name: str, role: str, *, loadable: int) -> str:
    """Why an adapter's leg of `role` has nowhere to go (the 503's message); `loadable`: how many workers of
    the role could take it."""
    if loadable == 0:
        return (f"no {role} worker can serve the LoRA adapter {name!r}: none holds it, and none that supports LoRA "
                "has room to load it")
    return f"no {role} worker holds the LoRA adapter {name!r}"
