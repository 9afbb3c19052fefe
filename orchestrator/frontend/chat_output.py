"""Which output parser reads a chat answer: the one its workers advertise, or the configured one.

The engine does not parse its own output: a worker says which parsers its model needs
(`ModelInfo.tool_call_parser`, `reasoning_parser`: TensorRT-LLM's names), the config may override them
(`model.tool_call_parser`, `model.reasoning_parser`), and the frontend reads the answer with them. The parser
belongs to the request, not to a leg: it reads the prefill leg's first token, the decode leg and any
migration's continuation as one text.

A name a worker advertises that we do not have is logged once and read as no parser (the answer's text goes
out as content): one worker's newer parser never fails requests, and the config's override names ours.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from orchestrator.convert import ApiRequest
from orchestrator.convert.tools import ToolChoiceMode
from orchestrator.engine.capabilities import WorkerCapabilities
from orchestrator.parsers import ParserSpec, PassThrough, StreamParser, UnknownParserError, resolve
from orchestrator.parsers.events import CallIds
from orchestrator.parsers.guided import NamedCall, RequiredCalls
from orchestrator.parsers.harmony import load_encoding

log = logging.getLogger(__name__)

NO_PARSERS = ParserSpec()


class OutputParsers:
    """The parser pair of each advertised (tool, reasoning) name pair, resolved once."""

    def __init__(self, tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> None:
        # the config's override (validated when the config was loaded); None: what the workers advertise
        self._configured = (tool_call_parser, reasoning_parser)
        self._specs: dict[tuple[str | None, str | None], ParserSpec] = {}
        self._harmony: object = None  # gpt-oss's encoding, read once when a gpt-oss answer first needs it
        self._harmony_failed = False

    def spec(self, caps: Sequence[WorkerCapabilities]) -> ParserSpec:
        """The parsers of a planned request's workers: the first name any of them advertises of each kind (they
        serve one model), each replaced by the config's when it sets one."""
        tool = self._configured[0] or next((c.tool_call_parser for c in caps if c.tool_call_parser), None)
        reasoning = self._configured[1] or next((c.reasoning_parser for c in caps if c.reasoning_parser), None)
        key = (tool, reasoning)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = self._resolve(tool, reasoning)
        return spec

    @staticmethod
    def _resolve(tool: str | None, reasoning: str | None) -> ParserSpec:
        try:
            tool_spec = resolve(tool_call_parser=tool)
        except UnknownParserError as exc:
            log.warning("a worker advertises a tool-call parser this orchestrator does not have: %s; its tool calls "
                        "reach clients as text (set model.tool_call_parser to one we have)", exc)
            tool_spec = NO_PARSERS
        try:
            reasoning_spec = resolve(reasoning_parser=reasoning)
        except UnknownParserError as exc:
            log.warning("a worker advertises a reasoning parser this orchestrator does not have: %s; its reasoning "
                        "reaches clients as content (set model.reasoning_parser to one we have)", exc)
            reasoning_spec = NO_PARSERS
        return ParserSpec(tool_call_parser=tool_spec.tool_call_parser,
                          reasoning_parser=reasoning_spec.reasoning_parser)

    def keep_special_tokens(self, api: ApiRequest, caps: Sequence[WorkerCapabilities]) -> bool:
        """Whether a chat answer's text must keep special tokens: its parsers' markers are special tokens."""
        return api.kind == "chat" and self.spec(caps).needs_special_tokens

    def for_request(self, api: ApiRequest, request_id: str,
                    caps: Sequence[WorkerCapabilities]) -> StreamParser | None:
        """The parser of one chat answer, or None when its text goes out as it is (completions, or a model with
        no parser that applies): the hot path then has no parser at all."""
        if api.kind != "chat":
            return None
        use = api.tool_use
        ids = CallIds(request_id)
        if use.choice.mode is ToolChoiceMode.NAMED and use.choice.name is not None:
            return NamedCall(use.choice.name, ids)
        if use.choice.mode is ToolChoiceMode.REQUIRED:
            return RequiredCalls(ids)
        spec = self.spec(caps)
        harmony = None
        if spec.harmony:
            harmony = self._harmony_encoding()
            if harmony is None:
                return None
        parser = spec.new(seed=request_id, tools=use.template_tools(), tool_calls=use.offered,
                          chat_template_kwargs=json.loads(api.template_kwargs) if api.template_kwargs else None,
                          harmony_encoding=harmony)
        return None if isinstance(parser, PassThrough) else parser

    def _harmony_encoding(self) -> object:
        """gpt-oss's harmony encoding, or None when it cannot be read (openai-harmony reads its vocabulary from
        TIKTOKEN_ENCODINGS_BASE, else downloads it): logged once, and gpt-oss answers go out as text."""
        if self._harmony is None and not self._harmony_failed:
            try:
                self._harmony = load_encoding()
            except Exception as exc:  # noqa: BLE001  # any failure of the library's loading: say it once, go on
                self._harmony_failed = True
                log.warning("gpt-oss output cannot be parsed: openai-harmony could not load its encoding (%s); set "
                            "TIKTOKEN_ENCODINGS_BASE to a directory holding its vocabulary", exc)
        return self._harmony
