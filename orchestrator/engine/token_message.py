"""The token ids of a Generate token message, read straight from its serialized protobuf bytes. Pure, no I/O.

Nearly every message of a stream is one token event, and a full protobuf parse plus the field accesses
to reach its ids cost about twice as much as reading them here. Only the shape the workers send is read:

    GenerateResponse: [request_id (1): ASCII, < 128 bytes]  token (3): TokenOutput, < 128 bytes
    TokenOutput:      [output_index (1)]  tokens (2): TokenInfo, one or more  [text (3): ASCII, < 128 bytes]
    TokenInfo:        [token_id (1)]

fields in field-number order, as every protobuf serializer writes them (TensorRT-LLM's servicer sends
output_index, tokens and the delta text; without logprobs a TokenInfo holds only the id). Anything else,
a logprob, a usage, another field order, a long or non-ASCII string, gives None and takes the full parse:
a shape this does not know is read slower, never differently (tests/unit/test_token_message.py holds it to that).
"""

from __future__ import annotations

_MAX_UINT32 = 0xFFFFFFFF


def token_ids(payload: bytes) -> list[int] | None:
    """The ids of a token message in the shape above, or None."""
    event = without_request_id(payload)
    return None if event is None else event_token_ids(event)


def without_request_id(payload: bytes) -> bytes | None:
    """The message's bytes after its request_id (all of them when it has none): the part that says what
    happened, the same in every request for the same token. None when the request_id is not the shape."""
    if not payload or payload[0] != 0x0A:
        return payload
    try:
        end = _ascii_end(payload, 1)
    except IndexError:
        return None
    return payload[end:] if end > 0 else None


def event_token_ids(event: bytes) -> list[int] | None:
    """The ids of a message without its request_id (see `without_request_id`), or None."""
    try:
        return _token_ids(event)
    except IndexError:  # the bytes end inside a field: not the shape
        return None


def _token_ids(payload: bytes) -> list[int] | None:
    size = len(payload)
    if payload[0] != 0x1A or payload[1] > 0x7F or 2 + payload[1] != size:
        return None  # not a token event, or more follows it
    pos = 2
    if payload[pos] == 0x08:  # output_index: read past it
        _, pos = _varint(payload, pos + 1)
        if pos < 0:
            return None
    ids = []
    while pos < size and payload[pos] == 0x12:  # tokens
        length = payload[pos + 1]
        end = pos + 2 + length
        if length == 0:
            ids.append(0)  # an empty TokenInfo: token id 0, which proto3 leaves off the wire
        else:
            if payload[pos + 2] != 0x08 or length > 6 or end > size:
                return None
            value, after = _varint(payload, pos + 3)
            if after != end or value > _MAX_UINT32:
                return None
            ids.append(value)
        pos = end
    if pos < size and payload[pos] == 0x1A:  # text: read past it
        pos = _ascii_end(payload, pos + 1)
    return ids if ids and pos == size else None


def _ascii_end(payload: bytes, at: int) -> int:
    """Where a string whose one-byte length is at `at` ends; -1 for a longer or non-ASCII one (protobuf checks
    UTF-8, which the full parse then does)."""
    length = payload[at]
    end = at + 1 + length
    if length > 0x7F or end > len(payload) or not payload[at + 1:end].isascii():
        return -1
    return end


def _varint(payload: bytes, at: int) -> tuple[int, int]:
    """A varint of at most five bytes at `at`: (value, where it ends), or (0, -1)."""
    value = shift = 0
    for index in range(at, at + 5):
        byte = payload[index]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, index + 1
        shift += 7
    return 0, -1
