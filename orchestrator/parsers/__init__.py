"""Incremental parsers of model output into content, reasoning and tool calls: pure, I/O-free, a leaf package.

    spec = parsers.resolve(tool_call_parser="qwen3", reasoning_parser="qwen3")   # once, from ModelInfo or config
    parser = spec.new(seed=request_id, tools=request_tools)                      # per request: it owns the state
    for text in detokenized_pieces:                                              # prefill's first token, decode...
        delta = parser.feed(text)        # Delta(content, reasoning, tool_calls=(ToolCallDelta, ...))
    delta = parser.finish()              # flushes held-back partial tags and an unfinished call

The parser keeps its state in itself and reads only text, so one object spans the prefill leg's first token, the
decode leg and a migration; any split of the same text gives the same concatenated output (tests hold each family
to it with hypothesis). `Collector` adds deltas up into the non-streamed `Message` (content, reasoning_content,
tool_calls): the collected view is the stream's concatenation by construction.

Arguments: for the families whose calls are JSON, the arguments string is the model's own JSON text, streamed as
it comes once the call's name is known (nothing is ever taken back; a call whose `arguments` key precedes its
`name` is read whole and written with json.dumps(ensure_ascii=False)). The families whose arguments are not JSON
(Qwen3-Coder's and GLM's XML) build the string with json.dumps(ensure_ascii=False), one parameter at a time as
each closes. A call cut off by the end of the stream keeps the arguments it streamed (as OpenAI does with
`finish_reason: "length"`). Text that opens like a call but is not one (no name, not JSON) goes out as content:
never lost.

Libraries: `partial-json-parser` was considered for incremental arguments; it is not used. It answers "what value
does this prefix stand for", which needs re-serialising on every delta and can change its answer as text arrives
(a number or a literal still growing), where streaming needs "which prefix of the text is final". Raw streaming
with a bracket-and-string scanner (text.JsonValueEnd) gives that at no re-parsing cost, and json.loads checks a
call whose keys come out of order once it is whole. gpt-oss goes through `openai-harmony`'s StreamableParser
(parsers/harmony.py).
"""

from orchestrator.parsers.combined import ChatParser, PassThrough, StreamParser
from orchestrator.parsers.events import CallIds, Collector, Delta, Message, ToolCall, ToolCallDelta
from orchestrator.parsers.registry import (
    ParserSpec,
    UnknownParserError,
    reasoning_parser_names,
    resolve,
    tool_parser_names,
)

__all__ = [
    "CallIds", "ChatParser", "Collector", "Delta", "Message", "ParserSpec", "PassThrough", "StreamParser",
    "ToolCall", "ToolCallDelta", "UnknownParserError", "reasoning_parser_names", "resolve", "tool_parser_names",
]


def parse_whole(parser: StreamParser, text: str) -> Message:
    """The collected view of a non-streamed answer: the whole text fed at once."""
    collector = Collector()
    collector.add(parser.feed(text))
    collector.add(parser.finish())
    return collector.message()


__all__.append("parse_whole")
