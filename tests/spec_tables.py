"""Parse the field tables of the OpenEngine v1 spec (docs/openengine-v1.md) into plain data.

The spec lists every message as `message `Name`: type name=N; optional type name=N (oneof x); ...`
and every enum as `enum `Name`: A=0, B=1`. docs/openengine-additions.md uses the same lines, plus
`fields `Name`: ...` for fields a later branch appends to a v0.1.0 message. The wire test compares
the merged tables with the descriptors compiled from our proto/ files, so a drift fails CI.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENDORED_SPEC = REPO / "docs" / "openengine-v1.md"
SHARED_SPEC = REPO.parent / "shared" / "spec" / "openengine-v1.md"
ADDITIONS = REPO / "docs" / "openengine-additions.md"


@dataclass(frozen=True)
class SpecField:
    name: str
    number: int
    type: str  # scalar name, message or enum name, or "Struct"
    repeated: bool
    optional: bool
    oneof: str | None


@dataclass
class SpecFile:
    name: str
    messages: dict[str, list[SpecField]] = field(default_factory=dict)
    enums: dict[str, dict[str, int]] = field(default_factory=dict)
    services: dict[str, list[tuple[str, str, str, bool]]] = field(default_factory=dict)
    appended: dict[str, list[SpecField]] = field(default_factory=dict)  # `fields` lines of the additions


_FIELD = re.compile(
    r"^(?P<repeated>repeated )?(?P<optional>optional )?(?P<type>\w+) (?P<name>\w+)=(?P<number>\d+)"
    r"(?: \(oneof (?P<oneof>\w+)\))?$"
)
_RPC = re.compile(r"^- `(?P<name>\w+)\((?P<req>\w+)\) -> (?P<stream>stream )?(?P<resp>\w+)`$")


def parse_spec(text: str) -> dict[str, SpecFile]:
    files: dict[str, SpecFile] = {}
    current: SpecFile | None = None
    service: str | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("## openengine/v1/"):
            current = files.setdefault(line[3:], SpecFile(line[3:]))
            service = None
        elif current is None:
            continue
        elif line.startswith("enum `"):
            name, body = _match(r"^enum `(\w+)`: (.*)$", line).groups()
            current.enums[name] = {k: int(v) for k, v in (p.split("=") for p in body.split(", "))}
        elif line.startswith(("message `", "fields `")):
            kind, name, body = _match(r"^(message|fields) `(\w+)`: (.*)$", line).groups()
            fields = [] if body == "(empty)" else [_parse_field(part, name) for part in body.split("; ")]
            (current.messages if kind == "message" else current.appended)[name] = fields
        elif line.startswith("service `"):
            service = _match(r"^service `(\w+)`:", line).group(1)
            current.services[service] = []
        elif service and line.startswith("- `"):
            m = _match(_RPC, line)
            current.services[service].append((m["name"], m["req"], m["resp"], bool(m["stream"])))
    return files


def _match(pattern: str | re.Pattern[str], line: str) -> re.Match[str]:
    """`line` matched by `pattern`, which its prefix promised: a line that does not match is a spec typo."""
    m = re.match(pattern, line)
    if m is None:
        raise ValueError(f"unparsed spec line {line!r}")
    return m


def _parse_field(part: str, message: str) -> SpecField:
    m = _FIELD.match(part)
    if m is None:
        raise ValueError(f"unparsed field {part!r} in message {message}")
    return SpecField(name=m["name"], number=int(m["number"]), type=m["type"], repeated=bool(m["repeated"]),
                     optional=bool(m["optional"]), oneof=m["oneof"])


def load_spec() -> dict[str, SpecFile]:
    """The shared spec (v0.1.0) with the additions merged in, fields in number order."""
    files = parse_spec(VENDORED_SPEC.read_text())
    for path, additions in parse_spec(ADDITIONS.read_text()).items():
        target = files[path]
        target.enums.update(additions.enums)
        target.messages.update(additions.messages)
        for name, fields in additions.appended.items():
            target.messages[name] = sorted(target.messages[name] + fields, key=lambda f: f.number)
    return files
