"""A valid instance of a JSON schema, drawn from a seeded random generator. Pure: no I/O.

The simulated model answers a tool call or a JSON-schema guide with arguments that validate, as guided decoding
(or a well-behaved model) would. It covers what tool parameter schemas and response formats use: `type` (one or
a list), `enum`, `const`, objects (`properties`, `required`, `additionalProperties`, min/maxProperties), arrays
(`items`, `prefixItems`, min/maxItems, uniqueItems), numbers (minimum, maximum, exclusive bounds, multipleOf),
strings (min/maxLength, a few `format`s), `anyOf` / `oneOf` (one branch), `allOf` (merged), and local `$ref`s
(`#/$defs/...`, `#/definitions/...`). A `pattern` is not matched: the sim is not a regex engine (documented in
docs/simulator.md). Optional properties are included with probability 1/2, so both shapes occur.
"""

from __future__ import annotations

import random
import string
from typing import Any

_WORDS = ("alpha", "bravo", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "iris", "juniper", "kestrel",
          "lumen", "meadow", "nimbus", "orchid", "pebble", "quartz", "river", "sierra", "tundra", "umber", "violet",
          "willow", "yarrow", "zephyr", "Paris", "Tokyo", "Lagos", "Lima", "Oslo")
_FORMATS = {"date": lambda r: f"20{r.randint(10, 30)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
            "date-time": lambda r: f"20{r.randint(10, 30)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"
                                   f"T{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:00Z",
            "time": lambda r: f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:00",
            "email": lambda r: f"{r.choice(_WORDS).lower()}@example.com",
            "uri": lambda r: f"https://example.com/{r.choice(_WORDS).lower()}",
            "uuid": lambda r: f"{r.getrandbits(32):08x}-{r.getrandbits(16):04x}-4{r.getrandbits(12):03x}-"
                              f"8{r.getrandbits(12):03x}-{r.getrandbits(48):012x}",
            "ipv4": lambda r: ".".join(str(r.randint(1, 254)) for _ in range(4))}
_MAX_DEPTH = 8


class SchemaError(ValueError):
    """A schema the generator cannot satisfy (e.g. an empty enum, min above max, a dangling $ref)."""


def instance(schema: Any, rng: random.Random) -> Any:
    """A value valid under `schema` (a JSON schema as parsed JSON; True / {} admit anything)."""
    return _Generator(schema if isinstance(schema, dict) else {}, rng).value(schema, 0)


