"""Scheduler events -> GenerateResponse messages: tokens, finishes, the context leg's token and PrefillReady."""

from __future__ import annotations

import uuid as uuidlib

from orchestrator.openengine.v1 import generation_pb2
from orchestrator.sim import handoff, kv_transfer, output
from orchestrator.sim.outbox import Outbox
from orchestrator.sim.scheduler import CONTEXT_ONLY, GENERATION_ONLY, SimRequest
from orchestrator.sim.worker_state import SimWorkerState


class ResponseCallbacks(SimWorkerState):
    """The scheduler's callbacks for one request, as responses in its outbox; mixed into SimWorker."""

    def _token_response(self, rid: str, want_logprobs: bool, top_n: int, *, first_without_logprob: bool = False):
        """`first_without_logprob`: a generation leg, whose first token (the context phase's, replayed from
        first_gen_tokens) comes without its logprob, as TensorRT-LLM's: the context worker does not transfer it
        (revision 1 formatting.py `_logprob_shortfall`)."""
        GenerateResponse, TokenOutput, TokenInfo = (generation_pb2.GenerateResponse, generation_pb2.TokenOutput,
                                                    generation_pb2.TokenInfo)
        vocab_words = self.vocab.word_ids

        def token_response(token: int, position: int) -> generation_pb2.GenerateResponse:
            info = TokenInfo(token_id=token)
            if want_logprobs and not (first_without_logprob and position == 0):
                info.logprob = _logprob(token, position)
                for rank in range(top_n):
                    alt = vocab_words[(token + rank * 31) % len(vocab_words)]
                    info.candidates.add(token_id=alt, logprob=info.logprob - rank * 0.5, rank=rank + 1)
            return GenerateResponse(request_id=rid, token=TokenOutput(output_index=0, tokens=[info]))

        return token_response

    def _token_callback(self, outbox: Outbox, token_response, stop_texts: list[str]):
        def on_token(request: SimRequest, token: int) -> None:
            outbox.put(token_response(token, request.generated - 1))
            if stop_texts:
                text = self.tokenizer.decode(request.output_ids[-16:])
                for stop in stop_texts:
                    if stop in text and self.scheduler.cancel(request):
                        request.on_finish(request, "stop", ("stop_text", stop))
                        return

        return on_token

    def _finish_callback(self, outbox: Outbox, rid: str, prompt_len: int):
        reasons = {"stop": generation_pb2.FINISH_REASON_STOP, "length": generation_pb2.FINISH_REASON_LENGTH,
                   "cancelled": generation_pb2.FINISH_REASON_CANCELLED}

        def on_finish(request: SimRequest, reason: str, match) -> None:
            if reason == "cancelled" and request.kind == CONTEXT_ONLY and self.persona.session_profile:
                # The sibling server encodes the result's disaggregated_params on `finished` whatever the finish
                # reason (servicer.py Generate, prefill role): a context phase cancelled while it ran yields a
                # PrefillReady built from the request's own parameters, naming a session nobody holds.
                session = handoff.encode_unproduced(rid, f"{self.config.host}:{self.kv_port}")
                outbox.put(generation_pb2.GenerateResponse(
                    request_id=rid, prefill_ready=generation_pb2.PrefillReady(kv_session=session),
                    usage=_usage(request, prompt_len, 0)), last=True)
                return
            stop_match = None
            if match is not None:
                stop_match = generation_pb2.StopMatch(**{match[0]: match[1]})
            outbox.put(generation_pb2.GenerateResponse(
                request_id=rid,
                finished=generation_pb2.GenerationFinished(output_index=0, reason=reasons[reason],
                                                           stop_match=stop_match),
                usage=_usage(request, prompt_len, request.generated)), last=True)

        return on_finish

    def _context_callback(self, outbox: Outbox, rid: str, prompt_ids, media_ids, prompt_len: int, token_response,
                          stop_texts: list[str], want_logprobs: bool):
        def on_context_done(request: SimRequest, first_token: int) -> None:
            c = self.config
            if self.persona.streams_context_token:
                # Revision-1 TensorRT-LLM streams the context phase's token before the handoff.
                outbox.put(token_response(first_token, 0))
                text = self.tokenizer.decode([first_token])
                stop = next((s for s in stop_texts if s in text), None)
                if stop is not None:  # the one token stopped the request: no KV to hand off
                    self.scheduler.release_blocks(request.blocks, request.rank, request.lease)
                    request.blocks, request.lease = 0, None
                    request.generated = 1
                    request.on_finish(request, "stop", ("stop_text", stop))
                    return
            context_id = str(next(self.context_ids)) if self.persona.trtllm else rid
            opaque = handoff.new_opaque_state(context_id, c.host, self.kv_port, uuidlib.uuid4().hex)
            held = kv_transfer.HeldSession(
                session_id=context_id, blocks=request.blocks, tokens=prompt_len,
                prompt_digest=output.prompt_digest(prompt_ids), media_digest=output.media_digest(media_ids),
                opaque_state=opaque, first_gen_tokens=[first_token], rank=request.rank, lease=request.lease)
            request.blocks, request.lease = 0, None  # the blocks now belong to the session, not the request
            if not c.drop_kv_sessions:
                self.sessions.hold(held)
            else:
                self.scheduler.release_blocks(held.blocks, held.rank, held.lease)
            session = handoff.encode(self.persona, handoff.Handoff(
                session_key=context_id, kv_host=c.host, kv_port=self.kv_port, opaque_state=opaque,
                first_gen_tokens=(first_token,), requires_decode_media=bool(media_ids), prompt_tokens=prompt_len,
                first_gen_log_probs=(_logprob(first_token, 0),) if want_logprobs else ()))
            outbox.put(generation_pb2.GenerateResponse(
                request_id=rid, prefill_ready=generation_pb2.PrefillReady(kv_session=session),
                usage=_usage(request, prompt_len, 0)), last=True)

        return on_context_done


def _usage(request: SimRequest, prompt_len: int, completion: int) -> generation_pb2.Usage:
    usage = generation_pb2.Usage(prompt_tokens=prompt_len, completion_tokens=completion,
                                 total_tokens=prompt_len + completion)
    if request.tokens is not None and request.kind != GENERATION_ONLY:
        # what the prefix cache saved this request's prefill (TensorRT-LLM: result.cached_tokens)
        usage.cached_prompt_tokens = request.cached
    return usage


def _logprob(token: int, position: int) -> float:
    """A deterministic stand-in logprob, the same for a token on either leg."""
    return -((token * 7919 + position) % 1000) / 400.0
