"""The Responses API request (`POST /v1/responses`) as the internal chat request. Pure: no I/O.

A thin adapter: the body is checked with the Responses API's own field names, then written as the chat body the
chat path takes (`parse_chat`), so there is one validation of sampling, tools, images and guides. An error the
chat parser finds names the Responses field it came from (`input[2].content[0]`, not `messages[3]...`).

- `input`: a string (one user message) or items: messages (`role`, `content` as a string or `input_text`,
  `input_image` and, for the assistant's history, `output_text` parts), `function_call` (the model's earlier
  calls: consecutive ones form one assistant turn) and `function_call_output` (a tool's result); `reasoning`
  items of the history are kept as the next assistant turn's `reasoning_content`.
- `instructions`: a system message first (not carried to a continuation, as OpenAI does).
- `previous_response_id`: the stored conversation (its input items and its output items) comes before `input`.
- `tools` (function tools, flat: `name`, `description`, `parameters`, `strict`), `tool_choice`,
  `parallel_tool_calls`, `reasoning.effort`, `text.format` (`text`, `json_object`, `json_schema`),
  `max_output_tokens`, `temperature`, `top_p`, `stream`, `store`, `metadata`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import attrs

from orchestrator.convert.api import ApiRequest, parse_chat, renamed_error
from orchestrator.convert.media import MediaLimits
from orchestrator.errors import InvalidRequest, invalid

ROLES = ("user", "system", "developer", "assistant")
MAX_METADATA_KEYS = 16


@attrs.frozen
class ResponsesRequest:
    api: ApiRequest  # the chat request it runs as
    input_items: tuple[str, ...]  # this request's input items, normalised, each as JSON (stored for continuations)
    store: bool = True
    previous_response_id: str | None = None
    instructions: str | None = None
    metadata: str | None = None  # JSON object
    tools: str = "[]"  # the request's tools as the Responses API writes them, JSON (echoed in the response)
    tool_choice: str = '"auto"'  # JSON
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    text_format: str = '{"type":"text"}'  # JSON
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None


def previous_response_id(body) -> str | None:
    """The id a request continues, checked before anything else is (the store is read with it)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    value = body.get("previous_response_id")
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 256:
        raise invalid("previous_response_id: expected the id of a stored response", param="previous_response_id")
    return value


