"""The parsers (orchestrator/parsers/) as a request uses them: any split of the model's text into deltas (the
prefill leg's first token, the decode leg, a migration) gives the same answer, and the stream's deltas add up to
the collected view. Formats themselves are held in tests/unit/test_parsers_conformance.py."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator import parsers
from orchestrator.parsers import Collector, Delta
from test_parsers_conformance import SAMPLES, Sample


def stream(spec: parsers.ParserSpec, pieces: list[str], **kwargs) -> list[Delta]:
    parser = spec.new(seed="req-1", **kwargs)
    deltas = [parser.feed(piece) for piece in pieces]
    deltas.append(parser.finish())
    return deltas


def collect(deltas: list[Delta]) -> parsers.Message:
    collector = Collector()
    for delta in deltas:
        collector.add(delta)
    return collector.message()


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({cut % (len(text) + 1) for cut in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def check_stream_shape(deltas: list[Delta]) -> None:
    """OpenAI's shape: a call's first delta has its id and name, later ones only arguments; indexes go up."""
    seen: set[int] = set()
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.index in seen:
                assert piece.id is None and piece.name is None
            else:
                assert piece.index == len(seen) and piece.id and piece.name
                seen.add(piece.index)


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.family for s in SAMPLES])
@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_every_split_of_a_sample_gives_the_whole_texts_answer(sample: Sample, cuts: list[int]):
    spec = parsers.resolve(sample.tool_call_parser, sample.reasoning_parser)
    whole = collect(stream(spec, [sample.text], **sample.kwargs))
    deltas = stream(spec, split(sample.text, cuts), **sample.kwargs)
    check_stream_shape(deltas)
    assert collect(deltas) == whole


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.family for s in SAMPLES])
def test_a_character_at_a_time_gives_the_whole_texts_answer(sample: Sample):
    spec = parsers.resolve(sample.tool_call_parser, sample.reasoning_parser)
    deltas = stream(spec, list(sample.text), **sample.kwargs)
    check_stream_shape(deltas)
    assert collect(deltas) == collect(stream(spec, [sample.text], **sample.kwargs))


# ---- examples, on the <tool_call> family ---------------------------------------------------------------
HERMES = parsers.resolve("qwen3", "qwen3")


def answer(text: str, spec: parsers.ParserSpec = HERMES, **kwargs) -> parsers.Message:
    """The collected answer, checked to be the same for a character-at-a-time stream."""
    whole = collect(stream(spec, [text], **kwargs))
    assert collect(stream(spec, list(text), **kwargs)) == whole
    return whole


def calls_of(message: parsers.Message) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in message.tool_calls]


def test_text_before_a_call_is_content():
    message = answer('Let me look that up.<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert message.content == "Let me look that up."
    assert calls_of(message) == [("f", {})]


def test_two_parallel_calls_get_indexes_and_distinct_ids_and_no_stray_content():
    message = answer('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n\n'
                     '<tool_call>\n{"name": "b", "arguments": {"y": 2}}\n</tool_call>\n')
    assert message.content == ""
    assert calls_of(message) == [("a", {"x": 1}), ("b", {"y": 2})]
    assert message.tool_calls[0].id != message.tool_calls[1].id


def test_nested_json_unicode_and_escaped_quotes_stream_as_written():
    arguments = '{"q": {"deep": [1, {"k": "v}"}]}, "city": "Zürich 東京", "say": "he said \\"hi\\" \\\\"}'
    message = answer(f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>')
    assert message.tool_calls[0].arguments == arguments  # the model's own text, verbatim
    assert json.loads(message.tool_calls[0].arguments)["city"] == "Zürich 東京"


def test_a_malformed_call_becomes_content_and_nothing_is_lost():
    text = 'Before <tool_call>not json at all</tool_call> after'
    message = answer(text)
    assert message.tool_calls == ()
    assert message.content == text


def test_a_call_without_a_name_becomes_content():
    text = '<tool_call>{"arguments": {"a": 1}}</tool_call>'
    assert answer(text) == parsers.Message(text, "", ())


def test_reasoning_then_a_call():
    message = answer('<think>Need weather.</think>Checking.<tool_call>{"name": "w", "arguments": {"c": "x"}}'
                     '</tool_call>')
    assert (message.reasoning_content, message.content) == ("Need weather.", "Checking.")
    assert calls_of(message) == [("w", {"c": "x"})]


def test_a_call_inside_reasoning_is_not_a_call():
    message = answer('<think>maybe <tool_call>{"name": "w", "arguments": {}}</tool_call></think>done')
    assert message.tool_calls == () and message.content == "done"


def test_a_stream_that_ends_mid_tag_gives_the_partial_tag_back():
    assert answer("Hello <tool_c") == parsers.Message("Hello <tool_c", "", ())
    assert answer("<think>hmm </thi") == parsers.Message("", "hmm </thi", ())


def test_a_call_cut_off_by_the_end_keeps_what_it_streamed():
    message = answer('<tool_call>{"name": "f", "arguments": {"a": "par')
    assert [(call.name, call.arguments) for call in message.tool_calls] == [("f", '{"a": "par')]


def test_a_call_cut_off_before_its_name_is_content():
    text = '<tool_call>{"name": "f'
    assert answer(text) == parsers.Message(text, "", ())


def test_the_prompt_may_open_the_reasoning():
    spec = parsers.resolve(None, "qwen3")
    message = answer("thinking...</think>answer", spec, prompt_opens_reasoning=True)
    assert (message.reasoning_content, message.content) == ("thinking...", "answer")
    assert answer("thinking...</think>answer", parsers.resolve(None, "deepseek-r1")).reasoning_content == (
        "thinking...")


def test_tool_choice_none_leaves_calls_as_content():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert answer(text, parsers.resolve("qwen3"), tool_calls=False) == parsers.Message(text, "", ())


def test_ids_are_deterministic_for_a_seed_and_differ_between_requests():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    spec = parsers.resolve("qwen3")
    first = parsers.parse_whole(spec.new(seed="a"), text).tool_calls[0].id
    assert first == parsers.parse_whole(spec.new(seed="a"), text).tool_calls[0].id
    assert first != parsers.parse_whole(spec.new(seed="b"), text).tool_calls[0].id
    assert first.startswith("call_")


def test_arguments_stream_in_fragments_after_a_first_delta_with_the_name():
    parser = parsers.resolve("qwen3").new(seed="s")
    pieces = ['<tool_call>{"name": "f", "argu', 'ments": {"a"', ': "b', 'c"}}</tool_call>']
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    calls = [piece for delta in deltas for piece in delta.tool_calls]
    assert calls[0].name == "f" and calls[0].index == 0
    assert [piece.arguments for piece in calls] == ['{"a"', ': "b', 'c"}']


def test_an_unknown_parser_name_is_a_clear_error():
    with pytest.raises(parsers.UnknownParserError) as caught:
        parsers.resolve("no_such_parser")
    assert caught.value.kind == "tool call" and "qwen3" in caught.value.known
    with pytest.raises(parsers.UnknownParserError):
        parsers.resolve(None, "nope")


def test_no_parser_passes_content_through():
    assert answer("<tool_call>x</tool_call><think>", parsers.resolve(None, None)).content == (
        "<tool_call>x</tool_call><think>")


# ---- examples, on the other families -----------------------------------------------------------------
def test_kimi_calls_keep_the_models_own_ids():
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>"
            '{"q": "x"}<|tool_call_end|><|tool_calls_section_end|>')
    assert [call.id for call in answer(text, parsers.resolve("kimi_k2")).tool_calls] == ["functions.search:0"]


def test_mistral_ids_are_nine_letters_and_digits_as_its_templates_demand():
    message = answer('[TOOL_CALLS]f[ARGS]{"a": 1}', parsers.resolve("mistral"))
    (call,) = message.tool_calls
    assert len(call.id) == 9 and call.id.isalnum()


def test_glm_call_without_arguments_has_an_empty_object():
    message = answer("<tool_call>get_time</tool_call>", parsers.resolve("glm47"))
    assert calls_of(message) == [("get_time", {})]


def test_qwen3_coder_keeps_text_without_a_schema_and_types_it_with_one():
    text = "<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n</function>\n</tool_call>"
    assert calls_of(answer(text, parsers.resolve("qwen3_coder"))) == [("f", {"n": "42"})]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"type": "integer"}}}}}]
    assert calls_of(answer(text, parsers.resolve("qwen3_coder"), tools=tools)) == [("f", {"n": 42})]


def test_qwen3_coder_block_without_a_function_is_content():
    text = "<tool_call>\nhello\n</tool_call> bye"
    assert answer(text, parsers.resolve("qwen3_coder")) == parsers.Message(text, "", ())


def test_llama_json_output_that_is_not_a_call_stays_content():
    text = '{"answer": 42, "why": "because"}'
    assert answer(text, parsers.resolve("llama3_json")) == parsers.Message(text, "", ())


def test_llama_text_answer_is_content():
    text = "The answer is 42. {not a call}"
    assert answer(text, parsers.resolve("llama3_json")) == parsers.Message(text, "", ())


def test_deepseek_call_that_names_nothing_is_content():
    begin, call, sep = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581begin\uff5c>", (
        "<\uff5ctool\u2581sep\uff5c>")
    message = answer(f"{begin}{call}{sep}{{}}", parsers.resolve("deepseek_v31"))
    assert message.tool_calls == () and message.content == f"{call}{sep}{{}}"


def test_special_tokens_are_needed_only_where_markers_are_special_tokens():
    assert parsers.resolve("mistral").needs_special_tokens
    assert not parsers.resolve("qwen3").needs_special_tokens


# ---- hostile text: fragments of every family's markup, in any order, in any split --------------------
FRAGMENTS = [
    "hello ", "\n", " ", "<", ">", "{", "}", "[", "]", '"', "\\", ",", ";", ":", "<think>", "</think>", "</thi",
    "<tool_call>", "</tool_call>", "<tool_c", '{"name": "f", "arguments": {', '{"name": "g", "parameters": {',
    '"a": "x}\\"', '"b": [1, {"c": 2}]', "}}", "<|python_tag|>", "[TOOL_CALLS]", "f[ARGS]", "[CALL_ID]",
    "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581begin\uff5c>", "function",
    "<\uff5ctool\u2581sep\uff5c>", "```json\n", "\n```", "<\uff5ctool\u2581call\u2581end\uff5c>",
    "<\uff5ctool\u2581calls\u2581end\uff5c>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
    "functions.f:0", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>",
    "<function=f>", "<parameter=p>", "</parameter>", "</function>", "<arg_key>", "</arg_key>", "<arg_value>",
    "</arg_value>", "1", "true", "東京",
]
FAMILIES = [("qwen3", "qwen3"), ("llama3_json", None), ("mistral", None), ("deepseek_v3", "deepseek-r1"),
            ("deepseek_v31", None), ("kimi_k2", "kimi_k2"), ("qwen3_coder", None), ("glm4", None), (None, "qwen3"),
            ("qwen3", "nemotron-v3")]


@pytest.mark.parametrize("names", FAMILIES, ids=[f"{t}+{r}" for t, r in FAMILIES])
@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=14),
       cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10))
def test_any_text_in_any_split_gives_one_answer(names: tuple[str | None, str | None], pieces: list[str],
                                                 cuts: list[int]):
    spec = parsers.resolve(*names)
    text = "".join(pieces)
    deltas = stream(spec, split(text, cuts))
    check_stream_shape(deltas)
    assert collect(deltas) == collect(stream(spec, [text]))


@pytest.mark.parametrize("names", FAMILIES, ids=[f"{t}+{r}" for t, r in FAMILIES])
@settings(max_examples=100, deadline=None)
@given(words=st.lists(st.sampled_from(["hello", " ", "\n", "world", "{", "}", "<", "[", "x: 1", "é"]), max_size=20))
def test_text_without_any_markup_is_content_untouched(names: tuple[str | None, str | None], words: list[str]):
    text = "".join(words)
    if text.lstrip().startswith("{") and names[0] == "llama3_json":
        return  # a bare object opening the answer may be a Llama call: held by the other tests
    inside = names[1] in ("deepseek-r1", "nemotron-v3")  # these answers start inside the reasoning
    expected = parsers.Message("", text, ()) if inside else parsers.Message(text, "", ())
    assert collect(stream(parsers.resolve(*names), [text])) == expected


def test_deltas_and_calls_render_as_openai_shapes():
    parser = parsers.resolve("qwen3").new(seed="s")
    first = parser.feed('<tool_call>{"name": "f", "arguments": {"a"')
    later = parser.feed(": 1}}</tool_call>")
    (call,) = parsers.parse_whole(parsers.resolve("qwen3").new(seed="s"),
                                  '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>').tool_calls
    assert first.tool_calls[0].openai() == {"index": 0, "id": call.id, "type": "function",
                                            "function": {"name": "f", "arguments": '{"a"'}}
    assert later.tool_calls[0].openai() == {"index": 0, "function": {"arguments": ": 1}"}}
    assert call.openai() == {"id": call.id, "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def test_the_parsers_package_is_a_leaf():
    import ast
    from pathlib import Path

    package = Path(parsers.__file__).parent
    imported = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    outside = {name for name in imported if name.startswith("orchestrator") and not name.startswith(
        "orchestrator.parsers")}
    assert outside == set()


# ---- one hard call in every family: nested JSON, unicode, escaped quotes, after some text --------------
HARD_ARGUMENTS = {"q": {"deep": [1, {"k": "v}"}]}, "city": "Zürich 東京", "say": 'he said "hi" \\ <b>'}
HARD_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "q": {"type": "object"}, "city": {"type": "string"}, "say": {"type": "string"}}}}}]


def written_by(family: str, name: str, arguments: dict) -> str:
    """One call as the family writes it."""
    raw = json.dumps(arguments, ensure_ascii=False)
    begins, begin, sep, end, ends = (f"<\uff5c{words.replace(' ', chr(0x2581))}\uff5c>" for words in (
        "tool calls begin", "tool call begin", "tool sep", "tool call end", "tool calls end"))
    if family == "qwen3":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {raw}}}\n</tool_call>'
    if family == "llama3_json":
        return f'<|python_tag|>{{"name": "{name}", "parameters": {raw}}}'
    if family == "mistral":
        return f"[TOOL_CALLS]{name}[ARGS]{raw}"
    if family == "deepseek_v3":
        return f"{begins}{begin}function{sep}{name}\n```json\n{raw}\n```{end}{ends}"
    if family == "deepseek_v31":
        return f"{begins}{begin}{name}{sep}{raw}{end}{ends}"
    if family == "kimi_k2":
        return (f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>"
                f"{raw}<|tool_call_end|><|tool_calls_section_end|>")
    text = {key: value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            for key, value in arguments.items()}
    if family == "qwen3_coder":
        params = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in text.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    if family == "glm4":
        params = "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n" for key, value in text.items())
        return f"<tool_call>{name}\n{params}</tool_call>"
    raise ValueError(family)


@pytest.mark.parametrize("family", ["qwen3", "llama3_json", "mistral", "deepseek_v3", "deepseek_v31", "kimi_k2",
                                    "qwen3_coder", "glm4"])
def test_a_hard_call_after_text_parses_whole_in_every_family(family: str):
    spec = parsers.resolve(family)
    text = "Let me look: é 東京 " + written_by(family, "f", HARD_ARGUMENTS)
    message = answer(text, spec, tools=HARD_TOOLS)
    assert message.content == "Let me look: é 東京 "
    assert calls_of(message) == [("f", HARD_ARGUMENTS)]


def test_an_end_tag_closes_a_call_whose_json_the_model_left_open():
    message = answer('<tool_call>{"name": "f", "arguments": {"a": [1</tool_call> Then text.')
    assert [(call.name, call.arguments) for call in message.tool_calls] == [("f", '{"a": [1')]
    assert message.content == " Then text."
    message = answer('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>after')
    assert calls_of(message) == [("f", {"a": 1})] and message.content == "after"


def test_an_end_tag_inside_a_string_argument_is_text():
    message = answer('<tool_call>{"name": "f", "arguments": {"html": "</tool_call>"}}</tool_call>')
    assert calls_of(message) == [("f", {"html": "</tool_call>"})] and message.content == ""
