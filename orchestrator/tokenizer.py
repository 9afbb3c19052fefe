"""The model's tokenizer and chat template, and incremental detokenization with stop strings.

`ModelTokenizer` reads a model directory: tokenizer.json (the `tokenizers` library),
tokenizer_config.json (chat_template for jinja2, eos/bos tokens, image_token) and, when present,
processor_config.json (a vision processor's image_token).

Images in chat messages: a template that iterates a message's content (as the templates of
vision-language models do) gets structured parts, `{"type": "text", "text": ...}` and
`{"type": "image"}`, and writes the model's own placeholder. A template that only concatenates
strings gets the text with the model's image_token where each image stood. A model that names no
placeholder either way cannot take images: that is an error, not a guess.

`IncrementalDetokenizer` turns token ids into text as they stream:
- text is released only once its UTF-8 is complete (a multi-byte character split over tokens
  decodes to U+FFFD until its last byte arrives);
- a byte-level BPE tokenizer (GPT-2's scheme, used by Llama 3, Qwen and our tiny-chat) decodes a
  sequence by joining its tokens' bytes, so its tokens are decoded from a table of those bytes (and
  of their texts); any other tokenizer goes through the library's DecodeStream;
- text that could still become a stop string is held back; when a stop string appears the text
  before it is released and the stream is over (the stop string itself never reaches the client).
"""

from __future__ import annotations

import datetime
import functools
import json
from codecs import utf_8_decode as _utf8_decode
from collections.abc import Sequence
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel, DecodeStream


class TemplateError(ValueError):
    pass


def _raise(message: str):
    raise TemplateError(message)


