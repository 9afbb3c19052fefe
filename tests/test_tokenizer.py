"""Chat template rendering and incremental detokenization with stop strings."""

import pytest

from orchestrator.models import TINY_CHAT
from orchestrator.tokenizer import IncrementalDetokenizer, ModelTokenizer

TOKENIZER = ModelTokenizer.from_dir(TINY_CHAT)
TEXT = "Hello 😀 東京 café — the weather is sunny. Привет!"


def stream(ids, stop=(), step=1):
    detok = IncrementalDetokenizer(TOKENIZER, stop=stop)
    pieces = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    pieces.append(detok.finish())
    return pieces, detok


def test_chat_template_renders_chatml_with_generation_prompt():
    text = TOKENIZER.render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("step", [1, 2, 5])
def test_streamed_text_equals_the_full_decode_and_never_holds_broken_utf8(step):
    ids = TOKENIZER.encode(TEXT)
    pieces, _ = stream(ids, step=step)
    assert "".join(pieces) == TEXT == TOKENIZER.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_a_multibyte_character_split_over_tokens_is_released_whole():
    ids = TOKENIZER.encode("😀")
    assert len(ids) > 1  # byte-level pieces
    pieces, _ = stream(ids)
    assert [p for p in pieces if p] == ["😀"]


def test_stop_string_truncates_and_is_never_emitted_even_partially():
    ids = TOKENIZER.encode("the weather is sunny. Stop here please")
    pieces, detok = stream(ids, stop=["sunny."])
    assert "".join(pieces) == "the weather is "
    assert detok.stopped_on == "sunny."
    assert not any("sun" in p for p in pieces)


def test_earliest_of_several_stop_strings_wins():
    ids = TOKENIZER.encode("one two three four")
    pieces, detok = stream(ids, stop=["four", "two"])
    assert "".join(pieces) == "one " and detok.stopped_on == "two"


def test_a_partial_stop_string_at_the_end_is_released_as_text():
    ids = TOKENIZER.encode("the answer is sun")
    pieces, detok = stream(ids, stop=["sunny"])
    assert "".join(pieces) == "the answer is sun" and detok.stopped_on is None
