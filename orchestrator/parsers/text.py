"""Small scanning helpers shared by the parsers: a held-back partial marker, and where a JSON value ends."""

from __future__ import annotations

import re


def held_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (and must wait for more text).

    Only the last len(marker) - 1 characters are looked at, with str.find for the marker's first character: no
    regex and no per-character Python loop on the content hot path."""
    start = len(text) - len(marker) + 1
    if start < 0:
        start = 0
    first = marker[0]
    i = text.find(first, start)
    while i != -1:
        if marker.startswith(text[i:]):
            return len(text) - i
        i = text.find(first, i + 1)
    return 0


def held_suffix_any(text: str, markers: tuple[str, ...]) -> int:
    return max(held_suffix(text, marker) for marker in markers)


_JSON_SIGNIFICANT = re.compile(r'["\\{}\[\]]')


class JsonValueEnd:
    """Finds where a JSON object or array that has already been opened closes, fed piece by piece.

    It tracks nesting and strings only (a syntax check is the consumer's json.loads once the value is whole); it
    jumps between the characters that matter with one regex search each, so a long string argument costs little.
    """

    __slots__ = ("depth", "in_string", "escaped")

    def __init__(self, depth: int = 1) -> None:
        self.depth = depth
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> int:
        """The index just past the closing bracket in `text`, or -1 when the value goes on beyond it."""
        i = 0
        if self.escaped:
            if not text:
                return -1
            self.escaped = False
            i = 1
        while True:
            if self.in_string:
                j = text.find('"', i)
                k = text.find("\\", i)
                if k != -1 and (j == -1 or k < j):
                    if k + 1 >= len(text):
                        self.escaped = True
                        return -1
                    i = k + 2
                    continue
                if j == -1:
                    return -1
                self.in_string = False
                i = j + 1
                continue
            match = _JSON_SIGNIFICANT.search(text, i)
            if match is None:
                return -1
            char = match.group()
            i = match.end()
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i
