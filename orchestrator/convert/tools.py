"""Function tools in a chat request: `tools`, `tool_choice`, `parallel_tool_calls`, and the assistant's earlier
`tool_calls` in the history. Pure: no I/O.

What the model sees is the chat template's business (the tools go to it as Hugging Face templates expect them:
a `tools` variable of {"type": "function", "function": {...}}); what it answers is read back by the output
parsers the worker advertises. Two choices need more than a template can give, and are guided instead:

- a named function (`tool_choice: {"type": "function", "function": {"name": ...}}`): the answer is the
  function's arguments, constrained by its parameter schema, and becomes one call to that function;
- `required`: the answer is a JSON array of calls, constrained by a schema whose items are one of the tools
  ({"name": <const>, "parameters": <its schema>}), and becomes those calls.

Both need a worker with guided decoding (a grammar backend); without one they are a 400 (the feature gate in
convert/engine.py), never an answer that merely hopes the model obeyed. vLLM guides the same two choices with
the same schemas (vllm/entrypoints/openai/protocol.py `_get_json_schema_from_tool`, later moved to
vllm/tool_parsers/utils.py `_get_json_schema_from_tools`).
"""

from __future__ import annotations

import enum
import json
import re

import attrs

from orchestrator.errors import invalid

# OpenAI's rule for a function's name (a-z, A-Z, 0-9, underscores and dashes, at most 64 characters)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128  # OpenAI's limit on the tools of one request


def _canonical(value) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


@attrs.frozen
class Tool:
    """One function the model may call. `parameters` is its JSON schema as canonical JSON (frozen values hold
    no dicts); a function without one takes an empty object."""

    name: str
    parameters: str = '{"properties":{},"type":"object"}'
    description: str | None = None
    strict: bool | None = None

    def as_template_dict(self) -> dict:
        function: dict = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


class ToolChoiceMode(enum.Enum):
    AUTO = "auto"  # the model decides (the default when tools are given)
    NONE = "none"  # no call: the tools are not shown to the model and its output is not read for calls
    REQUIRED = "required"  # at least one call, guided
    NAMED = "function"  # exactly one call to `ToolChoice.name`, guided


@attrs.frozen
class ToolChoice:
    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    name: str | None = None  # NAMED only


@attrs.frozen
class ToolCall:
    """A call the assistant made earlier in the conversation (`messages[i].tool_calls[j]`)."""

    id: str
    name: str
    arguments: str  # as the client sent it: a JSON string

    def as_template_dict(self) -> dict:
        # Templates write the arguments with `tojson` or iterate them as a mapping (Llama 3.x, Qwen, Hermes), as
        # Hugging Face's own serving passes them; vLLM turns the string into an object for the same reason.
        try:
            arguments = json.loads(self.arguments)
        except ValueError:
            arguments = self.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


