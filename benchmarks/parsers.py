"""What parsing model output costs per streamed token (orchestrator/parsers/), in-process.

    python benchmarks/parsers.py [--tokens 20000] [--repeats 7] [--instructions]

Each case feeds a request's parser a stream cut into 4-character tokens (about an English token's length) and
prints µs per token: the best of --repeats runs (the least disturbed by other processes on a shared machine;
the spread to the median is printed too). "loop only" is the cost of the measuring loop itself. Cases: no parser
(PassThrough), a parser pair selected on a plain-content answer (the target: under 2 µs per token), and answers
with tool calls in each family's format.

--instructions also counts, under valgrind's callgrind, the instructions per token of the plain-content cases:
each case runs twice, with --tokens and with twice as many, and the difference over the extra tokens is the
count per token (start-up and imports cancel out). The same code on the same input gives the same count whatever
else the machine does, where the timings here swing by 2x between runs on a shared 2-core VM.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from orchestrator import parsers

PLAIN = ("The quick brown fox jumps over the lazy dog, and then it considers what else there is to do on a "
         "quiet afternoon in the country. ")
CALL_ARGS = '{"location": "San Francisco, CA", "unit": "celsius", "days": 3, "details": {"hourly": true}}'
DS = "<\uff5c{}\uff5c>"


def ds(words: str) -> str:
    return DS.format(words.replace(" ", "\u2581"))


def calls_text(family: str) -> str:
    """An answer of some content then two calls, as the family writes them."""
    name = "get_weather"
    if family == "qwen3":
        call = f'<tool_call>\n{{"name": "{name}", "arguments": {CALL_ARGS}}}\n</tool_call>\n'
        return PLAIN + call + call
    if family == "mistral":
        return PLAIN + f"[TOOL_CALLS]{name}[ARGS]{CALL_ARGS}" * 2
    if family == "llama3_json":
        return f'<|python_tag|>{{"name": "{name}", "parameters": {CALL_ARGS}}}; ' * 2
    if family == "deepseek_v31":
        call = f"{ds('tool call begin')}{name}{ds('tool sep')}{CALL_ARGS}{ds('tool call end')}"
        return PLAIN + ds("tool calls begin") + call + call + ds("tool calls end")
    if family == "kimi_k2":
        call = f"<|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>{CALL_ARGS}<|tool_call_end|>"
        return PLAIN + "<|tool_calls_section_begin|>" + call + call + "<|tool_calls_section_end|>"
    if family == "qwen3_coder":
        call = (f"<tool_call>\n<function={name}>\n<parameter=location>\nSan Francisco, CA\n</parameter>\n"
                "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n")
        return PLAIN + call + call
    if family == "glm4":
        call = (f"<tool_call>{name}\n<arg_key>location</arg_key>\n<arg_value>San Francisco, CA</arg_value>\n"
                "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
        return PLAIN + call + call
    raise ValueError(family)


def tokens_of(text: str, count: int) -> list[str]:
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    return (pieces * (count // len(pieces) + 1))[:count]


def answers_of(text: str, count: int) -> list[list[str]]:
    """Whole answers (each parsed by a new request parser) adding up to about `count` tokens."""
    one = tokens_of(text, (len(text) + 3) // 4)
    return [one] * max(1, count // len(one))


def measure(run: Callable[[], int], repeats: int) -> tuple[float, float]:
    """(best, median) µs per token over the repeats."""
    results = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        tokens = run()
        results.append((time.perf_counter_ns() - start) / 1000 / tokens)
    return min(results), statistics.median(results)


def stream_case(spec: parsers.ParserSpec | None, answers: list[list[str]]) -> Callable[[], int]:
    def run() -> int:
        fed = 0
        for answer in answers:
            if spec is None:
                for _ in answer:
                    pass
            else:
                parser = spec.new(seed="bench")
                feed = parser.feed
                for token in answer:
                    feed(token)
                parser.finish()
            fed += len(answer)
        return fed
    return run


PLAIN_CASES: dict[str, tuple[str | None, str | None]] = {
    "no parser (pass-through)": (None, None),
    "qwen3 tools, plain content": ("qwen3", None),
    "qwen3 tools + qwen3 reasoning, plain content": ("qwen3", "qwen3"),
}


LOOP_ONLY = "loop only"


def run_one(label: str, tokens: int) -> None:
    """One plain-content case, once, untimed (what callgrind counts)."""
    spec = None if label == LOOP_ONLY else parsers.resolve(*PLAIN_CASES[label])
    stream_case(spec, [tokens_of(PLAIN * 8, tokens)])()


def callgrind_instructions(label: str, tokens: int) -> int:
    out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
                          __file__, "--only", label, "--tokens", str(tokens)], capture_output=True, text=True,
                         check=True).stderr
    found = re.search(r"Collected : (\d+)", out)
    if found is None:
        raise RuntimeError(f"callgrind printed no total:\n{out}")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--tokens", type=int, default=20_000)
    options.add_argument("--repeats", type=int, default=7)
    options.add_argument("--instructions", action="store_true", help="count instructions under callgrind too")
    options.add_argument("--only", choices=[LOOP_ONLY, *PLAIN_CASES], help=argparse.SUPPRESS)  # callgrind's run
    args = options.parse_args(argv)
    if args.only:
        run_one(args.only, args.tokens)
        return 0
    plain = [tokens_of(PLAIN * 8, args.tokens)]  # one long plain answer
    cases: list[tuple[str, parsers.ParserSpec | None, list[list[str]]]] = [(LOOP_ONLY, None, plain)]
    cases += [(label, parsers.resolve(*names), plain) for label, names in PLAIN_CASES.items()]
    cases.append(("deepseek_v31 tools + deepseek-r1 reasoning, plain content",
                  parsers.resolve("deepseek_v31", "deepseek-r1"), plain))
    for family in ("qwen3", "mistral", "llama3_json", "deepseek_v31", "kimi_k2", "qwen3_coder", "glm4"):
        cases.append((f"{family}: content + 2 calls", parsers.resolve(family), answers_of(calls_text(family),
                                                                                         args.tokens)))
    print(f"python {sys.version.split()[0]}, {args.tokens} tokens a case, best (median) of {args.repeats} runs")
    print(f"{'case':60} {'µs/token':>9} {'median':>8}")
    for label, spec, answers in cases:
        best, median = measure(stream_case(spec, answers), args.repeats)
        print(f"{label:60} {best:9.3f} {median:8.3f}")
    if args.instructions:
        print(f"\ninstructions per token (callgrind, {args.tokens} extra tokens)")
        for label in [LOOP_ONLY, *PLAIN_CASES]:
            extra = callgrind_instructions(label, 2 * args.tokens) - callgrind_instructions(label, args.tokens)
            print(f"{label:60} {extra / args.tokens:9.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
