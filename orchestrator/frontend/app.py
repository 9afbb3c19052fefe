"""The ASGI application: OpenAI-compatible routes over the coordinator.

Each completion request: read and parse the body (400 on anything malformed) -> plan (400/404/503
before any byte of the response) -> execute in the request's nursery, which is cancelled when the
client disconnects (our server calls back: frontend/server_extensions.py). Every way a request is cut
short from outside (shutdown, disconnect, deadline, a slow body) goes through its one RequestScope
(frontend/request_scope.py), which records why.
A streamed response starts with its first chunk; a failure before that is a plain HTTP error, a failure
after it a final SSE error event and `data: [DONE]`. Every accepted request ends in exactly one terminal
response, also when the shutdown grace ends before it does (`cut_in_flight`: a 503 with Retry-After, or
that final error event).

Memory: a failed request frees its body when its error is handled, not at the next full garbage
collection. No local variable keeps a handled error (its traceback holds the frames that hold the body:
a reference cycle), and the body readers drop their buffers before they raise.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from orchestrator import tracing
from orchestrator.config import Config
from orchestrator.convert import ApiRequest, parse_chat, parse_completion
from orchestrator.convert.api import cache_namespace
from orchestrator.convert.messages import parse_messages
from orchestrator.engine import EngineError
from orchestrator.errors import ModelNotFound, RequestError
from orchestrator.flow.plan import Plan
from orchestrator.flow.prompt import prompt_token_ids
from orchestrator.frontend import messages_api
from orchestrator.frontend import messages_format as mfmt
from orchestrator.frontend import openai_format as fmt
from orchestrator.frontend.auth import ApiKeys
from orchestrator.frontend.errors import ApiError, to_api_error
from orchestrator.frontend.limits import KeyAccount
from orchestrator.frontend.memory import BIG_BODY_BYTES, release_free_memory
from orchestrator.frontend.messages_api import MessagesExchange
from orchestrator.frontend.multiprocess import FrontendProcess
from orchestrator.frontend.request_scope import DISCONNECT, InFlight, RequestScope
from orchestrator.frontend.response_store import open_store
from orchestrator.frontend.responses_api import RESPONSE_PATH, ResponsesExchange, not_found
from orchestrator.frontend.served_models import DEGRADED, NOT_READY, READY, Deployment, ServedModels
from orchestrator.frontend.server_extensions import ServerExtensions
from orchestrator.log import RateLimitedLog, cause_chain
from orchestrator.metrics import Metrics
from orchestrator.parsers import Collector, StreamParser
from orchestrator.processes import SUPERVISOR_STATUS_ENV

log = logging.getLogger(__name__)
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


# The scope key under which the request's API key name travels from the auth check to the handler.
API_KEY = "orchestrator.api_key"
# The scope key of the Deployment a completion request's `model` resolved to (its metrics count the outcome).
SERVED = "orchestrator.served"
_ADAPTER = "orchestrator.lora_adapter"  # and of the LoRA adapter it named (None: the base model)
MODELS_PATH = "/v1/models"


def supervisor_status() -> Any:
    """What `orchestrator launch` says of the workers it supervises (state, restarts, last exit), when it started
    us: a small JSON file it rewrites whole on every change (read in place: a local file, microseconds)."""
    path = os.environ.get(SUPERVISOR_STATUS_ENV)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except (OSError, ValueError) as exc:
        return {"error": f"cannot read {path}: {exc}"}
_ENGINE_ID_PREFIX = secrets.token_hex(3)
_engine_ids = itertools.count()


class ClientGone(Exception):
    pass


def new_request_id(given: str | None) -> str:
    """Honour the client's X-Request-Id when it is sane; engine legs get a unique suffix."""
    if given and len(given) <= 128 and given.isprintable():
        return given
    return f"req-{time.time_ns():x}"


