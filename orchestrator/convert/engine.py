"""API request -> OpenEngine GenerateRequest legs, and the limits that decide max_tokens. Pure.

- `resolve_limits`: the context-window rule and max_tokens (text and media requests differ,
  because the engine expands images into tokens the orchestrator cannot count);
- `check_media_capability`: images go only to workers whose every capability signal says they take
  images on the request's path; `check_media_sources`: and in an encoding they list;
- `full_leg`: the one leg of aggregated mode (and of conditional mode's local path);
- the disaggregated legs are in orchestrator.prefill.legs and orchestrator.kv.legs (the migration's in
  orchestrator.decode.legs).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import attrs

from orchestrator.convert.api import ApiRequest
from orchestrator.convert.media import ImageRef
from orchestrator.errors import InvalidRequest, WorkerDiscoveryFailed, invalid
from orchestrator.openengine.v1 import generation_pb2 as g

if TYPE_CHECKING:  # capabilities are read, never fetched, here
    from orchestrator.engine.capabilities import WorkerCapabilities


@attrs.frozen
class Limits:
    max_tokens: int | None  # None: leave unset, the engine decides (media requests)
    window: int


def resolve_limits(req: ApiRequest, *, prompt_tokens: int, configured_window: int | None,
                   engine_window: int | None, max_output_tokens: int | None) -> Limits:
    """Apply the context-window rule.

    Text: a prompt at or over the window is a 400 naming both numbers; max_tokens is the client's or else
    window - prompt tokens, clamped to that room and to max_output_tokens; a min_tokens above the result is a
    400 naming both numbers.
    Media: the prompt length is only known engine-side, so a configured window tighter than the
    engine's cannot be enforced: refuse. Without a client max_tokens the budget is window - text
    tokens, an upper bound that TensorRT-LLM clamps to its real room (max_seq_len - prompt, images
    included); leaving it unset would let a revision-3 server apply its default of 32 tokens.
    """
    window = configured_window or engine_window
    if req.images:
        if configured_window is not None and engine_window is not None and configured_window < engine_window:
            raise invalid(
                f"requests with images cannot be served under the configured context window of "
                f"{configured_window} tokens: the engine expands images into tokens the orchestrator cannot "
                f"count, and the engine's own window is {engine_window}", param="messages", code="context_window")
        max_tokens = req.max_tokens
        if max_tokens is None and window and window > prompt_tokens:
            max_tokens = window - prompt_tokens
        if max_tokens is not None and max_output_tokens:
            max_tokens = min(max_tokens, max_output_tokens)
        return Limits(max_tokens, window or 0)
    if window is None:
        raise WorkerDiscoveryFailed("the worker did not report a context window (ModelInfo.max_context_length)",
                                    code="context_window_unknown", retry_after=1)
    if prompt_tokens >= window:
        raise invalid(f"the prompt has {prompt_tokens} tokens, which does not fit the context window of "
                      f"{window} tokens", param="messages" if req.kind == "chat" else "prompt",
                      code="context_length_exceeded")
    room = window - prompt_tokens
    # An explicit max_tokens larger than the room left is clamped to it, as TensorRT-LLM's executor does
    # (_deduce_max_tokens: "using default_max_tokens instead"), so a client sees the same answer through us.
    max_tokens = room if req.max_tokens is None else min(req.max_tokens, room)
    if max_output_tokens:
        max_tokens = min(max_tokens, max_output_tokens)
    if req.min_tokens is not None and req.min_tokens > max_tokens:
        # It could never be met: the engine would run into the window (Dynamo: reject_impossible_minimum).
        raise invalid(f"min_tokens ({req.min_tokens}) exceeds the {max_tokens} tokens left for this request "
                      f"(context window {window}, prompt {prompt_tokens} tokens"
                      f"{f', max_tokens {req.max_tokens}' if req.max_tokens is not None else ''})",
                      param="min_tokens", code="min_tokens_unreachable")
    return Limits(max_tokens, window)


def check_media_capability(req: ApiRequest, workers: list[tuple[str, bool, str]]) -> None:
    """`workers`: (role, accepts_images, the capability signals that said so) for every worker touched."""
    if not req.images:
        return
    for role, accepts, signals in workers:
        if not accepts:
            raise invalid(f"model {req.model!r} does not accept images on this path: its {role} worker reports "
                          f"{signals}", param="messages", code="images_not_supported")


def check_worker_media(req: ApiRequest, workers: list[tuple[str, WorkerCapabilities]], *,
                       disaggregated: bool) -> None:
    """Every media rule against what each worker touched reports: images, their encodings, media options."""
    if req.images:
        check_media_capability(req, [(role, *caps.image_support(disaggregated)) for role, caps in workers])
        check_media_sources(req, [(role, caps.multimodal.source_types if caps.multimodal else frozenset())
                                  for role, caps in workers])
    # Gated on the capability field itself, never on schema_revision (upstream relabelled the revisions).
    check_media_options(req, [(role, caps.multimodal is not None and caps.multimodal.per_request_media_options)
                              for role, caps in workers])


def check_worker_features(req: ApiRequest, workers: list[tuple[str, WorkerCapabilities]]) -> None:
    """Every generation feature the request needs, against what each worker it touches advertises
    (ModelInfo.generation), before any leg starts. Both legs of a split request carry the guide, the
    logprobs (the first token is sampled on the prefill worker) and the cache salt, so every worker must take
    them."""
    for role, caps in workers:
        where = f"the {role} worker{f' ({caps.instance_id})' if caps.instance_id else ''}"
        if req.guided is not None and not caps.guided_decoding.takes(req.guided.kind):
            said = ("guided decoding is not supported (ModelInfo.generation.guided_decoding.supported is not "
                    "true: TensorRT-LLM has no grammar backend configured)" if not caps.guided_decoding.supported
                    else f"its guided decoding modes are {', '.join(sorted(caps.guided_decoding.modes))}")
            asked = (f"response_format {req.guided.kind}" if req.guided.param == "response_format"
                     else f"tool_choice {req.tool_use.choice.mode.value!r} (guided by the tools' schemas)")
            raise invalid(f"{asked}: {where} cannot constrain the output: {said}",
                          param=req.guided.param, code="guided_decoding_not_supported")
        if req.logprobs:
            logprobs, top_n = caps.output_logprobs, candidates_asked(req)
            if not logprobs.takes("top_n"):
                raise invalid(f"logprobs: {where} does not return output logprobs by top-n candidates "
                              "(ModelInfo.generation.output_logprobs)", param="logprobs",
                              code="logprobs_not_supported")
            if logprobs.max_top_n is not None and top_n > logprobs.max_top_n:
                raise invalid(f"top_logprobs: {where} returns at most {logprobs.max_top_n} candidates, "
                              f"{top_n} were asked for", param="top_logprobs", code="logprobs_not_supported")
        if req.cache_salt is not None and not caps.supports_cache_salt:
            # The salt is this request's cache namespace (its own cache_salt, or its API key's): sent to a worker
            # that may drop it, the request could reuse, and learn of, another tenant's blocks.
            raise invalid(f"cache_salt: {where} does not isolate its prefix cache by salt "
                          "(ModelInfo.generation.supports_cache_salt is not true), and this request's cache is "
                          "namespaced (its cache_salt or its API key's)", param="cache_salt",
                          code="cache_salt_not_supported")


def serves_features(req: ApiRequest, caps: WorkerCapabilities) -> bool:
    """Whether a worker takes every generation feature the request needs (check_worker_features' rule): what
    a retry or a migration asks of the worker it moves the request to."""
    try:
        check_worker_features(req, [("", caps)])
    except InvalidRequest:
        return False
    return True


def check_media_options(req: ApiRequest, workers: list[tuple[str, bool]]) -> None:
    """`workers`: (role, takes GenerateRequest.media_options: it advertises supports_per_request_media_options)."""
    if req.media_options is None:
        return
    if not req.images:
        raise invalid("media_io_kwargs: only allowed with media in the request", param="media_io_kwargs")
    for role, takes in workers:
        if not takes:
            raise invalid(f"media_io_kwargs: the {role} worker does not take per-request media options (it does "
                          "not advertise supports_per_request_media_options)", param="media_io_kwargs",
                          code="media_options_not_supported")


def check_media_sources(req: ApiRequest, workers: list[tuple[str, frozenset[str]]]) -> None:
    """`workers`: (role, the media encodings it lists; empty when it does not say)."""
    for image in req.images:
        source = "url" if image.url is not None else "data_uri"
        for role, types in workers:
            if types and source not in types:
                name = "an image URL" if source == "url" else "a data: URI"
                raise invalid(f"{image.where}: the {role} worker does not take {name} (it takes "
                              f"{', '.join(sorted(types))})", param=f"{image.where}.image_url.url",
                              code="images_not_supported")


def media_items(images: tuple[ImageRef, ...]) -> list[g.MediaItem]:
    items = []
    for image in images:
        item = g.MediaItem(modality=g.MODALITY_IMAGE, mime_type=image.mime_type, uuid=image.uuid or "")
        if image.url is not None:
            item.url = image.url
        elif image.data_uri is not None:  # exactly one of the two is set
            item.data_uri = image.data_uri
        items.append(item)
    return items


def candidates_asked(req: ApiRequest) -> int:
    """The top_n a leg asks the engine for when the client wants logprobs."""
    return max(1, req.top_logprobs)


_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty")


def full_leg(req: ApiRequest, *, request_id: str, model: str, prompt_ids: list[int] | tuple[int, ...],
             limits: Limits) -> g.GenerateRequest:
    """The complete engine request: prompt tokens, media in order, sampling, stopping, logprobs, guides."""
    # Filled in place: messages built apart and passed to the constructor are copied in (twice the time).
    request = g.GenerateRequest(request_id=request_id, model=model)
    request.token_ids.SetInParent()  # token_ids, sampling and stopping are always present, even empty
    request.token_ids.ids.extend(prompt_ids)
    s, sampling = req.sampling, request.sampling
    sampling.SetInParent()
    for name in _SAMPLING_FIELDS:
        value = getattr(s, name)
        if value is not None:
            setattr(sampling, name, value)
    stopping = request.stopping
    stopping.SetInParent()
    for text in req.stop:
        stopping.conditions.add(stop_text=text)
    for token_id in req.stop_token_ids:
        stopping.conditions.add(stop_token_id=token_id)
    if limits.max_tokens is not None:
        stopping.max_tokens = limits.max_tokens
    if req.min_tokens is not None:
        stopping.min_tokens = req.min_tokens
    if req.ignore_eos:
        stopping.ignore_eos = True
    if req.images:
        request.media.extend(media_items(req.images))
    # We detokenize ourselves (incrementally, with stop strings): the engine need not. Both extensions are
    # TensorRT-LLM's (tensorrt_llm/grpc/openengine/request_mapping.py); other engines ignore `extra`.
    request.extra["detokenize"] = False
    if req.conversation_id is not None:
        request.extra["conversation_id"] = req.conversation_id
    if req.media_options is not None:
        request.media_options.update(json.loads(req.media_options))
    if req.cache_salt is not None:  # both TensorRT-LLM servers pass it to generate_async(cache_salt=...)
        request.kv.cache_salt = req.cache_salt
    if req.lora_adapter is not None:  # on every leg (each is a copy): the decode leg's KV was computed with it
        request.lora_name = req.lora_adapter
    if req.logprobs:
        request.response.return_output_logprobs = True
        # TensorRT-LLM computes the sampled token's own logprob only when at least one candidate is asked for
        # (Dynamo's sidecar convert.rs floors it to 1 for this reason); the extra candidate is not shown.
        request.response.output_candidates.top_n = candidates_asked(req)
    if req.guided is not None:
        if req.guided.kind == "json_schema":
            request.guided.json_schema = req.guided.json_schema
        else:
            request.guided.json_object.SetInParent()
    return request
