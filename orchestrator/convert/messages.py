"""The Anthropic Messages API request (`POST /v1/messages`) as the internal chat request. Pure: no I/O.

As for the Responses API (convert/responses.py): the body is checked with the Messages API's own field names
and rules (`max_tokens` required, roles alternate between `user` and `assistant`, a `tool_result` answers a
`tool_use`), then written as the chat body `parse_chat` takes, and the chat parser's errors name the Messages
field they came from.

- `system`: a string or text blocks, the first message.
- `messages[].content`: a string or blocks: `text`; `image` (`source` base64 with its `media_type`, or a URL);
  an assistant's `tool_use` (`id`, `name`, `input`) and `thinking` (its reasoning, as `reasoning_content`);
  a user's `tool_result` (`tool_use_id`, `content` as a string or text blocks, `is_error`), each a chat
  `tool` message before the user's other blocks.
- `tools` (`name`, `description`, `input_schema`), `tool_choice` (`auto`, `any` = required, `tool` = a named
  function, `none`; `disable_parallel_tool_use`), `stop_sequences`, `temperature`, `top_p`, `top_k`,
  `thinking` (`enabled` / `disabled`: the chat template's `enable_thinking`; absent: the template's default).
"""

from __future__ import annotations

import json

from orchestrator.convert.api import ApiRequest, parse_chat, renamed_error
from orchestrator.convert.media import MediaLimits
from orchestrator.errors import InvalidRequest, invalid

IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def chat_body(body, *, counting: bool = False) -> tuple[dict, list[str]]:
    """The chat body a Messages body runs as, and for each chat message the Messages field it came from.
    `counting`: for count_tokens, which takes no max_tokens."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    max_tokens = body.get("max_tokens")
    if max_tokens is None and not counting:
        raise invalid("max_tokens: Field required", param="max_tokens")
    messages: list[dict] = []
    origins: list[str] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _system_text(system)})
        origins.append("system")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages: expected a non-empty list of messages", param="messages")
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where}: expected an object", param=where)
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise invalid(f"{where}.role: expected user or assistant, got {role!r}", param=f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            origins.append(where)
            continue
        if not isinstance(content, list):
            raise invalid(f"{where}.content: expected a string or a list of content blocks",
                          param=f"{where}.content")
        if role == "user":
            _user_blocks(content, where, messages, origins)
        else:
            messages.append(_assistant_blocks(content, where))
            origins.append(where)

    chat: dict = {"model": body.get("model"), "messages": messages, "stream": body.get("stream", False)}
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    for same in ("temperature", "top_p", "top_k"):
        if body.get(same) is not None:
            chat[same] = body[same]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
    choice = body.get("tool_choice")
    if choice is not None:
        chat.update(_tool_choice(choice))
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise invalid("thinking.type: expected enabled or disabled", param="thinking.type")
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled"}
    return chat, origins


def parse_messages(body, limits: MediaLimits | None = None, *, counting: bool = False) -> ApiRequest:
    chat, origins = chat_body(body, counting=counting)
    try:
        return parse_chat(chat) if limits is None else parse_chat(chat, limits)
    except InvalidRequest as error:
        raise renamed_error(error, origins, _FIELDS) from None


def _system_text(system) -> str:
    if isinstance(system, str):
        return system
    if isinstance(system, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                        and isinstance(b.get("text"), str) for b in system):
        return "\n".join(b["text"] for b in system)
    raise invalid("system: expected a string or a list of text blocks", param="system")


def _user_blocks(blocks: list, where: str, messages: list[dict], origins: list[str]) -> None:
    parts: list[dict] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise invalid(f"{at}.text: expected a string", param=f"{at}.text")
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise invalid(f"{at}.tool_use_id: expected the id of the tool_use it answers",
                              param=f"{at}.tool_use_id")
            result = _result_text(block.get("content", ""), at)
            if block.get("is_error"):
                result = f"Error: {result}"
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
            origins.append(at)
        else:
            raise invalid(f"{at}.type: expected text, image or tool_result, got {kind!r}", param=f"{at}.type")
    if parts:
        messages.append({"role": "user", "content": parts})
        origins.append(where)


def _result_text(content, at: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) for b in content):
        return "".join(b.get("text", "") for b in content if b.get("type") == "text")
    raise invalid(f"{at}.content: expected a string or a list of text blocks", param=f"{at}.content")


def _image_url(source, at: str) -> str:
    if not isinstance(source, dict):
        raise invalid(f"{at}.source: expected an object", param=f"{at}.source")
    if source.get("type") == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in IMAGE_TYPES:
            raise invalid(f"{at}.source.media_type: expected one of {', '.join(IMAGE_TYPES)}",
                          param=f"{at}.source.media_type")
        if not isinstance(data, str) or not data:
            raise invalid(f"{at}.source.data: expected base64 image data", param=f"{at}.source.data")
        return f"data:{media_type};base64,{data}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise invalid(f"{at}.source.type: expected base64 or url", param=f"{at}.source.type")


def _assistant_blocks(blocks: list, where: str) -> dict:
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
                raise invalid(f"{at}: a tool_use block needs its id and name", param=at)
            if not isinstance(arguments, dict):
                raise invalid(f"{at}.input: expected an object", param=f"{at}.input")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
        else:
            raise invalid(f"{at}.type: expected text, thinking or tool_use, got {kind!r}", param=f"{at}.type")
    message: dict = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return message


def _tools(tools) -> list:
    if not isinstance(tools, list):
        raise invalid("tools: expected a list of tools", param="tools")
    chat_tools = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(f"{where}: expected an object", param=where)
        if tool.get("type") not in (None, "custom"):
            raise invalid(f"{where}.type: only client tools (name, input_schema) are supported, got "
                          f"{tool.get('type')!r}", param=f"{where}.type")
        if not isinstance(tool.get("input_schema"), dict):
            raise invalid(f"{where}.input_schema: expected a JSON schema object", param=f"{where}.input_schema")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def _tool_choice(choice) -> dict:
    if not isinstance(choice, dict):
        raise invalid("tool_choice: expected an object with a type", param="tool_choice")
    kind = choice.get("type")
    chat: dict = {}
    if choice.get("disable_parallel_tool_use") is not None:
        chat["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    else:
        raise invalid(f"tool_choice.type: expected auto, any, tool or none, got {kind!r}", param="tool_choice.type")
    return chat


# chat fields -> the Messages API's
_FIELDS = ((r"^stop\b", "stop_sequences"), (r"^tool_choice\.function\.name", "tool_choice.name"),
           (r"^chat_template_kwargs", "thinking"), (r"^(tools\[\d+\])\.function\.parameters", r"\1.input_schema"),
           (r"^(tools\[\d+\])\.function\.", r"\1."))