class App:
    def __init__(self, config: Config, models: ServedModels, metrics: Metrics, api_keys: ApiKeys | None = None,
                 frontend: FrontendProcess = FrontendProcess(), tracer=tracing.DISABLED):
        self.config = config  # the deployment's shared sections (http, auth, responses); per model: models
        self.frontend = frontend  # which of the frontend processes behind the port this is
        self.models = models
        # the view of requests that named no served model (a bad body, an unknown model): model ""
        self.metrics = metrics
        self.draining = False
        self.api_keys = api_keys or ApiKeys([])
        self.accounts = {key.name: KeyAccount(key.name, metrics.key_usage(key.name), key.limits)
                         for key in self.api_keys.keys}
        self.cache_salts = {key.name: key.cache_salt for key in self.api_keys.keys if key.cache_salt is not None}
        # auth.keys[].models: the model names (not aliases) a key may use; a key not here may use every model
        self.key_models = {key.name: frozenset(models.resolve(name).deployment.name  # type: ignore[union-attr]
                                               for name in key.models)
                           for key in config.auth.keys if key.models is not None}
        self.tracer = tracer  # tracing.DISABLED unless the config has `tracing:`
        self.failure_log = RateLimitedLog(log, interval=5.0)
        self.in_flight = InFlight()  # the completion requests being served (also a gauge in /metrics)
        self.trim_due = False  # a big body was read: give its memory back once its request is done
        # Read before the request's model is known: the largest any model allows (each model's own limits apply
        # to what is in the body: Deployment.media_limits)
        self.max_request_bytes = max(d.config.limits.max_request_bytes for d in models)
        self.routes: dict[tuple[str, str], Callable] = {
            ("POST", "/v1/chat/completions"): self.chat,
            ("POST", "/v1/completions"): self.completions,
            ("GET", MODELS_PATH): self.list_models,
            ("GET", "/health"): self.health,
            ("GET", "/metrics"): self.metrics_route,
            ("POST", "/v1/responses"): self.responses,
            ("POST", messages_api.PATH): self.messages,
            ("POST", messages_api.PATH + "/count_tokens"): self.count_tokens,
        }
        self.response_store = open_store(config.responses, config.base_dir)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        handler = self.routes.get((scope["method"], scope["path"]))
        if handler is None and scope["path"].startswith(RESPONSE_PATH) and scope["method"] in ("GET", "DELETE"):
            handler = self.stored_response
        if handler is None and scope["path"].startswith(MODELS_PATH + "/") and scope["method"] == "GET":
            handler = self.one_model
        # The Messages API answers in Anthropic's error shape, from the first error on
        error_body = mfmt.error_body if scope["path"].startswith(messages_api.PATH) else ApiError.body
        if handler is not None and self._needs_key(scope["path"]):
            authorizations = _headers(scope, b"authorization")
            if len(authorizations) > 1:  # one credential per request (RFC 9110 11.6.2): which would count?
                error = ApiError(400, f"the request has {len(authorizations)} Authorization headers; send one",
                                 param="authorization", code="bad_request")
                await send_json(send, 400, error_body(error))
                return
            # Anthropic's clients send the key as x-api-key; OpenAI's as a bearer token
            key = self.api_keys.identify(authorizations[0] if authorizations else None) or \
                self.api_keys.identify_plain(_header(scope, b"x-api-key"))
            if key is None:
                error = ApiError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer KEY' (or "
                                 "'x-api-key: KEY')", code="invalid_api_key")
                await send_json(send, 401, error_body(error), [(b"www-authenticate", b"Bearer")])
                return
            scope[API_KEY] = key.name
        if handler is None:
            allowed = [m for (m, p) in self.routes if p == scope["path"]]
            error = (ApiError(405, f"method {scope['method']} is not allowed on {scope['path']}")
                     if allowed else ApiError(404, f"no route {scope['path']}", code="not_found"))
            await send_json(send, error.status, error_body(error))
            return
        await handler(scope, receive, send)
        if self.trim_due:  # a big body was read: its memory is free now that the handler has returned
            self.trim_due = False
            await trio.to_thread.run_sync(release_free_memory)

    def _needs_key(self, path: str) -> bool:
        if not self.api_keys.enabled:
            return False
        if path == "/health":
            return self.config.auth.protect_health
        if path == "/metrics":
            return self.config.auth.protect_metrics
        return True

    # ---- simple routes -------------------------------------------------------------------------
    async def list_models(self, scope, receive, send) -> None:
        await send_json(send, 200, {"object": "list", "data": self.models.listing()})

    async def one_model(self, scope, receive, send) -> None:
        """GET /v1/models/{id}: an id may hold '/' and ':' (an adapter's MODEL:ADAPTER form is not an id)."""
        model_id = scope["path"][len(MODELS_PATH) + 1:]
        entry = self.models.entry(model_id)
        if entry is None:
            error = self._unknown_model(model_id)
            await send_json(send, 404, ApiError(404, error.message, param="model", code=error.code).body())
            return
        await send_json(send, 200, entry)

    async def health(self, scope, receive, send) -> None:
        """Ready only when every model is (the status of each under `models`): a model with no ready worker for
        a role makes the whole 503, while requests for the others are still served. degraded: serving the last
        known pool while the registry (etcd) is unreachable."""
        operator = not self.api_keys.enabled or self.api_keys.identify(_header(scope, b"authorization")) is not None
        models = {d.name: self._model_health(d, operator) for d in self.models}
        states = {each["status"] for each in models.values()}
        ready = states <= {READY, DEGRADED} and not self.draining
        status = ("draining" if self.draining else NOT_READY if NOT_READY in states
                  else READY if states == {READY} else DEGRADED)
        body: dict[str, Any] = {"status": status}
        if len(self.models) == 1:  # the single-model form keeps its model's keys at the top level
            body.update({key: value for key, value in models[self.models.first.name].items() if key != "status"})
        body["models"] = models
        # The operator's view (worker addresses, states, causes): to every caller when no API keys are
        # configured, else only to callers with a key.
        if operator:
            body["frontend"] = self.frontend.describe()
            supervisor = supervisor_status()
            if supervisor is not None:
                body["supervisor"] = supervisor
        await send_json(send, 200 if ready else 503, body)

    @staticmethod
    def _model_health(deployment: Deployment, operator: bool) -> dict[str, Any]:
        pool = deployment.pool
        ready_workers = deployment.ready_workers()
        body: dict[str, Any] = {"status": deployment.state(ready_workers), "mode": deployment.config.mode,
                                "ready_workers": ready_workers}
        if operator:
            body["workers"] = pool.snapshot()
            if not pool.registry_healthy:
                body["registry"] = pool.registry_detail
        return body

    async def metrics_route(self, scope, receive, send) -> None:
        body = self.metrics.render()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    # ---- completions ---------------------------------------------------------------------------
    async def chat(self, scope, receive, send) -> None:
        await self._complete("chat", scope, receive, send)

    async def completions(self, scope, receive, send) -> None:
        await self._complete("completion", scope, receive, send)

    async def responses(self, scope, receive, send) -> None:
        await self._complete("responses", scope, receive, send)

    async def messages(self, scope, receive, send) -> None:
        await self._complete("messages", scope, receive, send)

    async def count_tokens(self, scope, receive, send) -> None:
        """POST /v1/messages/count_tokens: the prompt's tokens as the model's template and tokenizer make them."""
        try:
            body = await read_json(receive, self.max_request_bytes, on_size=self._body_read)
            served = self._served(scope, body)
            api = parse_messages(body, served.media_limits, counting=True)
            tokens = await prompt_token_ids(api, served.tokenizer, window=None)
        except (ApiError, RequestError) as error:
            api_error = to_api_error(error)
            await send_json(send, api_error.status, mfmt.error_body(api_error))
            return
        await send_json(send, 200, {"input_tokens": len(tokens)})

    async def stored_response(self, scope, receive, send) -> None:
        """GET /v1/responses/{id}: the stored response; DELETE: remove it."""
        response_id = scope["path"][len(RESPONSE_PATH):]
        record = await self.response_store.get(response_id) if response_id else None
        if record is None:
            error = not_found(response_id, param=None)
            await send_json(send, 404, error.body())
            return
        if scope["method"] == "DELETE":
            await self.response_store.delete(response_id)
            await send_json(send, 200, {"id": response_id, "object": "response.deleted", "deleted": True})
            return
        await send_json(send, 200, json.loads(record.response))

    def cut_in_flight(self) -> int:
        """The shutdown grace is over: end every completion request still running with a 503 (Retry-After), or
        a stream already started with a final SSE error event and [DONE], rather than leave the HTTP server to
        cut its connection. Their nurseries are cancelled, which aborts their engine work. How many there were."""
        return self.in_flight.cut()

    async def _complete(self, kind: str, scope: Scope, receive: Receive, send: Send) -> None:
        key = scope.get(API_KEY)
        with self.tracer.request(scope, key) as request_span:
            account = self.accounts.get(key) if key is not None else None
            await self._answer(kind, scope, receive, send, account, request_span)

    async def _answer(self, kind: str, scope: Scope, receive: Receive, send: Send, account: KeyAccount | None,
                      request_span) -> None:
        route = "completions" if kind == "completion" else kind  # chat, completions, responses, messages
        request_id = new_request_id(_header(scope, b"x-request-id"))
        request_span.set("orchestrator.request_id", request_id)
        server = ServerExtensions.of(scope)
        response = _Response(send, [(b"x-request-id", request_id.encode())], server.send_now)
        if kind == "messages":  # every failure of this request in Anthropic's shape, a body or an event
            MessagesExchange.adapt(response)
        self.metrics.inflight.inc()
        request = RequestScope(server.on_disconnect)
        self.in_flight.add(request)
        outcome = "error"
        try:
            with request.cancel_scope:
                outcome = await self._serve_completion(kind, scope, server, request_id, response, receive, account,
                                                       request)
            if request.cancel_scope.cancelled_caught:  # cut by the shutdown (RequestScope.shut_down)
                outcome = "error"
                await response.error(ApiError(503, "the server shut down before this request finished; retry it",
                                              code="draining", retry_after=1))
        finally:
            self.in_flight.discard(request)
            self.metrics.inflight.dec()
            served: Deployment | None = scope.get(SERVED)
            (self.metrics if served is None else served.metrics).request_done(route, outcome)
            request_span.set("orchestrator.outcome", outcome)
            if served is not None:
                request_span.set("gen_ai.request.model", served.name)

    async def _serve_completion(self, kind: str, scope: Scope, server: ServerExtensions, request_id: str,
                                response: _Response, receive: Receive, account: KeyAccount | None,
                                request: RequestScope) -> str:
        """Serve one completion request; its outcome for the metrics. Every failure is answered here."""
        admitted = False
        try:
            if account is not None:  # before the body is read: a key over its limits costs nothing more
                account.admit()
                admitted = True
            parsed = await self._parse(kind, scope, server, receive, request, request_id)
            served: Deployment = scope[SERVED]
            exchange: ResponsesExchange | MessagesExchange | None = None
            if isinstance(parsed, ApiRequest):
                api = parsed
            else:
                api, exchange = parsed.api, parsed
                exchange.adapt(response)
            # Engine request ids must be unique per worker even when clients reuse an X-Request-Id
            # (and across orchestrators): a per-process random prefix and a counter.
            engine_id = f"{request_id}-{_ENGINE_ID_PREFIX}{next(_engine_ids):x}"
            if api.n > 1:
                return await self._run_choices(served, kind, request_id, api, response, request, account)
            with tracing.span("plan"):
                plan = await served.coordinator.plan(api, engine_id)
            if account is not None:
                account.planned(plan.prompt_tokens)
            if exchange is not None:
                return await self._run_exchange(served, exchange, request_id, plan, response, request)
            return await self._run(served, kind, request_id, api, plan, response, request)
        # Each handler hands the error on and keeps no reference to it: `error` is deleted when its clause
        # ends, while a local holding it would form a cycle (error -> traceback -> this frame -> error) that
        # keeps every frame of the traceback, the request body among their locals, until a full GC pass.
        except (ApiError, RequestError, EngineError) as error:
            return await self._refuse(error, request_id, response)
        except trio.TooSlowError:
            return await self._refuse(ApiError(408, f"the request body did not arrive within "
                                                    f"{self.config.http.body_timeout_s:g} s",
                                               code="request_timeout"), request_id, response)
        except ClientGone:
            why = server.bad_body()
            if why is None:
                return "disconnected"
            return await self._refuse(ApiError(400, f"the request body is malformed: {why}", code="bad_request"),
                                      request_id, response)
        except Exception:
            log.exception("request %s failed", request_id)
            await response.error(ApiError(500, f"internal error while serving request {request_id}"))
            return "error"
        finally:
            if admitted and account is not None:  # (admitted: it has one)
                account.ended(response.usage)

    async def _refuse(self, error: Exception, request_id: str, response: _Response) -> str:
        """Answer a failed request with its error (logged with its cause chain when it is ours); its outcome."""
        api_error = to_api_error(error)
        if api_error.status >= 500:  # the client's body is scrubbed; the whole story is here
            self.failure_log("request %s failed with %d: %s", request_id, api_error.status, cause_chain(error))
        await response.error(api_error)
        return "client_error" if api_error.status < 500 else "error"

    async def _parse(self, kind: str, scope: Scope, server: ServerExtensions, receive: Receive,
                     request: RequestScope, request_id: str) -> ApiRequest | ResponsesExchange | MessagesExchange:
        """The request body read, parsed and validated: an ApiRequest, or for the Responses and Messages APIs
        their exchange (the chat request it runs as, and how its answer is written). Refused before any of it is
        read when it announces more than limits.max_request_bytes."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="draining", retry_after=1)
        limit = self.max_request_bytes
        announced = _header(scope, b"content-length")
        if announced is not None and announced.isdigit() and int(announced) > limit:
            raise _too_large(limit)
        if server.body_arrived:  # our server has all of it: nothing to wait for
            body = await read_json(receive, limit, on_size=self._body_read)
        else:
            with request.body_limit(self.config.http.body_timeout_s):  # a slow or short body (slowloris)
                body = await read_json(receive, limit, on_size=self._body_read)
        served = self._served(scope, body)
        media_limits = served.media_limits
        exchange: ResponsesExchange | MessagesExchange
        if kind == "messages":
            exchange = MessagesExchange(body, request_id, media_limits)
        elif kind == "responses":
            exchange = await ResponsesExchange.parse(body, self.response_store, request_id, media_limits,
                                                     served.tokenizer)
        else:
            return self._salted(scope, parse_chat(body, media_limits) if kind == "chat" else parse_completion(body))
        exchange.api = self._salted(scope, exchange.api)
        return exchange

    def _served(self, scope: Scope, body: Any) -> Deployment:
        """The deployment the body's `model` names (kept in the scope: its metrics count the request); ModelNotFound
        (404) for a name nothing serves, a 403 for a model the request's API key may not use. A body without a
        model name is read with the first model's parser, which refuses it in its API's own words (counted
        under no model)."""
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model:
            return self.models.first
        resolved = self.models.resolve(model)
        if resolved is None:
            raise self._unknown_model(model)
        scope[SERVED], scope[_ADAPTER] = resolved.deployment, resolved.adapter
        allowed = self.key_models.get(scope.get(API_KEY, ""))
        if allowed is not None and resolved.deployment.name not in allowed:
            raise ApiError(403, f"this API key may not use the model {model!r}; it may use "
                           f"{', '.join(sorted(allowed))}", param="model", code="model_not_allowed",
                           type="permission_error")
        return resolved.deployment

    def _unknown_model(self, model: str) -> ModelNotFound:
        return ModelNotFound(f"the model {model!r} does not exist; this server serves "
                             f"{', '.join(self.models.ids())}", param="model", code="model_not_found")

    def _salted(self, scope: Scope, api: ApiRequest) -> ApiRequest:
        """The request's KV cache namespace: its API key's salt and its own `cache_salt` (auth.keys[].cache_salt
        isolates a key's cache from every other key's); and the LoRA adapter its `model` named."""
        namespace = cache_namespace(self.cache_salts.get(scope.get(API_KEY, "")), api.cache_salt)
        adapter = scope.get(_ADAPTER)
        if namespace == api.cache_salt and adapter is None:
            return api
        return attrs.evolve(api, cache_salt=namespace, lora_adapter=adapter)

    def _body_read(self, size: int) -> None:
        self.trim_due |= size >= BIG_BODY_BYTES  # also when the body turns out bad: its memory goes back too

    async def _run(self, served: Deployment, kind: str, request_id: str, api, plan: Plan, response: _Response,
                   request: RequestScope) -> str:
        model = api.model
        created = int(time.time())
        token_text = served.tokenizer.token_text
        parser = served.parsers.for_request(api, request_id, plan.caps)
        sink: _StreamingSink | _CollectingSink
        if api.stream:
            # The SSE headers go out with the first chunk: the engine leg starts without waiting for
            # them, and a failure before the first byte is still a plain HTTP error with its status.
            sink = _StreamingSink(response, fmt.ChunkWriter(kind, request_id, model, created), api, token_text,
                                  per_token=not self.config.http.coalesce_tokens, parser=parser)
        else:
            sink = _CollectingSink(kind, api, token_text, parser=parser)
        if not await self._execute(served, plan, sink, response, request):
            return "error"
        if isinstance(sink, _StreamingSink):  # api.stream
            if not response.streaming:
                await response.start_stream()
            await response.end_stream()
        else:
            await send_json(response.send, 200, sink.response(request_id, model, created), response.headers)
            response.usage = (sink.prompt_tokens, sink.completion_tokens, sink.cached_tokens)
        return "ok"

    async def _execute(self, served: Deployment, plan: Plan, sink, response: _Response, request: RequestScope) -> bool:
        """Run the plan into the sink, in the request's scope; False when it failed after the stream started (its
        failure event is written). A failure before that is raised, for a plain error response; ClientGone when
        the client went."""
        try:
            await served.execute(plan, sink, watch=request.watch)
        except (ApiError, RequestError, EngineError) as error:
            if not response.streaming:
                raise
            await response.stream_error(to_api_error(error))
            return False
        if request.ended is DISCONNECT:
            raise ClientGone()
        return True

    async def _run_exchange(self, served: Deployment, exchange: ResponsesExchange | MessagesExchange, request_id: str,
                            plan: Plan, response: _Response, request: RequestScope) -> str:
        """Run a request of an API whose answer is blocks (the Responses and Messages APIs): the same execution as
        a chat request's, with its exchange's sink, answer and record."""
        parser = served.parsers.for_request(exchange.api, request_id, plan.caps)
        sink = exchange.make_sink(parser, response.chunk, plan.prompt_tokens)
        if not await self._execute(served, plan, sink, response, request):
            return "error"
        answer = exchange.response()
        await exchange.keep(self.response_store, answer)
        response.usage = (sink.prompt_tokens, sink.completion_tokens, sink.cached_tokens)
        if exchange.api.stream:
            await response.chunk(exchange.finish_event(answer))
            await response.end_stream()
        else:
            await send_json(response.send, 200, answer, response.headers)
        return "ok"

    async def _run_choices(self, served: Deployment, kind: str, request_id: str, api, response: _Response,
                           request: RequestScope, account: KeyAccount | None) -> str:
        """`n` > 1: a request per choice, planned and run as any other (its own workers, retries, migration),
        all at once in one nursery, each writing its own choice index; the first failure ends them all, as the
        answer is one response. A client's seed becomes seed + index, so the choices differ and replay alike.

        OpenEngine can ask one leg for several sequences (SamplingParams.num_sequences, which TensorRT-LLM's
        revision 1 maps to n = best_of); a request per choice instead keeps every mode, migration and the KV
        rule as they are for one sequence, and kv_aware routing finds the shared prompt cached."""
        plans = []
        with tracing.span("plan"):
            for index in range(api.n):
                seed = api.sampling.seed
                choice_api = attrs.evolve(api, n=1, sampling=attrs.evolve(
                    api.sampling, seed=None if seed is None else (seed + index) % 2**64))
                plans.append(await served.coordinator.plan(
                    choice_api, f"{request_id}-{_ENGINE_ID_PREFIX}{next(_engine_ids):x}"))
        if account is not None:
            account.planned(sum(plan.prompt_tokens for plan in plans))
        model, created = api.model, int(time.time())
        token_text = served.tokenizer.token_text
        streams: list[_ChoiceStream] = []
        sinks: list[_StreamingSink | _CollectingSink] = []
        for index, plan in enumerate(plans):
            parser = served.parsers.for_request(api, f"{request_id}-{index}", plan.caps)
            if api.stream:
                streams.append(_ChoiceStream(response))
                sinks.append(_StreamingSink(streams[-1], fmt.ChunkWriter(kind, request_id, model, created, index),
                                            api, token_text, per_token=not self.config.http.coalesce_tokens,
                                            parser=parser, include_usage=False))
            else:
                sinks.append(_CollectingSink(kind, api, token_text, parser=parser))

        async def run_choice(index: int) -> None:
            plan = plans[index]
            await served.execute(plan, sinks[index])
            if streams:  # its finish: now, not with [DONE] (the other choices still stream)
                await response.chunk(streams[index].tail)

        try:
            async with trio.open_nursery() as choices:
                request.watch(choices)  # the client going cancels every choice's flow
                for index in range(len(plans)):
                    choices.start_soon(run_choice, index)
        except BaseExceptionGroup as group:
            error = _first_failure(group)
            if not response.streaming or not isinstance(error, (ApiError, RequestError, EngineError)):
                raise error from None
            await response.stream_error(to_api_error(error))
            return "error"
        if request.ended is DISCONNECT:
            raise ClientGone()
        answered = ([stream.usage or (0, 0, None) for stream in streams] if streams else
                    [(sink.prompt_tokens, sink.completion_tokens, sink.cached_tokens) for sink in sinks
                     if isinstance(sink, _CollectingSink)])
        prompt_tokens, cached_tokens = answered[0][0], answered[0][2]  # one prompt, counted once
        completion_tokens = sum(completion for _, completion, _ in answered)
        response.usage = (prompt_tokens, completion_tokens, cached_tokens)
        if api.stream:
            if not response.streaming:
                await response.start_stream()
            if api.include_usage:
                response.tail += fmt.ChunkWriter(kind, request_id, model, created).usage(
                    prompt_tokens, completion_tokens, cached_tokens)
            await response.end_stream()
        else:
            choices_body = [sink.choice(index) for index, sink in enumerate(sinks)
                            if isinstance(sink, _CollectingSink)]
            await send_json(response.send, 200, fmt.full_response(kind, request_id, model, created, choices_body,
                                                                  prompt_tokens, completion_tokens, cached_tokens),
                            response.headers)
        return "ok"


def _first_failure(group: BaseExceptionGroup) -> BaseException:
    """The error that ended a request's choices: the first that is not the others' cancellation."""
    for error in _leaves(group):
        if not isinstance(error, trio.Cancelled):
            return error
    return group


def _leaves(error: BaseException):
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


# ---- output sinks (decode/deltas.py's OutputSink) ------------------------------------------------

class _StreamingSink:
    """An SSE stream. On our server over plain TCP, with one choice, its deltas may also be written from the engine
    connection's reader task (direct delivery: decode/progress.py has the contract): it is then its own `direct`
    writer."""

    _now: _Response  # the response direct delivery writes to (set only when it can: see `direct`)

    def __init__(self, response: _Response | _ChoiceStream, writer: fmt.ChunkWriter, api, token_text, *,
                 per_token: bool, parser: StreamParser | None = None, include_usage: bool | None = None):
        self.response, self.writer, self.api, self.token_text = response, writer, api, token_text
        # the usage chunk after the finish (None: as the request asks; a request with several choices sends one
        # for all of them instead)
        self.include_usage = include_usage
        self.per_token = per_token  # one SSE event per token, unless http.coalesce_tokens
        self.offset = 0
        self.parser = parser  # the answer's output parser (chat_output.py); None: its text is the content
        self.tool_calls = False  # whether the parser has streamed a tool call (the finish says tool_calls)
        # Direct delivery writes with the server's send_now: not over TLS (no send_now), nor for one choice of
        # several (they share one response, written from their request's tasks only).
        self._writes_now = False
        if isinstance(response, _Response) and response.send_now is not None:
            self._now, self._writes_now = response, True

    async def deltas(self, items) -> None:
        if len(items) == 1:
            await self.response.chunk(self._event(*items[0]))
        else:  # An SSE event per token, one write for the batch: the socket write is the dominant cost.
            await self.response.chunk(self._events(items))

    @property
    def direct(self) -> _StreamingSink | None:
        # (a property, not an attribute: a sink holding itself would be a reference cycle, freed only by the
        # garbage collector, with its response and parser)
        return self if self._writes_now else None

    # ---- its DirectWriter part (decode/deltas.py), reached through `direct` only (so `_now` is set) ----
    @property
    def can_write_now(self) -> bool:
        return self._now.can_send_now

    def deltas_now(self, items) -> bool:
        """The same events written at once, from the task that calls this (the reader task, in a direct
        delivery); False when part of them waits for `flush()`."""
        return self._now.chunk_now(self._events(items))

    async def flush(self) -> None:
        await self._now.flush()

    def _events(self, items) -> bytes:
        if self.api.logprobs:
            return b"".join([self._event(text, ids, logprobs) for text, ids, logprobs in items])
        parser = self.parser
        if parser is None:
            # no logprobs and no text offsets to track: the events are texts between fixed fragments
            return self.writer.deltas([text for text, _, _ in items])
        parsed = [parser.feed(text) for text, _, _ in items]
        if not any(delta.reasoning or delta.tool_calls for delta in parsed):  # plain content: the same path
            return self.writer.deltas([delta.content for delta in parsed if delta.content])
        self.tool_calls |= any(delta.tool_calls for delta in parsed)
        return b"".join([self.writer.parsed(delta) for delta in parsed if delta])

    def _event(self, text, token_ids, logprobs) -> bytes:
        lp = None
        if self.api.logprobs and (logprobs := logprobs or fmt.unknown_logprobs(token_ids)):
            top = self.api.top_logprobs
            lp = (fmt.chat_logprobs(logprobs, self.token_text, top) if self.writer.kind == "chat"
                  else fmt.completion_logprobs(logprobs, self.token_text, self.offset, top))
        self.offset += len(text)
        if self.parser is None:
            return self.writer.delta(text, lp)
        parsed = self.parser.feed(text)
        if not parsed.reasoning and not parsed.tool_calls:  # content only, the common case
            return self.writer.delta(parsed.content, lp) if parsed.content or lp is not None else b""
        self.tool_calls |= bool(parsed.tool_calls)
        return self.writer.parsed(parsed, lp)

    def ending(self) -> None:
        self.response.ending = True

    async def finish(self, reason: str, prompt_tokens: int, completion_tokens: int, *,
                     cached_tokens: int | None = None, stop_text: str | None = None) -> None:
        self.response.usage = (prompt_tokens, completion_tokens, cached_tokens)
        data = b""
        if self.parser is not None:  # what the parser held back (a partial tag, a call read whole at the end)
            parsed = self.parser.finish()
            self.tool_calls |= bool(parsed.tool_calls)
            if parsed:
                data = self.writer.parsed(parsed)
            if self.tool_calls and reason == "stop":
                reason = "tool_calls"
        data += self.writer.finish(reason)
        if self.api.include_usage if self.include_usage is None else self.include_usage:
            data += self.writer.usage(prompt_tokens, completion_tokens, cached_tokens)
        self.response.tail += data  # sent with `data: [DONE]` in one write


class _CollectingSink:
    """A whole response, sent once the request is done: written only from the request's task."""

    per_token = False  # one response at the end: no reason to split batches
    direct = None  # nothing to write before the end: no direct delivery

    def __init__(self, kind: str, api, token_text, *, parser: StreamParser | None = None):
        self.kind, self.api, self.token_text = kind, api, token_text
        self.parser = parser  # the answer's output parser; it reads the text as it arrives, as a stream's would
        self.collector = Collector()
        self.parts: list[str] = []
        self.logprobs: list = []
        self.reason = "stop"
        self.prompt_tokens = self.completion_tokens = 0
        self.cached_tokens: int | None = None

    async def deltas(self, items) -> None:
        parser, logprobs_asked = self.parser, self.api.logprobs
        for text, token_ids, logprobs in items:
            if parser is None:
                self.parts.append(text)
            else:
                self.collector.add(parser.feed(text))
            if logprobs_asked:
                self.logprobs.extend(logprobs or fmt.unknown_logprobs(token_ids))

    def ending(self) -> None:
        pass

    async def finish(self, reason: str, prompt_tokens: int, completion_tokens: int, *,
                     cached_tokens: int | None = None, stop_text: str | None = None) -> None:
        if self.parser is not None:
            self.collector.add(self.parser.finish())
            if reason == "stop" and self.collector.message().tool_calls:
                reason = "tool_calls"
        self.reason, self.prompt_tokens, self.completion_tokens = reason, prompt_tokens, completion_tokens
        self.cached_tokens = cached_tokens

    def choice(self, index: int = 0) -> dict:
        lp = None
        if self.api.logprobs:
            top = self.api.top_logprobs
            lp = (fmt.chat_logprobs(self.logprobs, self.token_text, top) if self.kind == "chat"
                  else fmt.completion_logprobs(self.logprobs, self.token_text, 0, top))
        answer = "".join(self.parts) if self.parser is None else self.collector.message()
        return fmt.choice(self.kind, index, answer, self.reason, lp)

    def response(self, request_id: str, model: str, created: int) -> dict:
        return fmt.full_response(self.kind, request_id, model, created, [self.choice()], self.prompt_tokens,
                                 self.completion_tokens, self.cached_tokens)


