"""The request body as JSON (frontend/app.py `read_json`): what is not valid Unicode text is a 400 naming the
field, however the JSON spells it."""

import pytest

from orchestrator.frontend.app import read_json
from orchestrator.frontend.errors import ApiError


def receiving(raw: bytes):
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive():
        return messages.pop(0)

    return receive


SURROGATE_BYTES = b"\xed\xa0\x80"  # U+D800 written as if it were a character: no valid UTF-8 holds it


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"model": "m", "messages": [{"role": "user", "content": "a' + SURROGATE_BYTES + b'b"}]}',
     "messages[0].content"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    (b'{"model": "m", "prompt": "x", "stop": ["ok", "' + SURROGATE_BYTES + b'"]}', "stop[1]"),
    (b'{"model": "m", "prompt": "' + SURROGATE_BYTES + b'"}', "prompt"),
    (b'{"model": "m", "prompt": "\\udfff"}', "prompt"),
    ('{"model": "m", "prompt": "\ud800"}'.encode("utf-16-le", "surrogatepass"), "prompt"),
])
async def test_a_lone_surrogate_in_any_spelling_is_a_400_naming_the_field(raw, param):
    with pytest.raises(ApiError) as refused:
        await read_json(receiving(raw), 1 << 20)
    assert refused.value.status == 400 and refused.value.param == param
    assert "surrogate" in str(refused.value)


async def test_a_surrogate_pair_is_one_character_and_accepted():
    body = await read_json(receiving(b'{"prompt": "\\ud83d\\ude00 \xf0\x9f\x98\x80"}'), 1 << 20)
    assert body == {"prompt": "\U0001F600 \U0001F600"}