def parse_responses(body: dict, history: Sequence[dict] = (), limits: MediaLimits | None = None) -> ResponsesRequest:
    """`history`: the items of the response `previous_response_id` names (its input, then its output), as stored."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    items = _input_items(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions: expected a string", param="instructions")
    messages: list[dict] = []
    origins: list[str] = []  # the Responses field each chat message came from
    if instructions:
        messages.append({"role": "system", "content": instructions})
        origins.append("instructions")
    _add_items(list(history), "previous_response_id", messages, origins)
    _add_items(items, "input", messages, origins)
    if not messages:
        raise invalid("input: expected a string or a non-empty list of items", param="input")

    chat: dict = {"model": body.get("model"), "messages": messages, "stream": body.get("stream", False)}
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    for same in ("parallel_tool_calls", "temperature", "top_p"):
        if body.get(same) is not None:
            chat[same] = body[same]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    effort = _reasoning_effort(body.get("reasoning"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    text_format = _text_format(body.get("text"))
    if text_format is not None:
        chat["response_format"] = text_format
    store = body.get("store", True)
    if store is None:
        store = True
    if not isinstance(store, bool):
        raise invalid("store: expected true or false", param="store")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS
                                 or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise invalid(f"metadata: expected at most {MAX_METADATA_KEYS} string keys with string values",
                      param="metadata")
    try:
        api = parse_chat(chat) if limits is None else parse_chat(chat, limits)
    except InvalidRequest as error:
        raise renamed_error(error, origins, _FIELDS) from None
    return ResponsesRequest(
        api=api, input_items=tuple(json.dumps(item, ensure_ascii=False) for item in items), store=store,
        previous_response_id=previous_response_id(body), instructions=instructions or None,
        metadata=None if metadata is None else json.dumps(metadata, ensure_ascii=False),
        tools=json.dumps(tools or [], ensure_ascii=False),
        tool_choice=json.dumps(body.get("tool_choice") or "auto", ensure_ascii=False),
        parallel_tool_calls=api.tool_use.parallel, reasoning_effort=effort,
        text_format=json.dumps(body.get("text", {}).get("format") or {"type": "text"}, ensure_ascii=False)
        if isinstance(body.get("text"), dict) else '{"type":"text"}',
        max_output_tokens=api.max_tokens, temperature=api.sampling.temperature, top_p=api.sampling.top_p)


# ---- input ----------------------------------------------------------------------------------------------

def _input_items(value) -> list[dict]:
    if isinstance(value, str):
        if not value:
            raise invalid("input: must not be empty", param="input")
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input: expected a string or a non-empty list of items", param="input")
    items = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where}: expected an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            items.append(_message_item(item, where))
        elif kind == "function_call":
            items.append({"type": "function_call", "call_id": _string(item, "call_id", where),
                          "name": _string(item, "name", where), "arguments": _string(item, "arguments", where)})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):  # output parts: their texts
                output = "".join(part.get("text", "") for part in output if isinstance(part, dict))
            if not isinstance(output, str):
                raise invalid(f"{where}.output: expected a string", param=f"{where}.output")
            items.append({"type": "function_call_output", "call_id": _string(item, "call_id", where),
                          "output": output})
        elif kind == "reasoning":
            items.append({"type": "reasoning", "text": _reasoning_text(item)})
        else:
            raise invalid(f"{where}.type: expected message, function_call, function_call_output or reasoning, got "
                          f"{kind!r}", param=f"{where}.type")
    return items


def _string(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise invalid(f"{where}.{name}: expected a non-empty string", param=f"{where}.{name}")
    return value


def _message_item(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"type": "message", "role": role, "content": content}
    if not isinstance(content, list):
        raise invalid(f"{where}.content: expected a string or a list of content parts", param=f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise invalid(f"{at}: expected an object", param=at)
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise invalid(f"{at}.text: expected a string", param=f"{at}.text")
            parts.append({"type": "input_text", "text": part["text"]})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise invalid(f"{at}.image_url: expected an image URL (a data: URL or https://); file ids are not "
                              "supported", param=f"{at}.image_url")
            parts.append({"type": "input_image", "image_url": url})
        else:
            raise invalid(f"{at}.type: expected input_text, input_image or output_text, got {kind!r}",
                          param=f"{at}.type")
    return {"type": "message", "role": role, "content": parts}


def _reasoning_text(item: dict) -> str:
    pieces = []
    for key in ("content", "summary"):
        for part in item.get(key) or ():
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                pieces.append(part["text"])
    if isinstance(item.get("text"), str):  # as this module stores them
        pieces.append(item["text"])
    return "".join(pieces)


def _add_items(items: list[dict], where: str, messages: list[dict], origins: list[str]) -> None:
    """Items -> chat messages. A function call joins the assistant turn just before it (its text, or the calls
    before it); a reasoning item goes with the assistant turn that follows it."""
    reasoning: str | None = None
    joins_turn = False  # the last item was the assistant's (a message or a call): a call joins that turn
    for i, item in enumerate(items):
        origin = f"{where}[{i}]" if where == "input" else where
        kind = item["type"]
        if kind == "reasoning":
            reasoning = (reasoning or "") + item["text"]
            continue
        if kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if joins_turn:
                messages[-1].setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            content = item["content"]
            if not isinstance(content, str):
                content = [{"type": "text", "text": part["text"]} if part["type"] == "input_text"
                           else {"type": "image_url", "image_url": {"url": part["image_url"]}} for part in content]
                if item["role"] == "assistant":  # history: the text the assistant wrote
                    content = "".join(part.get("text", "") for part in content)
            messages.append({"role": item["role"], "content": content})
        joins_turn = messages[-1]["role"] == "assistant"
        if reasoning is not None and joins_turn:
            messages[-1]["reasoning_content"] = reasoning
            reasoning = None
        origins.append(origin)


# chat fields -> the Responses API's (tools are flat there: `tools[i].name`)
_FIELDS = ((r"^max_completion_tokens", "max_output_tokens"), (r"^response_format", "text.format"),
           (r"^reasoning_effort", "reasoning.effort"), (r"^(tools\[\d+\])\.function\.", r"\1."))


# ---- tools, reasoning, text -------------------------------------------------------------------------------

def _tools(tools) -> list:
    if not isinstance(tools, list):
        raise invalid("tools: expected a list of function tools", param="tools")
    chat_tools = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(f"{where}: expected an object", param=where)
        if tool.get("type") != "function":
            raise invalid(f"{where}.type: only function tools are supported, got {tool.get('type')!r}",
                          param=f"{where}.type")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _reasoning_effort(reasoning) -> str | None:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise invalid("reasoning: expected an object", param="reasoning")
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise invalid("reasoning.effort: expected minimal, low, medium or high", param="reasoning.effort")
    return effort


def _text_format(text) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid("text: expected an object", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid("text.format: expected an object with a type", param="text.format")
    kind = fmt.get("type")
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("text.format.schema: expected a JSON schema object", param="text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise invalid(f"text.format.type: expected text, json_object or json_schema, got {kind!r}",
                  param="text.format.type")
