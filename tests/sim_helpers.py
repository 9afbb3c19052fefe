"""Small helpers shared by tests that drive sim workers through the engine client."""

import base64

from orchestrator.engine import EngineError, Failed, Finished, PrefillReady, Tokens
from orchestrator.kv import generation_leg
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.prefill import context_only_leg
from orchestrator.synthetic import solid_png


async def recent_requests(engine_client, worker) -> list[dict]:
    """What the simulated worker recorded of its latest Generate calls (GetLoad's `recent_requests`)."""
    from google.protobuf import json_format

    async with engine_client(worker.address) as client:
        load = await client.load()
    return json_format.MessageToDict(load.attributes).get("recent_requests", [])


def png_bytes(width=2, height=2, color=(200, 30, 30)) -> bytes:
    return solid_png(width, height, color)


def data_uri(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def full_request(rid, ids=(11, 12, 13, 14, 15), max_tokens=8, seed=1, media=(), **stopping):
    return g.GenerateRequest(request_id=rid, model="tiny-chat", token_ids=g.TokenIds(ids=list(ids)),
                             sampling=g.SamplingParams(seed=seed), media=list(media),
                             stopping=g.StoppingOptions(max_tokens=max_tokens, **stopping))


async def collect(client, request):
    async with client.generate(request) as stream:
        return [e async for e in stream]


async def read_to_finished(client, request):
    """Generate until its Finished event, then leave the block without reading the call's status.
    Returns the stream (for `ended`) and the events read."""
    events = []
    async with client.generate(request) as stream:
        async for event in stream:
            events.append(event)
            if isinstance(event, Finished):
                break
    return stream, events


async def refusal(client, request) -> EngineError:
    """The error a worker answers `request` with, whether a gRPC status (TensorRT-LLM refuses that way)
    or a terminal GenerateResponse.error (failures after acceptance, and the strict persona)."""
    try:
        events = await collect(client, request)
    except EngineError as exc:
        return exc
    last = terminal(events)
    if not isinstance(last, Failed):
        raise AssertionError(f"expected a refusal, got {events}")
    return last.error


IMAGE_TOKEN_ID = 810  # tiny-chat's <|image|>: the engine wants one placeholder per image


def with_placeholders(ids, images: int):
    return (*ids, *([IMAGE_TOKEN_ID] * images))


def token_ids(events):
    return [t for e in events if isinstance(e, Tokens) for t in e.token_ids]


def terminal(events):
    return events[-1]


async def run_disaggregated(prefill, decode, full: g.GenerateRequest, mutate_decode=None):
    """Context-only leg on `prefill`, then the generation leg on `decode`; returns (ctx events, gen events)."""
    ctx_events = await collect(prefill, context_only_leg(full))
    ready = terminal(ctx_events)
    if not isinstance(ready, PrefillReady):
        return ctx_events, []
    leg = generation_leg(full, ready.kv_session)
    if mutate_decode is not None:
        mutate_decode(leg)
    return ctx_events, await collect(decode, leg)


__all__ = ["IMAGE_TOKEN_ID", "Failed", "Finished", "PrefillReady", "Tokens", "collect", "data_uri", "full_request",
           "png_bytes", "refusal", "run_disaggregated", "terminal", "token_ids", "with_placeholders"]
