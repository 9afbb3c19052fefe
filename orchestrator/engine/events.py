"""Typed events of a Generate stream, decoded from `GenerateResponse` messages.

One small frozen class per event kind, so the coordinator matches on types instead of poking at
protobuf oneofs. Decoding is on the hot path of every token: it does no more than it must, and
`decode_bytes` reads a plain token message's ids from its bytes (engine/token_message.py), and shares
one event among the messages whose bytes say the same.
"""

from __future__ import annotations

import attrs

from orchestrator.engine.errors import EngineError, ErrorCode, from_engine_error
from orchestrator.engine.token_message import event_token_ids, without_request_id
from orchestrator.log import bounded
from orchestrator.openengine.v1 import generation_pb2, kv_pb2

FinishReason = generation_pb2.FinishReason
# FINISH_REASON_CANCELLED has no name here: a cancel we did not ask for is a failure (engine/errors.py
# EngineCancelled), one we asked for has no client left to tell; no OpenAI client knows a "cancelled" finish.
_REASON_NAMES: dict[int, str] = {FinishReason.FINISH_REASON_LENGTH: "length"}
# The finish reasons a generation can end with. Any other number (UNSPECIFIED, which revision 1 sends for an engine
# finish_reason it does not map, formatting.py `_finish_event`, or one a later schema adds) says nothing about how
# the answer ended: it is a failure of that worker (a 502 naming it), never guessed as "stop".
_KNOWN_REASONS = frozenset({FinishReason.FINISH_REASON_STOP, FinishReason.FINISH_REASON_LENGTH,
                            FinishReason.FINISH_REASON_CANCELLED})


@attrs.frozen(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int | None = None

    @classmethod
    def from_proto(cls, usage: generation_pb2.Usage) -> Usage:
        cached = usage.cached_prompt_tokens if usage.HasField("cached_prompt_tokens") else None
        return cls(usage.prompt_tokens, usage.completion_tokens, cached)


@attrs.frozen(slots=True)
class TokenLogprob:
    """A token's logprob and its candidates'; `logprob` None: the engine sent this token without one (a
    generation leg one logprob short: TensorRT-LLM's context worker does not transfer the first token's)."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


# Revision 1 floors logprobs at this (formatting.py clamp_logprob: a masked token's -inf); the sibling server
# copies them unclamped. Every logprob is clamped here, whichever server sent it: no JSON holds -Infinity.
MIN_LOGPROB = -9999.0


def clamp_logprob(value: float) -> float | None:
    """A logprob the client can be shown: within [MIN_LOGPROB, 0]; NaN (no value at all) is None."""
    if value != value:  # NaN
        return None
    return min(max(value, MIN_LOGPROB), 0.0)


def _token_logprob(info: generation_pb2.TokenInfo) -> TokenLogprob:
    top = tuple((c.token_id, value) for c in info.candidates if (value := clamp_logprob(c.logprob)) is not None)
    return TokenLogprob(info.token_id, clamp_logprob(info.logprob) if info.HasField("logprob") else None, top)


@attrs.frozen(slots=True)
class Tokens:
    """New output tokens, in order. `logprobs` is empty unless they were asked for."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen(slots=True)
class PrefillReady:
    """The context-only leg is done; `kv_session` must reach the decode leg unchanged."""

    kv_session: kv_pb2.KvSessionRef
    usage: Usage | None = None


@attrs.frozen(slots=True)
class Finished:
    reason: int  # FinishReason
    usage: Usage | None = None
    stop_token_id: int | None = None
    stop_text: str | None = None
    message: str = ""

    @property
    def reason_name(self) -> str:
        return _REASON_NAMES.get(self.reason, "stop")


@attrs.frozen(slots=True)
class Failed:
    """A terminal `GenerateResponse.error`; `error.code` and `error.retryable` say what and whether."""

    error: EngineError


Event = Tokens | PrefillReady | Finished | Failed


def decode(response: generation_pb2.GenerateResponse, *, worker: str) -> Event | None:
    kind = response.WhichOneof("event")
    if kind == "token":
        infos = response.token.tokens
        if len(infos) == 1 and not infos[0].HasField("logprob"):  # the common case: one plain token
            return Tokens((infos[0].token_id,))
        ids = tuple(t.token_id for t in infos)
        # logprobs for every token when any has one: a token without (None) keeps its place, never its neighbour's
        if any(t.HasField("logprob") for t in infos):
            return Tokens(ids, tuple(_token_logprob(t) for t in infos))
        return Tokens(ids)
    usage = Usage.from_proto(response.usage) if response.HasField("usage") else None
    if kind == "finished":
        finished = response.finished
        if finished.reason not in _KNOWN_REASONS:
            return Failed(unknown_finish(finished.reason, finished.message, worker=worker))
        match = finished.stop_match.WhichOneof("match") if finished.HasField("stop_match") else None
        return Finished(
            reason=finished.reason,
            usage=usage,
            stop_token_id=(finished.stop_match.stop_token_id if match == "stop_token_id"
                           else finished.stop_match.eos_token_id if match == "eos_token_id" else None),
            stop_text=finished.stop_match.stop_text if match == "stop_text" else None,
            message=finished.message,
        )
    if kind == "prefill_ready":
        return PrefillReady(response.prefill_ready.kv_session, usage)
    if kind == "error":
        return Failed(from_engine_error(response.error, worker=worker, rpc="Generate"))
    return None  # prompt logprobs and future event kinds: not used by the orchestrator


def unknown_finish(reason: int, message: str, *, worker: str) -> EngineError:
    """A Finished whose reason we do not know, as the worker's failure (not retried: the worker said it is done)."""
    name = "FINISH_REASON_UNSPECIFIED" if reason == FinishReason.FINISH_REASON_UNSPECIFIED else f"FinishReason {reason}"
    said = f" ({bounded(message, 200)})" if message else ""
    return EngineError(f"the worker ended the generation with {name}, which says neither stop, length nor cancelled"
                       f"{said}", worker=worker, rpc="Generate", code=ErrorCode.ERROR_CODE_INTERNAL)


_GENERATE_RESPONSE = generation_pb2.GenerateResponse.FromString


def decode_bytes(payload: bytes, *, worker: str) -> Event | None:
    """`decode` of a serialized GenerateResponse; a plain token message skips the protobuf parse."""
    event = without_request_id(payload)
    if event is not None:
        tokens = _TOKEN_EVENTS.get(event)
        if tokens is not None:
            return tokens
        ids = event_token_ids(event)
        if ids is not None:
            tokens = Tokens(tuple(ids))
            if len(ids) == 1 and len(_TOKEN_EVENTS) < _TOKEN_EVENTS_LIMIT:
                _TOKEN_EVENTS[event] = tokens
            return tokens
    return decode(_GENERATE_RESPONSE(payload), worker=worker)


# A one-token message's bytes after its request_id depend only on the token (and the delta text and output
# index a worker may add), and Tokens is frozen: the event read from those bytes once is shared by every
# later message with the same bytes, skipping the read and the allocation. Kept for what it saves on every
# streamed token: 0.7-1.1 us a message against 3.8-5.4 us without it (TensorRT-LLM-shaped messages, 4 paired
# runs on the loaded 2-core VM, 2026-12-05), next to a serve CPU per streamed token of 13-20 us. The limit
# bounds the table against a worker that sends arbitrary ids or texts: full, with a short delta text in each
# message, it holds about 15 MB. With grpcio it is filled on the loop thread: a dict's get and set are atomic.
_TOKEN_EVENTS: dict[bytes, Tokens] = {}
_TOKEN_EVENTS_LIMIT = 1 << 16