@attrs.frozen
class ToolUse:
    """The request's tools as the rest of the path needs them: what to render, what to read, what to guide."""

    tools: tuple[Tool, ...] = ()
    choice: ToolChoice = ToolChoice()
    parallel: bool = True  # parallel_tool_calls

    @property
    def offered(self) -> bool:
        """Whether the model is shown the tools and its answer read for calls."""
        return bool(self.tools) and self.choice.mode is not ToolChoiceMode.NONE

    def template_tools(self) -> list[dict] | None:
        return [tool.as_template_dict() for tool in self.tools] if self.offered else None

    def guide_schema(self) -> str | None:
        """The JSON schema the answer is guided by for a named or required choice (canonical JSON), else None."""
        if self.choice.mode is ToolChoiceMode.NAMED:
            return next(t.parameters for t in self.tools if t.name == self.choice.name)
        if self.choice.mode is ToolChoiceMode.REQUIRED:
            calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.name]},
                                                       "parameters": json.loads(tool.parameters)},
                      "required": ["name", "parameters"]} for tool in self.tools]
            schema: dict = {"type": "array", "minItems": 1,
                            "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return _canonical(schema)
        return None


def parse_tool_use(body: dict) -> ToolUse:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body. The legacy `functions` and
    `function_call` are refused with a pointer to their successors."""
    for legacy, successor in (("functions", "tools"), ("function_call", "tool_choice")):
        if body.get(legacy) is not None:
            raise invalid(f"{legacy}: deprecated by OpenAI and not supported; send {successor} instead", param=legacy)
    raw_tools = body.get("tools")
    tools: tuple[Tool, ...] = ()
    if raw_tools is not None:
        if not isinstance(raw_tools, list):
            raise invalid("tools: expected a list of function tools", param="tools")
        if len(raw_tools) > MAX_TOOLS:
            raise invalid(f"tools: at most {MAX_TOOLS} tools, got {len(raw_tools)}", param="tools")
        tools = tuple(_tool(tool, f"tools[{i}]") for i, tool in enumerate(raw_tools))
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names):
            duplicate = next(name for name in names if names.count(name) > 1)
            raise invalid(f"tools: the function name {duplicate!r} is given more than once", param="tools")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls: expected true or false", param="parallel_tool_calls")
    return ToolUse(tools=tools, choice=_tool_choice(body.get("tool_choice"), tools), parallel=parallel)


def _tool(tool, where: str) -> Tool:
    if not isinstance(tool, dict):
        raise invalid(f"{where}: expected an object", param=where)
    if tool.get("type") != "function":
        raise invalid(f"{where}.type: only function tools are supported, got {tool.get('type')!r}",
                      param=f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise invalid(f"{where}.function: expected an object with a name", param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid(f"{where}.function.name: expected 1 to 64 letters, digits, underscores or dashes",
                      param=f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{where}.function.description: expected a string", param=f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    elif not isinstance(parameters, dict):
        raise invalid(f"{where}.function.parameters: expected a JSON schema object",
                      param=f"{where}.function.parameters")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{where}.function.strict: expected true or false", param=f"{where}.function.strict")
    return Tool(name=name, parameters=_canonical(parameters), description=description, strict=strict)


def _tool_choice(choice, tools: tuple[Tool, ...]) -> ToolChoice:
    if choice is None:
        return ToolChoice()
    if not tools:
        raise invalid("tool_choice: only allowed when tools are given", param="tool_choice")
    if isinstance(choice, str):
        try:
            mode = ToolChoiceMode(choice)
        except ValueError:
            mode = None
        if mode is None or mode is ToolChoiceMode.NAMED:
            raise invalid(f"tool_choice: expected none, auto, required or a named function, got {choice!r}",
                          param="tool_choice")
        return ToolChoice(mode)
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise invalid("tool_choice.function.name: expected the name of one of the tools",
                          param="tool_choice.function.name")
        if name not in {tool.name for tool in tools}:
            raise invalid(f"tool_choice.function.name: {name!r} is not one of the tools",
                          param="tool_choice.function.name")
        return ToolChoice(ToolChoiceMode.NAMED, name)
    raise invalid("tool_choice: expected none, auto, required or {\"type\": \"function\", \"function\": "
                  "{\"name\": ...}}", param="tool_choice")


def parse_tool_calls(calls, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls` (the history of a tool loop)."""
    if not isinstance(calls, list):
        raise invalid(f"{where}: expected a list of tool calls", param=where)
    parsed = []
    for i, call in enumerate(calls):
        at = f"{where}[{i}]"
        if not isinstance(call, dict):
            raise invalid(f"{at}: expected an object", param=at)
        if call.get("type", "function") != "function":
            raise invalid(f"{at}.type: expected function", param=f"{at}.type")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"{at}.id: expected a non-empty string", param=f"{at}.id")
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise invalid(f"{at}.function.name: expected the called function's name", param=f"{at}.function.name")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise invalid(f"{at}.function.arguments: expected a JSON string", param=f"{at}.function.arguments")
        parsed.append(ToolCall(id=call_id, name=function["name"], arguments=arguments))
    return tuple(parsed)
