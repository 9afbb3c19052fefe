"""The simulated model behind the parsers: tool calls per family, reasoning, guides, EOS, as real gRPC answers.

Each worker runs as a process and is driven through the engine client, as the orchestrator drives it. The chat
prompts are rendered by tiny-chat's own template (tools, tool_choice, enable_thinking), as the frontend will.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from orchestrator.models import TINY_CHAT
from orchestrator.models.build_tiny_chat import CHAT_TEMPLATE
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.sim.tool_formats import TOOL_CALL_PARSERS
from orchestrator.tokenizer import ModelTokenizer
from sim_helpers import Finished, Tokens, collect, run_disaggregated, terminal, token_ids

FAST = ("--time-scale", "0")
# DeepSeek's markers: fullwidth bars and U+2581 for spaces (written as escapes: they look like ASCII)
CALLS_BEGIN, CALLS_END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN, CALL_END = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
TOKENIZER = ModelTokenizer.from_dir(TINY_CHAT)
WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city", "unit", "days"], "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "hourly": {"type": "boolean"},
        "place": {"type": "object", "required": ["lat", "lon"], "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180}}},
        "tags": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string"}}}}}}
SEARCH: dict[str, Any] = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "required": ["query"], "properties": {"query": {"type": "string"}}}}}
TOOLS = [WEATHER, SEARCH]


def validate(value, schema, path="$"):
    """A small JSON-schema check (jsonschema is not a dependency): the keywords the tests' schemas use."""
    kind = schema.get("type")
    checks = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if kind in checks:
        assert isinstance(value, checks[kind]), f"{path}: {value!r} is not {kind}"
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: {value!r} is not an integer"
    if kind == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{path}: {value!r} is not a number"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    if "minimum" in schema:
        assert value >= schema["minimum"], f"{path}: {value} < {schema['minimum']}"
    if "maximum" in schema:
        assert value <= schema["maximum"], f"{path}: {value} > {schema['maximum']}"
    if "minLength" in schema:
        assert len(value) >= schema["minLength"], path
    if "maxLength" in schema:
        assert len(value) <= schema["maxLength"], path
    if "minItems" in schema:
        assert len(value) >= schema["minItems"], path
    if "maxItems" in schema:
        assert len(value) <= schema["maxItems"], path
    for name in schema.get("required", ()):
        assert name in value, f"{path}: {name} is required"
    if kind == "object":
        for name, item in value.items():
            if name in schema.get("properties", {}):
                validate(item, schema["properties"][name], f"{path}.{name}")
            else:
                assert schema.get("additionalProperties", True) is not False, f"{path}: {name} is not allowed"
    if kind == "array" and "items" in schema:
        for index, item in enumerate(value):
            validate(item, schema["items"], f"{path}[{index}]")


def chat_ids(messages, **variables) -> list[int]:
    template = TOKENIZER._template
    assert template is not None
    return TOKENIZER.encode(template.render(messages=messages, add_generation_prompt=True, **variables))


def request(rid, ids, *, seed=7, max_tokens=None, guided=None):
    stopping = g.StoppingOptions() if max_tokens is None else g.StoppingOptions(max_tokens=max_tokens)
    return g.GenerateRequest(request_id=rid, model="tiny-chat", token_ids=g.TokenIds(ids=ids),
                             sampling=g.SamplingParams(seed=seed), stopping=stopping, guided=guided)


async def answer(client, req) -> tuple[str, Finished]:
    events = await collect(client, req)
    last = terminal(events)
    assert isinstance(last, Finished), events
    return TOKENIZER.decode(token_ids(events), skip_special_tokens=False), last


def ended_by_eos(finished) -> bool:
    return finished.reason_name == "stop" and finished.stop_token_id == TOKENIZER.eos_id


# ---- what each family's text is, parsed by the test's own reading of the family's format -------------------

