"""Parse and validate OpenAI-style request bodies into frozen values. Pure: no I/O, no tokenizer.

Everything a request can get wrong is a 400 here, with `param` naming the field, before any
worker is touched. Unknown fields are ignored (as OpenAI-compatible servers do); known fields of
the wrong type are not.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Literal, overload

import attrs

from orchestrator.convert.media import ImageRef, MediaLimits, apply_request_uuids, parse_image_part
from orchestrator.convert.tools import ToolCall, ToolUse, parse_tool_calls, parse_tool_use
from orchestrator.errors import InvalidRequest, invalid

ROLES = ("system", "developer", "user", "assistant", "tool")


@attrs.frozen
class Sampling:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None


@attrs.frozen
class Guided:
    kind: str  # "json_schema" | "json_object"
    json_schema: str = ""
    param: str = "response_format"  # the request field that asked for it: response_format, or tool_choice


@attrs.frozen
class Part:
    """One content part of a chat message, as chat templates see it: {"type": "text", "text": ...} or
    {"type": "image"} (the image itself travels as media; the template writes the model's placeholder)."""

    type: str  # "text" | "image"
    text: str = ""

    def as_template_dict(self) -> dict:
        return {"type": "text", "text": self.text} if self.type == "text" else {"type": "image"}


@attrs.frozen
class Message:
    role: str
    content: str | tuple[Part, ...]  # a string, or the message's parts in order
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls (a tool loop's history)
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's reasoning, sent back by clients that keep it

    def as_template_dict(self) -> dict:
        """As Hugging Face chat templates read a message: the keys beyond role and content only when set."""
        content = self.content if isinstance(self.content, str) else [p.as_template_dict() for p in self.content]
        message: dict = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [call.as_template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


@attrs.frozen
class ApiRequest:
    kind: str  # "chat" | "completion"
    model: str
    messages: tuple[Message, ...] = ()
    prompt: str | None = None  # completion with text
    prompt_ids: tuple[int, ...] | None = None  # completion with token ids
    images: tuple[ImageRef, ...] = ()
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling: Sampling = Sampling()
    logprobs: bool = False
    top_logprobs: int = 0
    guided: Guided | None = None
    tool_use: ToolUse = ToolUse()  # chat: the tools offered, the choice, parallel calls
    # chat: extra variables for the chat template (Qwen3's enable_thinking, ...) as canonical JSON
    template_kwargs: str | None = None
    n: int = 1  # choices asked for
    echo: bool = False
    conversation_id: str | None = None  # extra.conversation_id and metadata conversation_id on every leg
    # kv.cache_salt on every leg: the client's (as vLLM takes it) under its key's, see `cache_namespace`
    cache_salt: str | None = None
    media_options: str | None = None  # media_io_kwargs as JSON; GenerateRequest.media_options (revision 3)
    lora_adapter: str | None = None


# ---- small typed getters ------------------------------------------------------------------------

@overload
def _number(body: dict, name: str, lo: float | None = None, hi: float | None = None, *,
            integer: Literal[True], lo_open: bool = False) -> int | None: ...
@overload
def _number(body: dict, name: str, lo: float | None = None, hi: float | None = None, *,
            integer: bool = False, lo_open: bool = False) -> float | int | None: ...
def _number(body: dict, name: str, lo: float | None = None, hi: float | None = None, *,
            integer: bool = False, lo_open: bool = False) -> float | int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise invalid(f"{name}: expected {'an integer' if integer else 'a number'}, got {_shown(value)}", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise invalid(f"{name}: expected a finite number", param=name)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise invalid(f"{name}: must be {'>' if lo_open else '>='} {_bound(lo)}, got {_shown(value)}", param=name)
    if hi is not None and value > hi:
        raise invalid(f"{name}: must be <= {_bound(hi)}, got {_shown(value)}", param=name)
    return value


def _bound(limit: float) -> str:
    return str(limit) if isinstance(limit, int) else f"{limit:g}"


def _shown(value) -> str:
    """A value for an error message: a 5,000-digit number or a megabyte string is not echoed whole."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{name}: expected true or false, got {value!r}", param=name)
    return value


_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]+").fullmatch
UINT32_MAX = 2**32 - 1  # token ids and token counts travel as uint32
MAX_CHOICES = 16  # `n`: each choice is a request of its own to the workers (frontend/app.py)
INT32_MAX = 2**31 - 1
# OpenAI's API defines seed as an int64; the wire's uint64 holds the non-negative half of it
SEED_MAX = 2**63 - 1
# TensorRT-LLM only checks > 0 (samplingConfig.cpp checkRepetitionPenalty); past 2 every seen token is all but
# banned, which is why SGLang bounds it to [0, 2] too: a larger number is a mistake, not a setting
REPETITION_PENALTY_MAX = 2
LOGIT_BIAS_RANGE = 100  # OpenAI: each bias is from -100 to 100


def _refuse_logit_bias(body: dict) -> None:
    """`logit_bias`: checked as OpenAI defines it ({token id: bias from -100 to 100}), then refused when it
    biases anything: no OpenEngine field carries it, and a bias silently dropped (a token meant to be banned
    being sampled) is worse than a clear 400."""
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise invalid("logit_bias: expected an object mapping token ids to biases", param="logit_bias")
    for token, value in bias.items():
        if not token.isdecimal() or int(token) > UINT32_MAX:
            raise invalid(f"logit_bias: keys are token ids, got {_shown(token)}", param="logit_bias")
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE):
            raise invalid(f"logit_bias.{token}: expected a number from -{LOGIT_BIAS_RANGE} to {LOGIT_BIAS_RANGE}, "
                          f"got {_shown(value)}", param=f"logit_bias.{token}")
    if bias:
        raise invalid("logit_bias: not supported by this deployment (the engine protocol cannot carry it)",
                      param="logit_bias")


def _int_list(value, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= UINT32_MAX
                                              for v in value):
        raise invalid(f"{name}: expected a list of integers from 0 to {UINT32_MAX}", param=name)
    return tuple(value)


def _common(body: dict, kind: str) -> dict:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model: a model name is required", param="model")
    n = _number(body, "n", 1, MAX_CHOICES, integer=True) or 1
    best_of = _number(body, "best_of", 1, integer=True)
    if best_of is not None and best_of > 1:
        raise invalid("best_of: only best_of=1 is supported", param="best_of")
    if body.get("use_beam_search"):
        raise invalid("use_beam_search: beam search is not supported", param="use_beam_search")
    stream = _bool(body, "stream")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise invalid("stream_options: expected an object", param="stream_options")
        if not stream:
            raise invalid("stream_options: only allowed when stream is true", param="stream_options")
        include_usage = _bool(stream_options, "include_usage")

    max_tokens = _number(body, "max_completion_tokens", 1, UINT32_MAX, integer=True) if kind == "chat" else None
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", 1, UINT32_MAX, integer=True)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
        stops = tuple(stop)
    else:
        raise invalid("stop: expected a string or a list of non-empty strings", param="stop")
    if len(stops) > 16:
        raise invalid("stop: at most 16 stop strings", param="stop")
    stop_token_ids = _int_list(body["stop_token_ids"], "stop_token_ids") if body.get("stop_token_ids") else ()
    sampling = Sampling(
        temperature=_number(body, "temperature", 0, 2),
        top_p=_number(body, "top_p", 0, 1, lo_open=True),
        top_k=_number(body, "top_k", -1, INT32_MAX, integer=True),
        min_p=_number(body, "min_p", 0, 1),
        seed=_number(body, "seed", 0, SEED_MAX, integer=True),
        presence_penalty=_number(body, "presence_penalty", -2, 2),
        frequency_penalty=_number(body, "frequency_penalty", -2, 2),
        repetition_penalty=_number(body, "repetition_penalty", 0, REPETITION_PENALTY_MAX, lo_open=True),
    )
    _refuse_logit_bias(body)
    conversation_id = body.get("conversation_id")
    # it travels as gRPC metadata too (engine/client.py), whose values are printable ASCII
    if conversation_id is not None and (not isinstance(conversation_id, str) or not conversation_id.strip()
                                        or len(conversation_id) > 256 or not _PRINTABLE_ASCII(conversation_id)):
        raise invalid("conversation_id: expected a non-empty string of at most 256 printable ASCII characters",
                      param="conversation_id")
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt or len(cache_salt) > 1024):
        raise invalid("cache_salt: expected a non-empty string of at most 1024 characters", param="cache_salt")
    return {"model": model, "stream": stream, "include_usage": include_usage, "max_tokens": max_tokens,
            "min_tokens": _number(body, "min_tokens", 0, UINT32_MAX, integer=True), "stop": stops,
            "stop_token_ids": stop_token_ids, "ignore_eos": _bool(body, "ignore_eos"), "sampling": sampling,
            "conversation_id": conversation_id, "media_options": _media_options(body), "n": n,
            "cache_salt": cache_salt}


MEDIA_OPTION_MODALITIES = ("image", "video", "audio")


def cache_namespace(key_salt: str | None, request_salt: str | None) -> str | None:
    """The kv.cache_salt of a request: its API key's salt (auth.keys[i].cache_salt) with the client's own
    `cache_salt` under it, or the client's alone. The two forms never coincide (their prefixes differ), so no
    client can name a keyed tenant's namespace by sending its salt."""
    if key_salt is not None:
        return f"key:{key_salt}" + ("" if request_salt is None else f"\nrequest:{request_salt}")
    return None if request_salt is None else f"request:{request_salt}"


def _media_options(body: dict) -> str | None:
    """`media_io_kwargs` ({"image": {...}}, as TensorRT-LLM's HTTP server takes it) -> canonical JSON, or None."""
    options = body.get("media_io_kwargs")
    if options is None:
        return None
    if not isinstance(options, dict) or not options:
        raise invalid("media_io_kwargs: expected a non-empty object keyed by modality", param="media_io_kwargs")
    for key, value in options.items():
        if key not in MEDIA_OPTION_MODALITIES:
            raise invalid(f"media_io_kwargs.{key}: expected one of {', '.join(MEDIA_OPTION_MODALITIES)}",
                          param=f"media_io_kwargs.{key}")
        if not isinstance(value, dict):
            raise invalid(f"media_io_kwargs.{key}: expected an object", param=f"media_io_kwargs.{key}")
    return json.dumps(options, sort_keys=True)


def _guided(body: dict) -> Guided | None:
    response_format = body.get("response_format")
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise invalid("response_format: expected an object with a type", param="response_format")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Guided("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise invalid("response_format.json_schema.schema: expected a JSON schema object",
                          param="response_format.json_schema")
        return Guided("json_schema", json.dumps(spec["schema"], separators=(",", ":"), sort_keys=True))
    raise invalid(f"response_format.type: expected text, json_object or json_schema, got {kind!r}",
                  param="response_format.type")


DEFAULT_MEDIA_LIMITS = MediaLimits()


def parse_chat(body: dict, limits: MediaLimits = DEFAULT_MEDIA_LIMITS) -> ApiRequest:
    common = _common(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: expected a non-empty list of messages", param="messages")
    parsed: list[Message] = []
    images: list[ImageRef] = []
    total_bytes = 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where}: expected an object", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        extras = _message_extras(message, role, where)
        if isinstance(content, str):
            parsed.append(Message(role, content, **extras))
            continue
        if not isinstance(content, list):
            raise invalid(f"{where}.content: expected a string or a list of content parts", param=f"{where}.content")
        parts: list[Part] = []
        for j, part in enumerate(content):
            part_where = f"{where}.content[{j}]"
            if not isinstance(part, dict):
                raise invalid(f"{part_where}: expected an object", param=part_where)
            kind = part.get("type")
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise invalid(f"{part_where}.text: expected a string", param=f"{part_where}.text")
                parts.append(Part("text", part["text"]))
            elif kind == "image_url":
                if role != "user":
                    raise invalid(f"{part_where}: images are only allowed in user messages", param=part_where)
                image, size = parse_image_part(part, part_where, limits)
                total_bytes += size
                if total_bytes > limits.max_total_image_bytes:
                    raise invalid(f"{part_where}: the request's images exceed {limits.max_total_image_bytes} "
                                  "bytes in total", param=part_where)
                images.append(image)
                parts.append(Part("image"))
            else:
                raise invalid(f"{part_where}.type: expected text or image_url, got {kind!r}",
                              param=f"{part_where}.type")
        parsed.append(Message(role, tuple(parts), **extras))
    logprobs = _bool(body, "logprobs")
    top_logprobs = _number(body, "top_logprobs", 0, 20, integer=True) or 0
    if top_logprobs and not logprobs:
        raise invalid("top_logprobs: requires logprobs to be true", param="top_logprobs")
    tool_use = parse_tool_use(body)
    guided = _guided(body)
    tool_schema = tool_use.guide_schema()
    if tool_schema is not None:
        if guided is not None:
            raise invalid(f"response_format: cannot be combined with tool_choice {tool_use.choice.mode.value!r}, "
                          "which guides the output itself", param="response_format")
        guided = Guided("json_schema", tool_schema, param="tool_choice")
    return ApiRequest(kind="chat", messages=tuple(parsed),
                      images=apply_request_uuids(images, body.get("multi_modal_uuids"), limits),
                      logprobs=logprobs, top_logprobs=top_logprobs, guided=guided, tool_use=tool_use,
                      template_kwargs=_template_kwargs(body), **common)


def _message_extras(message: dict, role: str, where: str) -> dict:
    """A message's fields beyond role and content: an assistant's `tool_calls` (and `reasoning_content`), a tool
    message's `tool_call_id`."""
    extras: dict = {}
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise invalid(f"{where}.tool_calls: only assistant messages carry tool calls", param=f"{where}.tool_calls")
        extras["tool_calls"] = parse_tool_calls(calls, f"{where}.tool_calls")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"{where}.tool_call_id: a tool message names the call it answers",
                          param=f"{where}.tool_call_id")
        extras["tool_call_id"] = call_id
    reasoning = message.get("reasoning_content")
    if reasoning is not None and role == "assistant":
        if not isinstance(reasoning, str):
            raise invalid(f"{where}.reasoning_content: expected a string", param=f"{where}.reasoning_content")
        extras["reasoning_content"] = reasoning
    return extras


REASONING_EFFORTS = ("minimal", "low", "medium", "high")
_RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def _template_kwargs(body: dict) -> str | None:
    """`chat_template_kwargs` (as vLLM and TensorRT-LLM's HTTP server take them, e.g. {"enable_thinking":
    false}) and `reasoning_effort` (a template variable of gpt-oss's template) -> canonical JSON, or None."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs: expected an object of template variables", param="chat_template_kwargs")
    for name in _RESERVED_TEMPLATE_VARIABLES:
        if name in kwargs:
            raise invalid(f"chat_template_kwargs.{name}: set by the request itself, not a template variable",
                          param=f"chat_template_kwargs.{name}")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise invalid(f"reasoning_effort: expected one of {', '.join(REASONING_EFFORTS)}, got {_shown(effort)}",
                          param="reasoning_effort")
        kwargs = {"reasoning_effort": effort, **kwargs}
    if not kwargs:
        return None
    try:
        return json.dumps(kwargs, separators=(",", ":"), sort_keys=True, ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        raise invalid(f"chat_template_kwargs: not plain JSON values ({exc})", param="chat_template_kwargs") from exc


_MESSAGE_PATH = re.compile(r"^messages\[(\d+)\]")


def renamed_error(error: InvalidRequest, origins: Sequence[str],
                  fields: Sequence[tuple[str, str]]) -> InvalidRequest:
    """An error of `parse_chat` as another API (Responses, Messages) names the field: `messages[i]...` becomes
    the field chat message i came from (`origins[i]`); any other name, the first of `fields` (a regex and its
    replacement, as re.sub takes them) that matches it."""
    param = error.param
    if param is None:
        return error
    match = _MESSAGE_PATH.match(param)
    if match is not None and int(match.group(1)) < len(origins):
        renamed = origins[int(match.group(1))] + param[match.end():]
    else:
        renamed = next((re.sub(pattern, replacement, param) for pattern, replacement in fields
                        if re.match(pattern, param)), param)
    return InvalidRequest(error.message.replace(param, renamed, 1), param=renamed, code=error.code)


def parse_completion(body: dict) -> ApiRequest:
    common = _common(body, "completion")
    prompt = body.get("prompt")
    prompt_text, prompt_ids = None, None
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt: must not be empty", param="prompt")
        prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt_ids = _int_list(prompt, "prompt")
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str) and prompt[0]:
        prompt_text = prompt[0]
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise invalid("prompt: batched prompts are not supported; send one prompt per request", param="prompt")
    else:
        raise invalid("prompt: expected a non-empty string or a list of token ids", param="prompt")
    logprobs = _number(body, "logprobs", 0, 20, integer=True)
    if _bool(body, "echo"):
        raise invalid("echo: not supported", param="echo")
    return ApiRequest(kind="completion", prompt=prompt_text, prompt_ids=prompt_ids,
                      logprobs=logprobs is not None, top_logprobs=logprobs or 0, guided=_guided(body), **common)