class _ChoiceStream:
    """One choice's side of a stream with several (`n` > 1): its events go out through the request's response
    as they come, its finish when its flow ends (`tail`). No direct delivery: choices share one socket, and
    their writes stay in their request's tasks."""

    def __init__(self, response: _Response):
        self.response = response
        self.tail = b""  # the choice's finish, written once its flow has ended
        self.ending = False  # (the one-choice stream's optimisation; a choice's finish waits in `tail` anyway)
        self.usage: tuple[int, int, int | None] | None = None

    async def chunk(self, data: bytes) -> None:
        await self.response.chunk(data)


# ---- ASGI plumbing -------------------------------------------------------------------------------

class _Response:
    """Tracks what was sent so that exactly one terminal response goes out."""

    def __init__(self, send: Send, headers: list, send_now: Callable[[bytes], bool] | None = None):
        self.send = send
        self.send_now = send_now  # our server's ServerExtensions.send_now, if there is one
        # How this API writes a failure: as a body, and as a stream's last event (with its end marker). OpenAI's
        # by default; the Responses and Messages APIs set their own (their exchanges).
        self.error_body: Callable[[ApiError], dict] = ApiError.body
        self.stream_failure: Callable[[ApiError], bytes] = lambda error: fmt.error_event(error.body()) + fmt.DONE
        self.end_marker = fmt.DONE
        self.headers = headers
        self.streaming = False
        self.done = False
        self.tail = b""  # the final chunk(s) of a stream, written together with [DONE]
        self.ending = False  # the engine has finished: further chunks join the tail
        self.usage: tuple[int, int, int | None] | None = None  # (prompt, completion, cached) of the answer

    async def start_stream(self) -> None:
        self.streaming = True
        await self.send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), *self.headers]})

    async def chunk(self, data: bytes) -> None:
        if self.ending:  # the stream's last tokens: they leave with the finish and [DONE]
            self.tail += data
            return
        if not self.streaming:
            await self.start_stream()
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    @property
    def can_send_now(self) -> bool:
        return self.streaming and self.send_now is not None and not self.ending and not self.done

    def chunk_now(self, data: bytes) -> bool:
        """A chunk of a started stream written at once; False when part of it waits for `flush()`."""
        send_now = self.send_now  # set (the caller checked can_send_now): the None test only narrows the type
        return send_now is not None and send_now(data)

    async def flush(self) -> None:
        await self.send({"type": "http.response.body", "body": b"", "more_body": True})

    async def end_stream(self) -> None:
        self.done = True
        await self.send({"type": "http.response.body", "body": self.tail + self.end_marker, "more_body": False})

    async def stream_error(self, error: ApiError) -> None:
        self.done = True
        await self.send({"type": "http.response.body", "body": self.stream_failure(error), "more_body": False})

    async def error(self, error: ApiError) -> None:
        if self.done:
            return
        if self.streaming:
            await self.stream_error(error)
            return
        self.done = True
        extra = list(self.headers)
        if error.retry_after is not None:
            extra.append((b"retry-after", str(int(max(1, error.retry_after))).encode()))
        await send_json(self.send, error.status, self.error_body(error), extra)


