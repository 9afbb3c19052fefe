"""gpt-oss through openai-harmony (orchestrator/parsers/harmony.py): channels to reasoning, content and calls.

The mapping is checked against a scripted stand-in for harmony's StreamableParser (what it reports per token);
the whole path, with harmony's real encoding and parser, runs where its vocabulary can be loaded (it is
downloaded, or read from TIKTOKEN_ENCODINGS_BASE: not in an offline test environment)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator import parsers
from orchestrator.parsers import harmony
from orchestrator.parsers.events import CallIds


class ScriptedStream:
    """What StreamableParser reports after each token: token n plays SCRIPT[n]."""

    def __init__(self, script: list[tuple[str | None, str | None, str | None, bool]]) -> None:
        self.script = script
        self.messages: list[Any] = []
        self.current_channel: str | None = None
        self.current_recipient: str | None = None
        self.last_content_delta: str | None = None

    def process(self, token: int) -> None:
        channel, recipient, delta, ends = self.script[token]
        if ends:
            self.messages.append(SimpleNamespace(channel=self.current_channel, recipient=self.current_recipient))
            self.current_channel = self.current_recipient = self.last_content_delta = None
            return
        self.current_channel, self.current_recipient, self.last_content_delta = channel, recipient, delta

    def process_eos(self) -> None:
        if self.current_channel is not None:
            self.process(len(self.script) - 1)


SCRIPT = [
    ("analysis", None, "Need ", False),
    ("analysis", None, "the weather.", False),
    (None, None, None, True),  # <|end|>
    ("commentary", None, "Checking now.", False),  # a preamble: content
    (None, None, None, True),
    ("commentary", "functions.get_weather", None, False),  # the header's last token: no text yet
    ("commentary", "functions.get_weather", '{"city"', False),
    ("commentary", "functions.get_weather", ': "Paris"}', False),
    (None, None, None, True),  # <|call|>
    ("commentary", "functions.get_time", None, False),
    (None, None, None, True),  # a call with no argument text
    ("final", None, "It is sunny.", False),
    (None, None, None, True),
]


def run(tokens_per_feed: list[list[int]]) -> parsers.Message:
    parser = harmony.HarmonyParser(encoding=None, ids=CallIds("s"), streamable=ScriptedStream(SCRIPT))
    collector = parsers.Collector()
    for tokens in tokens_per_feed:
        collector.add(parser.feed_tokens(tokens))
    collector.add(parser.finish())
    return collector.message()


def test_channels_map_to_reasoning_content_and_calls():
    message = run([list(range(len(SCRIPT)))])
    assert message.reasoning_content == "Need the weather."
    assert message.content == "Checking now.It is sunny."
    assert [(call.name, call.arguments) for call in message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "")]
    assert len({call.id for call in message.tool_calls}) == 2


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(SCRIPT)), max_size=6))
def test_any_grouping_of_tokens_gives_the_same_answer(cuts: list[int]):
    points = sorted(set(cuts))
    groups = [list(range(a, b)) for a, b in zip([0, *points], [*points, len(SCRIPT)])]
    assert run(groups) == run([list(range(len(SCRIPT)))])


def test_the_registry_names_gpt_oss_by_vllms_names_and_needs_the_encoding():
    spec = parsers.resolve("openai", "openai_gptoss")
    assert spec.harmony and spec.needs_special_tokens
    assert parsers.resolve("gpt_oss").harmony
    with pytest.raises(ValueError, match="harmony"):
        spec.new(seed="s")


GPT_OSS_TEXT = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')


@pytest.fixture(scope="module")
def encoding() -> Any:
    try:
        return harmony.load_encoding()
    except Exception as error:  # noqa: BLE001 - HarmonyError: the vocabulary is not reachable
        pytest.skip(f"harmony's gpt-oss vocabulary cannot be loaded here: {error}")


def test_real_harmony_text_in_any_split(encoding: Any):
    # the model card's shape of a gpt-oss answer (openai/gpt-oss-20b, "harmony response format")
    spec = parsers.resolve("openai", "openai_gptoss")
    whole = parsers.parse_whole(spec.new(seed="s", harmony_encoding=encoding), GPT_OSS_TEXT)
    assert whole.reasoning_content == "Need the weather."
    assert [(call.name, json.loads(call.arguments)) for call in whole.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    for cut in range(len(GPT_OSS_TEXT) + 1):
        parser = spec.new(seed="s", harmony_encoding=encoding)
        collector = parsers.Collector()
        for piece in (GPT_OSS_TEXT[:cut], GPT_OSS_TEXT[cut:]):
            collector.add(parser.feed(piece))
        collector.add(parser.finish())
        assert collector.message() == whole