def _xml_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_calls(parser: str, text: str) -> list[tuple[str, dict]]:
    """(name, arguments) of every call in `text`, read as that family's format (tool_formats.py's table)."""
    if parser in ("qwen3", "hermes"):
        return [(c["name"], c["arguments"]) for c in
                map(json.loads, re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.DOTALL))]
    if parser == "qwen3_coder":
        calls = []
        for name, body in re.findall(r"<tool_call>\n<function=(.*?)>\n(.*?)</function>\n</tool_call>", text, re.DOTALL):
            calls.append((name, {k: _xml_value(v) for k, v in
                                 re.findall(r"<parameter=(.*?)>\n(.*?)\n</parameter>\n", body, re.DOTALL)}))
        return calls
    if parser in ("llama3_json", "llama3"):
        return [(c["name"], c["parameters"]) for c in map(json.loads, text.split("; "))]
    if parser == "mistral":
        assert text.startswith("[TOOL_CALLS]")
        return [(c["name"], c["arguments"]) for c in json.loads(text.removeprefix("[TOOL_CALLS]"))]
    if parser in ("deepseek_v3", "deepseekv3"):
        assert text.startswith(CALLS_BEGIN) and text.endswith(CALLS_END)
        return [(n, json.loads(a)) for n, a in re.findall(
            f"{CALL_BEGIN}function{SEP}(.*?)\n```json\n(.*?)\n```{CALL_END}", text, re.DOTALL)]
    if parser in ("deepseek_v31", "deepseekv3.1"):
        return [(n, json.loads(a)) for n, a in re.findall(f"{CALL_BEGIN}(.*?){SEP}(.*?){CALL_END}", text, re.DOTALL)]
    if parser == "kimi_k2":
        assert text.startswith("<|tool_calls_section_begin|>") and text.endswith("<|tool_calls_section_end|>")
        return [(n, json.loads(a)) for n, a in re.findall(
            r"<\|tool_call_begin\|>functions\.(.*?):\d+<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
            text, re.DOTALL)]
    if parser in ("glm4", "glm45"):
        calls = []
        for name, body in re.findall(r"<tool_call>(.*?)\n(.*?)</tool_call>", text, re.DOTALL):
            calls.append((name, {k: _xml_value(v) for k, v in re.findall(
                r"<arg_key>(.*?)</arg_key>\n<arg_value>(.*?)</arg_value>\n", body, re.DOTALL)}))
        return calls
    if parser in ("openai", "gpt_oss"):
        return [(n, json.loads(a)) for n, a in re.findall(
            r"<\|channel\|>commentary to=functions\.(\S+) <\|constrain\|>json<\|message\|>(.*?)<\|call\|>", text)]
    raise AssertionError(parser)


# ---- ModelInfo ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("revision", [1, 3])
async def test_model_info_advertises_the_parser_pair_as_each_revision_does(sim_workers, engine_client, revision):
    """UPSTREAM parsers-advertised: revision 1 fills reasoning_parser only (its proto has tool_call_parser, its
    control.py leaves it empty); the sibling server fills both."""
    worker = sim_workers.start("aggregated", *FAST, "--schema-revision", str(revision),
                               "--tool-call-parser", "qwen3", "--reasoning-parser", "deepseek-r1")
    async with engine_client(worker.address) as client:
        info = await client.model_info()
    assert info.reasoning_parser == "deepseek-r1"
    assert info.tool_call_parser == ("" if revision == 1 else "qwen3")


async def test_without_parser_options_nothing_is_advertised(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", *FAST, "--schema-revision", "3")
    async with engine_client(worker.address) as client:
        info = await client.model_info()
    assert info.reasoning_parser == "" and info.tool_call_parser == ""


# ---- tool calls ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("parser", [p for p in TOOL_CALL_PARSERS
                                    if p not in ("hermes", "llama3", "deepseekv3", "deepseekv3.1", "glm4", "gpt_oss")])
