"""The per-request flow: plan the legs, then run them in one trio nursery per request.

    plan()     tokenize, choose workers, apply capability gating and the context-window rule, build
               the engine request (pure conversion lives in orchestrator.convert);
    execute()  open the request's nursery (the caller's disconnect watch cancels it) and
               dispatch: one leg (aggregated, or conditional's local path) to the decode stage, or the
               prefill stage then the decode stage, joined by a KV lease (orchestrator.kv), in
               orchestrator.flow.request_flow.

Any cancellation (client disconnect, deadline, shutdown) cancels the nursery; the stages abort the work
on every worker involved and keep the KV rule, so no prefill blocks are stranded.

The coordinator is the flow's only creator: it builds the stages once and hands them to every RequestFlow
as one FlowCollaborators; the flow never reaches back into the coordinator.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from orchestrator.config import Config
from orchestrator.convert import ApiRequest, check_worker_features, check_worker_media, full_leg, resolve_limits
from orchestrator.decode import OutputSink
from orchestrator.decode.stage import DecodeStage
from orchestrator.engine import DiscoveryFailed, EngineError, WorkerCapabilities
from orchestrator.errors import InvalidRequest, NoWorkerAvailable, RequestTimedOut, WorkerDiscoveryFailed
from orchestrator.flow.plan import AGGREGATED, DISAGGREGATED, LOCAL, Plan, PlanPath, planned
from orchestrator.flow.prompt import prompt_token_ids
from orchestrator.flow.request_flow import FlowCollaborators, RequestFlow
from orchestrator.flow.worker_choice import WorkerChoice
from orchestrator.kv.release import KvReleaser
from orchestrator.media_policy import UrlPolicy, check_image_urls
from orchestrator.metrics import Metrics
from orchestrator.prefill.stage import PrefillStage
from orchestrator.roles import Role
from orchestrator.tokenizer import ModelTokenizer
from orchestrator.workers.adapters import AdapterCatalog
from orchestrator.workers.pool import Worker, WorkerPool
from orchestrator.workers.prompt_keys import request_block_keys, salted


class Coordinator:
    def __init__(self, config: Config, pool: WorkerPool, tokenizer: ModelTokenizer, metrics: Metrics):
        self.config, self.pool, self.tokenizer, self.metrics = config, pool, tokenizer, metrics
        # The model's LoRA adapters (model.adapters): where to load each from
        self.adapters = AdapterCatalog.of(
            [(a.name, a.resolved_source_path(config.base_dir), None) for a in config.model.adapters])
        limits = config.limits
        releaser = KvReleaser(pool, metrics, limits.kv_cleanup_timeout_s)
        self.flow_parts = FlowCollaborators(
            pool=pool, metrics=metrics, tokenizer=tokenizer, releaser=releaser,
            prefill=PrefillStage(pool, metrics, releaser, retries=limits.prefill_retries,
                                 cleanup_timeout_s=limits.kv_cleanup_timeout_s),
            decode=DecodeStage(pool, metrics, releaser, retries=limits.decode_retries,
                               cleanup_timeout_s=limits.kv_cleanup_timeout_s),
            migration_limit=limits.migration_limit)
        self.url_policy = UrlPolicy.from_allowlist(limits.image_url_allowlist)
        self.kv_roles = config.kv_aware_roles  # (a property: derived once, not per request)

    # ---- planning ----------------------------------------------------------------------------------
    async def plan(self, api: ApiRequest, request_id: str) -> Plan:
        await check_image_urls([(i.where, i.url) for i in api.images if i.url is not None], self.url_policy)
        prompt_ids = await prompt_token_ids(api, self.tokenizer,
                                            window=self.config.model.context_window or self.pool.largest_window())
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param="messages" if api.kind == "chat" else "prompt")
        choice = WorkerChoice(self.pool, self.kv_roles, lambda size: self._prompt_keys(api, prompt_ids, size),
                              adapter=api.lora_adapter)
        path = self._path(api, len(prompt_ids), choice)
        await self._place_adapter(api, path.roles)
        workers = tuple(choice.pick(role) for role in path.roles)
        await choice.settled()  # behind a prefix an earlier request is computing there (kv_aware)
        caps = tuple([await self._capabilities(w) for w in workers])
        if path is LOCAL and not caps[0].runs_whole_requests_on_decode:
            # The sibling server's declared decode role refuses a request without a KV session: prefill elsewhere.
            await self._place_adapter(api, (Role.PREFILL,))
            path, workers = DISAGGREGATED, (choice.pick(Role.PREFILL), *workers)
            caps = (await self._capabilities(workers[0]), *caps)
        touched = [(w.role, c) for w, c in zip(workers, caps)]
        check_worker_media(api, touched, disaggregated=path is DISAGGREGATED)
        check_worker_features(api, touched)
        windows = [c.max_context_length for c in caps if c.max_context_length]
        outputs = [c.max_output_tokens for c in caps if c.max_output_tokens]
        limits = resolve_limits(api, prompt_tokens=len(prompt_ids), configured_window=self.config.model.context_window,
                                engine_window=min(windows) if windows else None,
                                max_output_tokens=min(outputs) if outputs else None)
        full = full_leg(api, request_id=request_id, model=caps[-1].model_id or api.model, prompt_ids=prompt_ids,
                        limits=limits)
        return planned(path, workers, request_id=request_id, api=api, full=full, prompt_tokens=len(prompt_ids),
                       target_ranks=tuple(choice.target_ranks.items()), caps=caps)

    async def _place_adapter(self, api: ApiRequest, roles: tuple[Role, ...]) -> None:
        """A request with a LoRA adapter: a worker of each role of its path holds it (loaded now where none did,
        workers/adapters.py). Both legs of a split request run with it: the KV the decode leg pulls was computed
        with the adapter."""
        if api.lora_adapter is None:
            return
        for role in roles:
            await self.pool.place_adapter(role, api.lora_adapter, self.adapters.get(api.lora_adapter))

    def _path(self, api: ApiRequest, prompt_tokens: int, choice: WorkerChoice) -> PlanPath:
        """The mode's path for this request, before its workers' capabilities are known."""
        mode, max_local = self.config.mode, self.config.conditional.max_local_prefill_length
        if mode == "aggregated":
            return AGGREGATED
        if mode == "conditional" and not api.images:
            if prompt_tokens <= max_local:
                return LOCAL
            # A longer prompt still runs whole where a decode worker holds its prefix (kv_aware).
            if self.kv_roles and choice.find_holder(prompt_tokens, max_local):
                return LOCAL
        return DISAGGREGATED

    def _prompt_keys(self, api: ApiRequest, prompt_ids: list[int], block_size: int) -> list[int]:
        """The prompt's KV block keys cut in `block_size`, images laid out as the KV events showed them."""
        index = self.pool.kv_index
        return salted(request_block_keys(prompt_ids, block_size, api.images, self.tokenizer.image_token_id,
                                         self.config.routing.kv_aware.image_tokens,
                                         index.image_length if index is not None else None,
                                         adapter=api.lora_adapter), api.cache_salt)

    async def _capabilities(self, worker: Worker) -> WorkerCapabilities:
        unavailable = f"{worker.role} worker {worker.address} is not available"
        client = worker.client
        if client is None:  # closed since it was picked
            raise NoWorkerAvailable(unavailable, retry_after=1)
        try:
            cached = client.cached_capabilities
            if cached is not None:  # the usual case: no pass through the scheduler for it
                return cached
            return await client.capabilities()
        except DiscoveryFailed as exc:
            raise WorkerDiscoveryFailed(f"capability discovery of {worker.role} worker {worker.address} failed: "
                                        f"{exc.message}", code="worker_discovery_failed", retry_after=1) from exc
        except EngineError as exc:
            raise NoWorkerAvailable(unavailable, retry_after=1) from exc

    # ---- execution ---------------------------------------------------------------------------------
    async def execute(self, plan: Plan, sink: OutputSink, *,
                      watch: Callable[[trio.Nursery], None] | None = None, keep_special_tokens: bool = False) -> None:
        """Run the plan in the request's own nursery. `watch(nursery)` is called once it is open: the caller
        arranges for its cancellation when the client goes (a callback, or a watcher task started in it).
        `keep_special_tokens`: the answer's text keeps them (the output parser the caller runs reads its markers
        there).
        Raises RequestError/EngineError; trio.Cancelled if an outer scope cancelled it (after every worker
        was released)."""
        started = trio.current_time()
        timeout = self.config.limits.request_timeout_s
        flow_ended = False
        try:
            async with trio.open_nursery() as request_nursery:
                # The request's deadline is its nursery's own: a second cancel scope per request (fail_after)
                # cost ~3% of a one-token request's CPU. The watch cancels the same scope when the client goes.
                request_nursery.cancel_scope.deadline = started + timeout
                if watch is not None:
                    watch(request_nursery)
                try:
                    await RequestFlow(self.flow_parts, plan, sink, started,
                                      keep_special_tokens=keep_special_tokens).run()
                    flow_ended = True
                finally:
                    if request_nursery.child_tasks:
                        request_nursery.cancel_scope.cancel()  # stop a watcher task
        except BaseExceptionGroup as group:
            raise _sole_error(group) from None
        scope = request_nursery.cancel_scope  # cancelled by its deadline, or by the watch (checked by the caller)
        if not flow_ended and scope.cancelled_caught and trio.current_time() >= scope.deadline:
            raise RequestTimedOut(f"the request did not finish within {timeout:g} s", code="timeout")


def _sole_error(group: BaseExceptionGroup) -> BaseException:
    """The request nursery runs one flow and one watcher that never fails: unwrap their one error."""
    errors = group.exceptions
    while len(errors) == 1 and isinstance(errors[0], BaseExceptionGroup):
        errors = errors[0].exceptions
    return errors[0] if len(errors) == 1 else group

