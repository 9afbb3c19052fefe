"""The prompt as token ids: the chat template, then the tokenizer, without letting one request stall the rest.

A text whose length alone proves it cannot fit the context window is refused before it is tokenized (a
byte-level tokenizer needs at least bytes / longest-token-bytes tokens); a long text is tokenized on a
worker thread, so the event loop keeps serving every other stream meanwhile.
"""

from __future__ import annotations

import json

import trio

from orchestrator.convert import ApiRequest
from orchestrator.errors import InvalidRequest
from orchestrator.tokenizer import ModelTokenizer, TemplateError

OFF_LOOP_CHARS = 32_768  # longer texts are tokenized on a worker thread


async def prompt_token_ids(api: ApiRequest, tokenizer: ModelTokenizer, *, window: int | None) -> list[int]:
    if api.prompt_ids is not None:
        return list(api.prompt_ids)
    if api.kind == "completion":
        text = api.prompt or ""
    else:
        try:
            text = tokenizer.render_chat([m.as_template_dict() for m in api.messages],
                                         tools=api.tool_use.template_tools(),
                                         variables=json.loads(api.template_kwargs) if api.template_kwargs else None)
        except TemplateError as exc:
            raise InvalidRequest(f"messages: {exc}", param="messages") from exc
    if window is not None and (at_least := tokenizer.min_tokens(text)) >= window:
        raise InvalidRequest(f"the prompt has at least {at_least} tokens, which does not fit the context window of "
                             f"{window} tokens", param="messages" if api.kind == "chat" else "prompt",
                             code="context_length_exceeded")
    if len(text) > OFF_LOOP_CHARS:
        return await trio.to_thread.run_sync(tokenizer.encode, text)
    return tokenizer.encode(text)