async def test_each_family_calls_a_tool_in_its_format_with_schema_valid_arguments(sim_workers, engine_client, parser):
    worker = sim_workers.start("aggregated", *FAST, "--tool-call-parser", parser)
    ids = chat_ids([{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER])
    async with engine_client(worker.address) as client:
        text, finished = await answer(client, request("call", ids, max_tokens=2000))
        again, _ = await answer(client, request("again", ids, max_tokens=2000))
    assert ended_by_eos(finished), "a call ends with EOS, not at max_tokens"
    calls = parse_calls(parser, text)
    assert [name for name, _ in calls] == ["get_weather"], text
    validate(calls[0][1], WEATHER["function"]["parameters"])
    assert again == text  # deterministic for a prompt and seed


@pytest.mark.parametrize("parser", ["qwen3", "llama3_json", "mistral", "kimi_k2", "deepseek_v3", "glm45"])
async def test_parallel_calls_when_the_template_allows_them(sim_workers, engine_client, parser):
    worker = sim_workers.start("aggregated", *FAST, "--tool-call-parser", parser)
    user = [{"role": "user", "content": "Weather and news?"}]
    async with engine_client(worker.address) as client:
        several, _ = await answer(client, request("p", chat_ids(user, tools=TOOLS, parallel_tool_calls=True)))
        single, _ = await answer(client, request("s", chat_ids(user, tools=TOOLS, parallel_tool_calls=False)))
    calls = parse_calls(parser, several)
    assert sorted(name for name, _ in calls) == ["get_weather", "search"], several
    for name, arguments in calls:
        validate(arguments, {"get_weather": WEATHER, "search": SEARCH}[name]["function"]["parameters"])
    assert len(parse_calls(parser, single)) == 1


async def test_arguments_are_deterministic_per_seed_and_vary_with_it(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", *FAST, "--tool-call-parser", "qwen3")
    ids = chat_ids([{"role": "user", "content": "Weather?"}], tools=[WEATHER])
    async with engine_client(worker.address) as client:
        texts = [(await answer(client, request(f"s{seed}-{n}", ids, seed=seed)))[0]
                 for seed in range(6) for n in (0, 1)]
    assert all(texts[i] == texts[i + 1] for i in range(0, len(texts), 2))
    arguments = {json.dumps(parse_calls("qwen3", t)[0][1], sort_keys=True) for t in texts}
    assert len(arguments) > 1


async def test_tool_choice_none_required_and_named_are_obeyed(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", *FAST, "--tool-call-parser", "qwen3")
    user = [{"role": "user", "content": "Hello"}]
    result = [*user, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 degrees"}]
    async with engine_client(worker.address) as client:
        none, _ = await answer(client, request("none", chat_ids(user, tools=[WEATHER], tool_choice="none"),
                                               max_tokens=40))
        named = [parse_calls("qwen3", (await answer(client, request(f"named{seed}", chat_ids(
            user, tools=[WEATHER, SEARCH], tool_choice={"type": "function", "function": {"name": "search"}}),
            seed=seed)))[0]) for seed in range(4)]
        after, _ = await answer(client, request("after", chat_ids(result, tools=[WEATHER]), max_tokens=40))
        forced, _ = await answer(client, request("forced", chat_ids(result, tools=[WEATHER], tool_choice="required")))
    assert "<tool_call>" not in none
    assert all([name for name, _ in calls] == ["search"] for calls in named)
    assert "<tool_call>" not in after and after.startswith("The tool returned sunny, 21 degrees.")
    assert [name for name, _ in parse_calls("qwen3", forced)] == ["get_weather"]


@pytest.mark.parametrize("revision", ["1", "3"])
async def test_a_disaggregated_and_a_migrated_call_are_the_aggregated_call(sim_workers, engine_client, revision):
    flags = (*FAST, "--schema-revision", revision, "--tool-call-parser", "kimi_k2", "--reasoning-parser", "qwen3")
    agg, pre, dec = (sim_workers.start(role, *flags) for role in ("aggregated", "prefill", "decode"))
    ids = chat_ids([{"role": "user", "content": "Weather?"}], tools=[WEATHER])
    async with engine_client(agg.address) as a, engine_client(pre.address) as p, engine_client(dec.address) as d:
        whole = await collect(a, request("whole", ids, max_tokens=500))
        _, gen_events = await run_disaggregated(p, d, request("split", ids, max_tokens=500))
        sent = token_ids(whole)[:9]  # migration: the prompt plus what was already sent, on another worker
        rest = await collect(a, request("moved", ids + sent, max_tokens=500))
    assert token_ids(gen_events) == token_ids(whole)
    assert sent + token_ids(rest) == token_ids(whole)
    assert isinstance(terminal(rest), Finished) and ended_by_eos(terminal(rest))


# ---- the schema-instance generator (pure) -------------------------------------------------------------------

def test_schema_instances_are_valid_for_every_keyword_the_generator_takes():
    import random

    from orchestrator.sim.schema_instance import instance

    schema: dict[str, Any] = {"type": "object", "required": ["id", "kind", "point", "items", "choice", "note"],
              "$defs": {"point": {"type": "object", "required": ["x"], "properties": {
                  "x": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}}},
              "properties": {
                  "id": {"type": "integer", "minimum": 10, "maximum": 20, "multipleOf": 5},
                  "kind": {"const": "fixed"},
                  "point": {"$ref": "#/$defs/point"},
                  "items": {"type": "array", "minItems": 2, "maxItems": 4, "uniqueItems": True,
                            "items": {"type": "integer", "minimum": 0, "maximum": 1000}},
                  "choice": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "boolean"}]},
                  "note": {"allOf": [{"type": "object", "required": ["a"], "properties": {"a": {"type": "string"}}},
                                     {"required": ["b"], "properties": {"b": {"type": "null"}}}]},
                  "when": {"type": "string", "format": "date-time"}},
              "additionalProperties": False}
    for seed in range(200):
        value = instance(schema, random.Random(seed))
        assert set(value) <= set(schema["properties"]) and value["kind"] == "fixed"
        assert value["id"] in (10, 15, 20) and 0 < value["point"]["x"] < 1
        assert 2 <= len(value["items"]) <= 4 and len(set(value["items"])) == len(value["items"])
        assert (isinstance(value["choice"], str) and len(value["choice"]) <= 5) or isinstance(value["choice"], bool)
        assert isinstance(value["note"]["a"], str) and value["note"]["b"] is None
        validate(value["items"], schema["properties"]["items"])
    assert instance(schema, random.Random(3)) == instance(schema, random.Random(3))


# ---- reasoning ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("parser", "opening"), [("qwen3", "<think>\n"), ("deepseek-r1", "")])
async def test_thinking_writes_a_reasoning_block_unless_the_template_turned_it_off(sim_workers, engine_client, parser,
                                                                                   opening):
    worker = sim_workers.start("aggregated", *FAST, "--reasoning-parser", parser, "--tool-call-parser", "qwen3")
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    async with engine_client(worker.address) as client:
        thinking, _ = await answer(client, request("on", chat_ids(messages)))
        plain, _ = await answer(client, request("off", chat_ids(messages, enable_thinking=False)))
        call, _ = await answer(client, request("call", chat_ids(messages, tools=[SEARCH])))
    reasoning, closed, content = thinking.partition("\n</think>\n\n")
    assert closed and reasoning.startswith(opening) and "<think>" not in reasoning.removeprefix(opening)
    assert reasoning.strip() and content.strip()
    assert "think>" not in plain
    assert "</think>\n\n<tool_call>" in call and parse_calls("qwen3", call.partition("</think>\n\n")[2])


async def test_gpt_oss_writes_every_part_in_its_harmony_channel(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", *FAST, "--tool-call-parser", "openai")
    user = [{"role": "user", "content": "Weather?"}]
    async with engine_client(worker.address) as client:
        call, finished = await answer(client, request("call", chat_ids(user, tools=[WEATHER])))
        text, _ = await answer(client, request("text", chat_ids(user)))
        quiet, _ = await answer(client, request("quiet", chat_ids(user, enable_thinking=False), max_tokens=30))
    analysis = re.compile(r"<\|channel\|>analysis<\|message\|>[^<]+<\|end\|><\|start\|>assistant")
    head = analysis.match(call)
    assert head is not None and ended_by_eos(finished)
    (name, arguments), = parse_calls("openai", call[head.end():])
    assert name == "get_weather" and call.endswith("<|call|>")
    validate(arguments, WEATHER["function"]["parameters"])
    final = analysis.match(text)
    assert final is not None and text[final.end():].startswith("<|channel|>final<|message|>")
    assert quiet.startswith("<|channel|>final<|message|>")


# ---- guides -------------------------------------------------------------------------------------------------

async def test_a_json_schema_guide_is_answered_with_a_valid_instance(sim_workers, engine_client):
    """UPSTREAM guide-fields: the engine builds the grammar from GuidedDecoding.json_schema / json_object."""
    schema = WEATHER["function"]["parameters"]
    worker = sim_workers.start("aggregated", *FAST, "--guided-backend", "xgrammar", "--reasoning-parser", "qwen3")
    ids = chat_ids([{"role": "user", "content": "Weather as JSON"}])
    async with engine_client(worker.address) as client:
        for seed in range(5):
            text, finished = await answer(client, request(f"j{seed}", ids, seed=seed, max_tokens=1000,
                                                          guided=g.GuidedDecoding(json_schema=json.dumps(schema))))
            validate(json.loads(text), schema)  # no reasoning block: the grammar holds from the first token
            assert ended_by_eos(finished)
        json_object = g.GuidedDecoding(json_object=g.JsonObjectConstraint())
        text, _ = await answer(client, request("obj", ids, guided=json_object))
        assert isinstance(json.loads(text), dict)


async def test_a_structural_tag_or_an_any_of_of_calls_gives_a_valid_call(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", *FAST, "--guided-backend", "xgrammar")
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [
        {"begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
         "content": {"type": "json_schema", "json_schema": WEATHER["function"]["parameters"]},
         "end": "}\n</tool_call>"}], "at_least_one": True}}
    any_of = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "required": ["name", "parameters"], "properties": {
            "name": {"enum": [tool["function"]["name"]]}, "parameters": tool["function"]["parameters"]}}
        for tool in (WEATHER, SEARCH)]}}
    ids = chat_ids([{"role": "user", "content": "Weather?"}], tools=[WEATHER, SEARCH])
    async with engine_client(worker.address) as client:
        tagged, _ = await answer(client, request("tag", ids, guided=g.GuidedDecoding(structural_tag=json.dumps(tag))))
        listed, _ = await answer(client, request("anyof", ids, guided=g.GuidedDecoding(json_schema=json.dumps(any_of))))
    (name, arguments), = parse_calls("qwen3", tagged)
    assert name == "get_weather"
    validate(arguments, WEATHER["function"]["parameters"])
    for call in json.loads(listed):
        tool = {"get_weather": WEATHER, "search": SEARCH}[call["name"]]
        validate(call["parameters"], tool["function"]["parameters"])


