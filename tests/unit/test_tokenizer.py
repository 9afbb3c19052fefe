"""Chat template rendering and incremental detokenization with stop strings."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from orchestrator.models import TINY_CHAT
from orchestrator.tokenizer import IncrementalDetokenizer, ModelTokenizer, TemplateError

TOKENIZER = ModelTokenizer.from_dir(TINY_CHAT)
TEXT = "Hello 😀 東京 café — the weather is sunny. Привет!"


def through_decode_stream() -> ModelTokenizer:
    """tiny-chat with its ByteLevel decoder wrapped in a one-step Sequence: it decodes the same text, but is
    not a bare ByteLevel decoder, so it takes the general path (the library's DecodeStream)."""
    spec = json.loads((TINY_CHAT / "tokenizer.json").read_text())
    spec["decoder"] = {"type": "Sequence", "decoders": [spec["decoder"]]}
    config = json.loads((TINY_CHAT / "tokenizer_config.json").read_text())
    return ModelTokenizer(Tokenizer.from_str(json.dumps(spec)), config, TINY_CHAT)


GENERAL = through_decode_stream()
BOTH_PATHS = pytest.mark.parametrize("tokenizer", [TOKENIZER, GENERAL], ids=["byte table", "DecodeStream"])


def test_a_byte_level_tokenizer_decodes_from_its_table_of_token_bytes():
    table = TOKENIZER.token_bytes
    assert table is not None and len(table) == TOKENIZER.tokenizer.get_vocab_size()
    assert table[TOKENIZER.encode(" sunny")[0]].startswith(b" ")  # GPT-2's "Ġ" stands for the space byte
    assert TOKENIZER.eos_id is not None
    assert table[TOKENIZER.eos_id] == b""  # special tokens are skipped in streamed text
    assert GENERAL.token_bytes is None


def stream(ids, stop=(), step=1, tokenizer=TOKENIZER):
    detok = IncrementalDetokenizer(tokenizer, stop=stop)
    pieces = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    pieces.append(detok.finish())
    return pieces, detok


def test_chat_template_renders_chatml_with_generation_prompt():
    text = TOKENIZER.render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


IMAGE_TURN = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"},
                                           {"type": "text", "text": "and"}, {"type": "image"}]}]


def test_a_template_that_takes_content_parts_writes_the_models_own_image_placeholder():
    assert TOKENIZER.takes_content_parts and TOKENIZER.image_token == "<|image|>"
    text = TOKENIZER.render_chat(IMAGE_TURN)
    assert text == "<|im_start|>user\nlook<|image|>and<|image|><|im_end|>\n<|im_start|>assistant\n"
    ids = TOKENIZER.encode(text)
    assert TOKENIZER.image_token_id is not None
    assert ids.count(TOKENIZER.image_token_id) == 2  # one special token per image, never split


def string_only_model(tmp_path, **config):
    (tmp_path / "tokenizer.json").write_text((TINY_CHAT / "tokenizer.json").read_text())
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template,
                                                                **config}))
    return tmp_path


def test_a_string_only_template_gets_text_parts_joined_and_the_image_token_of_the_processor(tmp_path):
    model = string_only_model(tmp_path)
    (model / "processor_config.json").write_text(json.dumps({"image_token": "<|image|>"}))
    tokenizer = ModelTokenizer.from_dir(model)
    assert not tokenizer.takes_content_parts
    assert tokenizer.render_chat(IMAGE_TURN) == "[user] look\n<|image|>\nand\n<|image|>\n"


MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                            "content": st.text(max_size=40)}), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(MESSAGES)
def test_render_chat_is_what_jinjas_own_render_gives(messages):
    """render_chat calls the template's render function itself, with the variables merged once at load."""
    assert TOKENIZER._template is not None
    expected = TOKENIZER._template.render(messages=messages, add_generation_prompt=True,
                                          bos_token=TOKENIZER.bos_token or "", eos_token=TOKENIZER.eos_token or "")
    assert TOKENIZER.render_chat(messages) == expected


def test_a_template_sees_bos_eos_and_the_globals_and_its_raise_exception_is_a_template_error(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}"
                "{% if m['role'] == 'bad' %}{{ raise_exception('no ' + m['role']) }}{% endif %}"
                "{{ m['content'] }}{{ eos_token }}{% endfor %}{{ range(2) | list }}{{ add_generation_prompt }}")
    tokenizer = ModelTokenizer.from_dir(string_only_model(tmp_path, bos_token="<s>", chat_template=template))
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "<s>hi<|im_end|>[0, 1]True"
    with pytest.raises(TemplateError, match="no bad"):
        tokenizer.render_chat([{"role": "bad", "content": "x"}])
    with pytest.raises(TemplateError):  # the sandbox stays: no attribute of a Python internal
        ModelTokenizer.from_dir(string_only_model(tmp_path, chat_template="{{ messages.__class__.__mro__ }}")) \
            .render_chat([{"role": "user", "content": "x"}])