class ModelTokenizer:
    def __init__(self, tokenizer: Tokenizer, config: dict, source: Path):
        self.tokenizer = tokenizer
        self.source = source
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.image_token = config.get("image_token") or None
        # The environment Hugging Face's apply_chat_template renders in (transformers' chat_template_utils), so
        # that a model's template behaves here as it was written: an undefined name is falsy (`{% if tools %}`,
        # `message.tool_calls`), loop controls, `tojson` without ASCII escapes, `strftime_now`.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        self._template = env.from_string(template) if template else None
        if self._template is not None:
            # The same globals as a plain dict instead of jinja's ChainMap over the environment's: every
            # render lists a template's globals (Context.globals_keys), and a ChainMap lists itself slowly.
            self._template.globals = dict(self._template.globals)
        # What every render passes besides the messages, merged with the template's globals once: render()
        # merges its chain of globals into a new dict on every call, half of a short chat's render.
        self._render_vars = ({**self._template.globals, "add_generation_prompt": True, "tools": None,
                              "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
                             if self._template is not None else {})
        self.takes_content_parts = _iterates_message_content(env.parse(template)) if template else False
        self.token_bytes = _byte_level_token_bytes(tokenizer)
        # each token's text when its bytes are whole characters on their own (most are), else None
        self.token_texts = None if self.token_bytes is None else tuple(_whole_text(raw) for raw in self.token_bytes)

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelTokenizer:
        model_dir = Path(model_dir)
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        processor_path = model_dir / "processor_config.json"
        if not config.get("image_token") and processor_path.exists():
            config["image_token"] = json.loads(processor_path.read_text()).get("image_token")
        return cls(tokenizer, config, model_dir)

    @property
    def image_token_id(self) -> int | None:
        return self.tokenizer.token_to_id(self.image_token) if self.image_token else None

    def render_chat(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                    variables: dict | None = None) -> str:
        """`messages`: {"role", "content"} with content a string or a list of text/image parts (and, as Hugging
        Face templates read them, an assistant's `tool_calls`, a tool message's `tool_call_id`). `tools`: the
        function tools offered, {"type": "function", "function": {...}} each, or None. `variables`: more template
        variables (a request's chat_template_kwargs); they cannot replace the messages or the tools."""
        if self._template is None:
            raise TemplateError(f"{self.source}/tokenizer_config.json has no chat_template")
        if not self.takes_content_parts:
            messages = [{**m, "content": self._flatten(m["content"])} for m in messages]
        template = self._template
        extra = {**variables} if variables else {}
        if tools is not None:
            extra["tools"] = list(tools)
        try:  # Template.render's own two steps, with the variables above shared instead of merged again
            context = template.new_context({**self._render_vars, **extra, "messages": list(messages)}, shared=True)
            return template.environment.concat(template.root_render_func(context))
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc

    def _flatten(self, content) -> str:
        if isinstance(content, str):
            return content
        pieces = []
        for part in content:
            if part["type"] == "image":
                if self.image_token is None:
                    raise TemplateError(
                        f"the model at {self.source} cannot take images: its chat template does not take content "
                        "parts and neither tokenizer_config.json nor processor_config.json names an image_token")
                pieces.append(self.image_token)
            else:
                pieces.append(part["text"])
        return "\n".join(pieces)  # as OpenAI-compatible servers join parts

    @functools.cached_property
    def special_texts(self) -> dict[int, str]:
        """Each special token's text, by id, but the EOS token's (what ends an answer is never its text)."""
        return {token_id: token.content for token_id, token in self.tokenizer.get_added_tokens_decoder().items()
                if token.special and token_id != self.eos_id}

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for (a text of B bytes has at least B / this many tokens)."""
        sizes = (len(self.tokenizer.decode([i], skip_special_tokens=False).encode("utf-8", "replace"))
                 for i in range(self.tokenizer.get_vocab_size()))
        return max(max(sizes, default=1), 1)

    def min_tokens(self, text: str) -> int:
        """A lower bound on the token count of `text`, in O(length) and without tokenizing."""
        return len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes

    def encode(self, text: str) -> list[int]:
        # The batch call without offsets: a third less CPU than encode(), which also maps every token's
        # character offsets; a batch of one runs on the calling thread.
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Hugging Face's `tojson`: jinja's own escapes HTML characters and writes ASCII only, which changes the
    # prompt a model was trained on.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _byte_level_token_bytes(tokenizer: Tokenizer) -> tuple[bytes, ...] | None:
    """Each token id's bytes (b"" for a special token or an unused id) when decoding joins them, else None.

    That holds when the decoder is exactly ByteLevel: it maps each character of a token back to the byte
    it stands for (a token with a character outside the map stands for its own UTF-8), joins them and
    decodes the whole as UTF-8 with U+FFFD for what is broken. The table is checked against the
    library's decode of the whole vocabulary, so a tokenizer that decodes otherwise keeps the general path.
    """
    if type(tokenizer.decoder) is not ByteLevel:
        return None
    byte_of = _byte_level_alphabet()
    special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    table = [b""] * (max(vocab.values(), default=-1) + 1)
    for token, token_id in vocab.items():
        if token_id not in special:
            try:
                table[token_id] = bytes([byte_of[char] for char in token])
            except KeyError:
                table[token_id] = token.encode()
    # One decode of the whole vocabulary checks every entry and the joining (decode_batch would start the
    # library's thread pool in every process that loads a tokenizer).
    every_token = tokenizer.decode(list(range(len(table))), skip_special_tokens=True)
    if every_token != b"".join(table).decode("utf-8", "replace"):
        return None
    return tuple(table)


def _whole_text(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other bytes for
    the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(0x100 + n): b for n, b in enumerate(others)}}


def _iterates_message_content(template: nodes.Template) -> bool:
    """Whether the template loops over a message's content (`message['content']` / `message.content`),
    which is how templates that take structured content parts are written."""
    for loop in template.find_all(nodes.For):
        target = loop.iter
        if isinstance(target, nodes.Getitem) and isinstance(target.arg, nodes.Const) and target.arg.value == "content":
            return True
        if isinstance(target, nodes.Getattr) and target.attr == "content":
            return True
    return False


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class IncrementalDetokenizer:
    """Token ids in, releasable text out: UTF-8 safe, spaces as in a full decode, stop strings held back.

    A byte-level tokenizer's token is its text from a table when its bytes are whole characters and no
    character is unfinished (about 0.3 us a token); otherwise its bytes go through UTF-8 decoding, which
    holds back an unfinished character's bytes. Any other tokenizer goes through the tokenizers library's
    DecodeStream (Rust; about 1 us a token, and two to three times that under load), which yields text only
    once a token completes a character and keeps the context that spaces and byte fallback need.
    """

    def __init__(self, tokenizer: ModelTokenizer, stop: Sequence[str] = (), *, keep_special: bool = False):
        """`keep_special`: special tokens are text too (but EOS), for output parsers whose markers are special
        tokens (Llama's <|python_tag|>, Mistral's [TOOL_CALLS], gpt-oss's channels): vLLM's skip_special_tokens
        false."""
        self._tokenizer = tokenizer
        self._token_texts = tokenizer.token_texts
        # special token id -> its text, kept in the output (None: special tokens are skipped, the default)
        self._specials = tokenizer.special_texts if keep_special else None
        if self._token_texts is None:
            self._stream = DecodeStream(skip_special_tokens=not keep_special)
            self._pending: list[int] = []  # ids the stream has not turned into text yet (a partial character)
        self._unfinished = b""  # byte-level: the bytes of a character still missing some
        self._held = ""  # decoded text not handed out yet: it may be the start of a stop string
        self._stops = tuple([s for s in stop if s]) if stop else ()
        self.stopped_on: str | None = None

    def add(self, ids: Sequence[int]) -> str:
        """Feed new token ids; returns the text that may be released now (maybe "")."""
        if self.stopped_on is not None:
            return ""
        texts = self._token_texts
        if texts is None:
            return self._add_through_stream(ids)
        new = None
        if self._specials is not None and not self._specials.keys().isdisjoint(ids):
            new = self._add_keeping_specials(ids, self._specials)
        elif len(ids) == 1 and not self._unfinished and ids[0] < len(texts):
            new = texts[ids[0]]
        if new is None:
            new = self._add_bytes(ids)
        if not new:
            return ""
        if not self._stops:  # nothing to look for: the text goes out as it comes
            return new
        self._held += new
        return self._release(final=False)

    def _add_bytes(self, ids: Sequence[int]) -> str:
        # set whenever token texts are; an id past the vocabulary stands for nothing, as in the library
        table = self._tokenizer.token_bytes or ()
        raw = self._unfinished + b"".join([table[token] for token in ids if token < len(table)])
        text, used = _utf8_decode(raw, "replace", False)  # stops before an unfinished character
        self._unfinished = raw[used:]
        return text

    def _add_keeping_specials(self, ids: Sequence[int], specials: dict[int, str]) -> str:
        pieces, run = [], []
        for token in ids:
            special = specials.get(token)
            if special is None:
                run.append(token)
                continue
            if run:
                pieces.append(self._add_bytes(run))
                run = []
            pieces.append(special)
        if run:
            pieces.append(self._add_bytes(run))
        return "".join(pieces)

    def _add_through_stream(self, ids: Sequence[int]) -> str:
        step, tokenizer, grew = self._stream.step, self._tokenizer.tokenizer, False
        for token in ids:
            piece = step(tokenizer, token)
            if piece:
                self._held += piece
                self._pending.clear()
                grew = True
            else:
                self._pending.append(token)
        return self._release(final=False) if grew else ""

    def finish(self) -> str:
        """The stream ended: release whatever is held (a partial stop string is just text)."""
        if self.stopped_on is None and self._unfinished:
            self._held += self._unfinished.decode("utf-8", "replace")  # an unfinished character, as U+FFFD
            self._unfinished = b""
        if self.stopped_on is None and self._token_texts is None and self._pending:
            self._held += self._tokenizer.decode(self._pending)  # an unfinished character, as U+FFFD
            self._pending.clear()
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        """What of the held text may go out. A stop string never starts in text already out: any end of the
        text that could begin one is held."""
        if self.stopped_on is not None:
            return ""
        text = self._held
        if self._stops:
            best: tuple[int, str] | None = None
            for stop in self._stops:
                at = text.find(stop)
                if at != -1 and (best is None or at < best[0]):
                    best = (at, stop)
            if best is not None:
                self._held = ""
                self.stopped_on = best[1]
                return text[: best[0]]
            if not final:
                limit = len(text) - self._longest_stop_prefix_suffix(text)
                self._held = text[limit:]
                return text[:limit]
        self._held = ""
        return text

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
