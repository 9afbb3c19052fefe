"""The models one orchestrator serves, and which of them a request's `model` means.

Each served model is a `Deployment`: its single-model config (config.Config.models), its own worker pool, KV
index, coordinator, tokenizer, output parsers and metrics view. `ServedModels` resolves a request's `model`:
a model's name or alias; a LoRA adapter's own name (unique across models, checked at load); or
`MODEL:ADAPTER`, an adapter of that model (the way vLLM and SGLang name them). Pure but for the pools' state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs
import trio

from orchestrator.config import Config
from orchestrator.convert import MediaLimits
from orchestrator.decode import OutputSink
from orchestrator.flow.coordinator import Coordinator
from orchestrator.flow.plan import Plan
from orchestrator.frontend.chat_output import OutputParsers
from orchestrator.metrics import Metrics
from orchestrator.tokenizer import ModelTokenizer
from orchestrator.workers.pool import WorkerPool

READY, NOT_READY, DEGRADED = "ready", "not_ready", "degraded"
OWNER = "orchestrator"


class Deployment:
    """One served model and everything that serves it. Plain attributes, read on every request's path."""

    __slots__ = ("config", "coordinator", "pool", "parsers", "metrics", "name", "tokenizer", "media_limits")

    def __init__(self, config: Config, coordinator: Coordinator, pool: WorkerPool, parsers: OutputParsers,
                 metrics: Metrics):
        self.config = config  # the model's single-model view
        self.coordinator, self.pool, self.parsers = coordinator, pool, parsers
        self.metrics = metrics  # the model's view of the process's registry
        self.name: str = config.model.name
        self.tokenizer: ModelTokenizer = coordinator.tokenizer
        limits = config.limits  # what a request body's images may be, by this model's limits
        self.media_limits = MediaLimits(max_url_chars=limits.max_image_url_chars, max_images=limits.max_images,
                                        max_image_bytes=limits.max_image_bytes,
                                        max_total_image_bytes=limits.max_total_image_bytes)

    async def execute(self, plan: Plan, sink: OutputSink, *, watch: Callable[[trio.Nursery], None] | None = None
                      ) -> None:
        """Run the plan (Coordinator.execute), its answer's special tokens kept where this model's output parser
        reads its markers there."""
        await self.coordinator.execute(plan, sink, watch=watch,
                                       keep_special_tokens=self.parsers.keep_special_tokens(plan.api, plan.caps))

    def ready_workers(self) -> dict[str, int]:
        return {role: self.pool.ready_count(role) for role in self.config.needed_roles}

    def state(self, ready_workers: dict[str, int] | None = None) -> str:
        """ready: a ready worker for every role its mode needs; degraded: that, but the registry (etcd) is
        unreachable and the last known pool serves; not_ready: a role has no ready worker. `ready_workers`:
        ready_workers() when the caller has it already."""
        if not all((self.ready_workers() if ready_workers is None else ready_workers).values()):
            return NOT_READY
        return READY if self.pool.registry_healthy else DEGRADED


@attrs.frozen
class Resolved:
    """What a request's `model` names: a deployment, and the LoRA adapter it asks for (None: the base model)."""

    deployment: Deployment
    adapter: str | None = None


class ServedModels:
    def __init__(self, deployments: Sequence[Deployment]):
        if not deployments:
            raise ValueError("an orchestrator serves at least one model")
        self.deployments = tuple(deployments)
        self._names = {name: d for d in self.deployments for name in d.config.model.names}
        self._adapters = {a.name: d for d in self.deployments for a in d.config.model.adapters}
        # Every name a request may send, resolved once: a request's resolution is one dict lookup. An adapter is
        # `ADAPTER` or `NAME:ADAPTER` for each of its model's names (load() checked that they are unique).
        self._resolved: dict[str, Resolved] = {name: Resolved(d) for name, d in self._names.items()}
        for d in self.deployments:
            for adapter in d.config.model.adapters:
                self._resolved[adapter.name] = Resolved(d, adapter.name)
                for name in d.config.model.names:
                    self._resolved.setdefault(f"{name}:{adapter.name}", Resolved(d, adapter.name))
        self.created = int(time.time())  # the `created` /v1/models reports: when this process started serving

    def __iter__(self):
        return iter(self.deployments)

    def __len__(self) -> int:
        return len(self.deployments)

    @property
    def first(self) -> Deployment:
        return self.deployments[0]

    def resolve(self, model: str) -> Resolved | None:
        """The deployment (and adapter) `model` names, or None when nothing served has that name. A model's name
        may itself hold ':' (e.g. "qwen3:8b:rust" is qwen3:8b's adapter rust)."""
        return self._resolved.get(model)

    def ids(self) -> list[str]:
        """Every name a request may use: the models' names and aliases, then the adapters'."""
        return [*self._names, *self._adapters]

    def listing(self) -> list[dict]:
        """`GET /v1/models`: every model, alias and adapter, with its state (an extension field); an adapter
        names its base model as `parent` and `root`, as vLLM lists LoRA modules."""
        out = []
        for d in self.deployments:
            state = d.state()
            for name in d.config.model.names:
                out.append(self._entry(name, state, root=d.name))
            for adapter in d.config.model.adapters:
                out.append(self._entry(adapter.name, state, root=d.name, parent=d.name))
        return out

    def entry(self, model_id: str) -> dict | None:
        """`GET /v1/models/{id}`: one of listing()'s entries, or None."""
        return next((entry for entry in self.listing() if entry["id"] == model_id), None)

    def _entry(self, name: str, state: str, *, root: str, parent: str | None = None) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": OWNER, "root": root,
                "parent": parent, "state": state}