def test_a_model_that_names_no_image_placeholder_refuses_images_instead_of_guessing(tmp_path):
    tokenizer = ModelTokenizer.from_dir(string_only_model(tmp_path))
    assert tokenizer.render_chat([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}]) == "[user] a\nb\n"
    with pytest.raises(TemplateError, match="cannot take images"):
        tokenizer.render_chat(IMAGE_TURN)


@pytest.mark.parametrize("step", [1, 2, 5])
@BOTH_PATHS
def test_streamed_text_equals_the_full_decode_and_never_holds_broken_utf8(step, tokenizer):
    ids = TOKENIZER.encode(TEXT)
    pieces, _ = stream(ids, step=step, tokenizer=tokenizer)
    assert "".join(pieces) == TEXT == TOKENIZER.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


@given(st.lists(st.integers(0, TOKENIZER.tokenizer.get_vocab_size() + 3), max_size=60), st.integers(1, 4),
       st.sampled_from([TOKENIZER, GENERAL]))
@settings(max_examples=300, deadline=None)
def test_any_token_sequence_streams_to_its_full_decode(ids, step, tokenizer):
    """Whatever a worker samples (byte pieces that never complete, special tokens, ids past the vocabulary),
    the stream adds up to the library's one-shot decode on either path; a character left unfinished at the
    end comes out as U+FFFD."""
    pieces, _ = stream(ids, step=step, tokenizer=tokenizer)
    assert "".join(pieces) == TOKENIZER.decode(ids)


WORDS = ["the", " weather", " is", " sunny", ".", " Stop", " here", " 😀", " 東京", "\n"]


@given(st.lists(st.sampled_from(WORDS), max_size=30), st.lists(st.text("the sunySop.\n 😀東", min_size=1, max_size=4),
       min_size=1, max_size=3), st.integers(1, 4), st.sampled_from([TOKENIZER, GENERAL]))
@settings(max_examples=300, deadline=None)
def test_with_stop_strings_the_stream_is_the_text_up_to_the_first_stop_and_never_shows_one(words, stops, step,
                                                                                          tokenizer):
    full = "".join(words)
    pieces, detok = stream(TOKENIZER.encode(full), stop=stops, step=step, tokenizer=tokenizer)
    out = "".join(pieces)
    assert not any(stop in out for stop in stops)
    if detok.stopped_on is None:
        assert out == full and not any(stop in full for stop in stops)
    else:
        assert full.startswith(out + detok.stopped_on)


@BOTH_PATHS
def test_a_multibyte_character_split_over_tokens_is_released_whole(tokenizer):
    ids = TOKENIZER.encode("😀")
    assert len(ids) > 1  # byte-level pieces
    pieces, _ = stream(ids, tokenizer=tokenizer)
    assert [p for p in pieces if p] == ["😀"]


@BOTH_PATHS
def test_stop_string_truncates_and_is_never_emitted_even_partially(tokenizer):
    ids = TOKENIZER.encode("the weather is sunny. Stop here please")
    pieces, detok = stream(ids, stop=["sunny."], tokenizer=tokenizer)
    assert "".join(pieces) == "the weather is "
    assert detok.stopped_on == "sunny."
    assert not any("sun" in p for p in pieces)


@BOTH_PATHS
def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = TOKENIZER.encode("one two three four")
    pieces, detok = stream(ids, stop=["four", "two"], tokenizer=tokenizer)
    assert "".join(pieces) == "one " and detok.stopped_on == "two"


@BOTH_PATHS
def test_a_partial_stop_string_at_the_end_is_released_as_text(tokenizer):
    ids = TOKENIZER.encode("the answer is sun")
    pieces, detok = stream(ids, stop=["sunny"], tokenizer=tokenizer)
    assert "".join(pieces) == "the answer is sun" and detok.stopped_on is None


@pytest.mark.parametrize("step", [1, 2, 8])
def test_special_tokens_are_text_when_the_output_parser_reads_its_markers_there_but_eos_never(step):
    """Llama's <|python_tag|>, Mistral's [TOOL_CALLS] and gpt-oss's channels are special tokens: a detokenizer
    that skips them (the default) hides a tool call from its parser. EOS ends an answer and is never its text."""
    assert TOKENIZER.eos_id is not None
    ids = TOKENIZER.encode("<|im_start|>call<|image|> now") + [TOKENIZER.eos_id]
    for keep, expected in ((False, "call now"), (True, "<|im_start|>call<|image|> now")):
        detokenizer = IncrementalDetokenizer(TOKENIZER, keep_special=keep)
        text = "".join(detokenizer.add(ids[i:i + step]) for i in range(0, len(ids), step)) + detokenizer.finish()
        assert text == expected
    general = IncrementalDetokenizer(GENERAL, keep_special=True)  # the DecodeStream path keeps them too
    assert "<|im_start|>" in general.add(ids[:3]) + general.finish()