async def test_a_guide_the_engine_ignores_leaves_the_text_free(sim_workers, engine_client):
    """UPSTREAM guided-capability: the sibling server without a backend passes the guide on and the engine
    ignores it, so the answer is the unguided one."""
    worker = sim_workers.start("aggregated", *FAST, "--schema-revision", "3")
    ids = chat_ids([{"role": "user", "content": "Hi"}])
    guide = g.GuidedDecoding(json_schema=json.dumps({"type": "object"}))
    async with engine_client(worker.address) as client:
        guided, _ = await answer(client, request("g", ids, max_tokens=12, guided=guide))
        free, _ = await answer(client, request("f", ids, max_tokens=12))
    assert guided == free


# ---- EOS ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chat", [True, False])
async def test_without_max_tokens_the_answer_ends_with_eos_after_a_natural_length(sim_workers, engine_client, chat):
    worker = sim_workers.start("aggregated", *FAST)
    async with engine_client(worker.address) as client:
        lengths = []
        for seed in range(8):
            ids = chat_ids([{"role": "user", "content": f"Tell me a story {seed}"}]) if chat else [11, 12, 13, seed]
            events = await collect(client, request(f"n{seed}", ids, seed=seed))
            finished = terminal(events)
            assert isinstance(finished, Finished) and ended_by_eos(finished)
            lengths.append(len(token_ids(events)))
            assert all(isinstance(e, (Tokens, Finished)) for e in events)
        bounded = await collect(client, request("bounded", [11, 12, 13, 0], seed=0, max_tokens=1500))
    assert all(8 <= n <= 1024 for n in lengths) and len(set(lengths)) > 1
    assert len(token_ids(bounded)) == 1500  # a given max_tokens is still the length (benchmarks rely on it)


async def test_with_natural_eos_a_given_max_tokens_is_only_a_bound(sim_workers, engine_client):
    """What the orchestrator sends (every text request has a max_tokens): the model still stops when done."""
    worker = sim_workers.start("aggregated", *FAST, "--natural-eos")
    async with engine_client(worker.address) as client:
        for seed in range(4):
            ids = chat_ids([{"role": "user", "content": f"Tell me a story {seed}"}])
            events = await collect(client, request(f"b{seed}", ids, seed=seed, max_tokens=3000))
            finished = terminal(events)
            assert isinstance(finished, Finished) and ended_by_eos(finished)
            assert 8 <= len(token_ids(events)) <= 1024


# ---- the template -------------------------------------------------------------------------------------------

def test_the_shipped_template_is_the_builders_and_renders_plain_chats_as_chatml():
    config = json.loads((TINY_CHAT / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert TOKENIZER.render_chat(messages) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi"
                                               "<|im_end|>\n<|im_start|>assistant\n")