class _Generator:
    def __init__(self, root: dict, rng: random.Random):
        self.root, self.rng = root, rng

    def resolve(self, schema: dict) -> dict:
        seen = 0
        while "$ref" in schema:
            ref = schema["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#"):
                raise SchemaError(f"only local $ref is supported, got {ref!r}")
            target: Any = self.root
            for part in [p for p in ref[1:].split("/") if p]:
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(target, dict) or part not in target:
                    raise SchemaError(f"$ref {ref!r} does not resolve")
                target = target[part]
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**target, **rest} if isinstance(target, dict) else rest
            seen += 1
            if seen > 32:
                raise SchemaError(f"$ref {ref!r} is circular")
        return schema

    def value(self, schema: Any, depth: int) -> Any:
        if schema is True or schema == {} or not isinstance(schema, dict):
            return self.any_value(depth)
        schema = self.resolve(schema)
        if "allOf" in schema:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                merged = _merge(merged, self.resolve(part) if isinstance(part, dict) else {})
            schema = merged
        for key in ("anyOf", "oneOf"):
            if schema.get(key):
                branch = self.rng.choice(schema[key])
                rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
                return self.value(_merge(rest, self.resolve(branch) if isinstance(branch, dict) else {}), depth)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            if not schema["enum"]:
                raise SchemaError("enum is empty")
            return self.rng.choice(schema["enum"])
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = self.rng.choice([k for k in kind if k != "null"] or kind) if kind else None
        if kind is None:
            kind = _infer_type(schema)
        if kind is None:
            return self.any_value(depth)
        make = getattr(self, "make_" + str(kind), None)
        if make is None:
            raise SchemaError(f"unknown type {kind!r}")
        return make(schema, depth)

    def any_value(self, depth: int) -> Any:
        return self.rng.choice(_WORDS) if depth > 1 else self.make_object({"type": "object"}, depth)

    def make_null(self, schema: dict, depth: int) -> None:
        return None

    def make_boolean(self, schema: dict, depth: int) -> bool:
        return self.rng.random() < 0.5

    def make_integer(self, schema: dict, depth: int) -> int:
        low, high = _bounds(schema, integer=True)
        step = schema.get("multipleOf")
        if isinstance(step, int) and step > 0:
            first, last = -(-low // step), high // step
            if first > last:
                raise SchemaError(f"no multiple of {step} between {low} and {high}")
            return self.rng.randint(first, last) * step
        return self.rng.randint(low, high)

    def make_number(self, schema: dict, depth: int) -> float | int:
        if isinstance(schema.get("multipleOf"), int):
            return self.make_integer(schema, depth)
        low, high = _bounds(schema, integer=False)
        value = round(self.rng.uniform(low, high), 2)
        exclusive_low, exclusive_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if (not low <= value <= high or (isinstance(exclusive_low, (int, float)) and value <= exclusive_low)
                or (isinstance(exclusive_high, (int, float)) and value >= exclusive_high)):
            value = (low + high) / 2
        return value

    def make_string(self, schema: dict, depth: int) -> str:
        fmt = schema.get("format")
        if fmt in _FORMATS:
            return _FORMATS[fmt](self.rng)
        low = int(schema.get("minLength", 0))
        high = int(schema.get("maxLength", max(low, 24)))
        if low > high:
            raise SchemaError(f"minLength {low} above maxLength {high}")
        words: list[str] = []
        target = self.rng.randint(max(low, min(high, 3)), max(low, min(high, 24)))
        while len(" ".join(words)) < target:
            words.append(self.rng.choice(_WORDS))
        text = " ".join(words)[:high]
        while len(text) < low:
            text += self.rng.choice(string.ascii_lowercase)
        return text.rstrip() if len(text.rstrip()) >= low else text

    def make_array(self, schema: dict, depth: int) -> list:
        prefix = schema.get("prefixItems") or []
        low = int(schema.get("minItems", 0))
        high = int(schema.get("maxItems", max(low, len(prefix), 3)))
        if low > high:
            raise SchemaError(f"minItems {low} above maxItems {high}")
        fewest = max(low, min(len(prefix), high))
        count = self.rng.randint(fewest, max(fewest, min(high, 3)))
        items = schema.get("items", {}) if depth < _MAX_DEPTH else {"type": "string"}
        result: list = []
        attempts = 0
        while len(result) < count:
            index = len(result)
            item_schema = prefix[index] if index < len(prefix) else items
            item = self.value(item_schema, depth + 1)
            attempts += 1
            if schema.get("uniqueItems") and item in result and attempts < 64:
                continue
            result.append(item)
        return result

    def make_object(self, schema: dict, depth: int) -> dict:
        properties = schema.get("properties") or {}
        required = [name for name in schema.get("required") or [] if isinstance(name, str)]
        chosen = [name for name in properties if name in required or
                  (depth < _MAX_DEPTH and self.rng.random() < 0.5)]
        result = {}
        for name in chosen:
            result[name] = self.value(properties[name], depth + 1)
        for name in required:  # required names without a property schema: anything allowed there
            if name not in result:
                extra = schema.get("additionalProperties", True)
                result[name] = self.value(extra if isinstance(extra, dict) else {"type": "string"}, depth + 1)
        low = int(schema.get("minProperties", 0))
        extra = schema.get("additionalProperties", True)
        serial = 0
        while len(result) < low and extra is not False:
            serial += 1
            name = f"{self.rng.choice(_WORDS).lower()}_{serial}"
            if name not in properties:
                result[name] = self.value(extra if isinstance(extra, dict) else {"type": "string"}, depth + 1)
        return result


def _infer_type(schema: dict) -> str | None:
    if "properties" in schema or "required" in schema or "additionalProperties" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema or "minItems" in schema:
        return "array"
    if "minLength" in schema or "maxLength" in schema or "format" in schema or "pattern" in schema:
        return "string"
    if "minimum" in schema or "maximum" in schema or "multipleOf" in schema:
        return "number"
    return None


def _bounds(schema: dict, *, integer: bool) -> tuple:
    low: Any = schema.get("minimum")
    high: Any = schema.get("maximum")
    exclusive_low, exclusive_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if isinstance(exclusive_low, bool):  # draft 4: a flag on minimum
        exclusive_low = low if exclusive_low else None
    if isinstance(exclusive_high, bool):
        exclusive_high = high if exclusive_high else None
    step = 1 if integer else 0.01
    if isinstance(exclusive_low, (int, float)):
        low = exclusive_low + step if low is None else max(low, exclusive_low + step)
    if isinstance(exclusive_high, (int, float)):
        high = exclusive_high - step if high is None else min(high, exclusive_high - step)
    if low is None and high is None:
        low, high = (0, 100)
    elif low is None:
        low = high - 100
    elif high is None:
        high = low + 100
    if integer:
        low, high = -(-low // 1), high // 1
        low, high = int(low), int(high)
    if low > high:
        raise SchemaError(f"minimum {low} above maximum {high}")
    return low, high


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        if key == "properties" and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        elif key == "required" and isinstance(merged.get(key), list):
            merged[key] = list(dict.fromkeys([*merged[key], *value]))
        else:
            merged[key] = value
    return merged