def _headers(scope: Scope, name: bytes) -> list[str]:
    """Every value of header `name`, in order."""
    return [value.decode("latin-1") for key, value in scope.get("headers", ()) if key == name]


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


def _ignore_size(size: int) -> None:
    pass


async def read_json(receive: Receive, limit: int, *, on_size: Callable[[int], None] = _ignore_size) -> Any:
    """The JSON body; `on_size` is told its size in bytes once it is read (also when it is then refused).
    Nothing raised from here refers to the body: its buffers are dropped first (see the module docstring)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            chunks.clear()
            raise ClientGone()
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            del body, message
            chunks.clear()
            on_size(size)
            raise _too_large(limit)
        chunks.append(body)
        if not message.get("more_body"):
            break
    del body, message
    raw = b"".join(chunks)
    chunks.clear()
    on_size(len(raw))
    if not raw:
        raise ApiError(400, "the request body is empty; expected a JSON object")
    # A big body (images as data URIs, long prompts) is parsed on a worker thread: the event loop keeps
    # serving every other stream meanwhile.
    value, problem = _decode_json(raw) if len(raw) < 1 << 20 else await trio.to_thread.run_sync(_decode_json, raw)
    param = None
    if problem is None and (_ESCAPED_SURROGATE.search(raw) or (b"\xed" in raw and _ENCODED_SURROGATE.search(raw))
                            or b"\x00" in raw[:4]):
        param = _lone_surrogate_at(value)
        if param is not None:
            problem = f"{param}: the string holds a lone UTF-16 surrogate (not valid Unicode text)"
    del raw
    if problem is not None:
        del value
        raise ApiError(400, problem, param=param)
    return value


def _decode_json(raw: bytes) -> tuple[Any, str | None]:
    """(the value, None) or (None, why not). Returns instead of raising: an error raised through
    trio.to_thread.run_sync forms a cycle with the outcome that carried it (its traceback holds the frame
    that holds the outcome), and a JSONDecodeError keeps the whole decoded text as its `doc`."""
    try:
        return json.loads(raw), None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, f"the request body is not valid JSON: {exc}"  # short: line, column and position
    except RecursionError:
        return None, "the request body nests too deeply"
    except ValueError as exc:  # e.g. an integer of more than 4,300 digits
        return None, f"the request body is not usable JSON: {exc}"


# JSON may spell a lone UTF-16 surrogate as an escape ("\ud800"), or as its three UTF-8-style bytes (ED A0 80:
# json.loads decodes bytes with "surrogatepass"); such a string has no UTF-8 form, so no engine (and no protobuf
# string) can take it. Only bodies that hold either form, or are UTF-16/32 (a NUL in the first 4 bytes: how
# json.loads tells), are walked. Two searches: one pattern with both forms has no literal to scan for (4x
# slower on every body).
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_ENCODED_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def _lone_surrogate_at(value, where: str = "body") -> str | None:
    """Where the first string holding a lone surrogate is (None: nowhere)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate_at(key, where) or _lone_surrogate_at(
                item, f"{key}" if where == "body" else f"{where}.{key}")
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate_at(item, f"{where}[{i}]")
            if found is not None:
                return found
    return None


async def send_json(send: Send, status: int, body: Any, headers: list | None = None) -> None:
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": data})
