"""Property: every bad request gets a 4xx in the OpenAI error format, never a 5xx, and the server keeps serving.

Hypothesis generates 2,400 requests per run (1,200 on each route), each invalid by construction: a valid
body with one field replaced by a value of the wrong type or out of its range, or a body that is not a
JSON object at all (broken bytes, deep nesting, lone surrogates, 5,000-digit numbers). They go over
HTTP to a real `orchestrator serve` in front of a real simulated worker.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_helpers import Deployment, chat_body

UINT32 = 2**32
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                         st.text(max_size=20))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
NOT_INT = st.one_of(st.text(max_size=5), st.floats(allow_nan=False), st.lists(st.integers(), max_size=2),
                    st.booleans(), st.dictionaries(st.text(max_size=3), st.integers(), max_size=1))
NOT_NUMBER = st.one_of(st.text(max_size=5), st.lists(st.integers(), max_size=2), st.booleans())
HUGE = st.one_of(st.integers(UINT32, 2**200), st.integers(-(2**200), -(2**31) - 1))

# One invalid value per field: (field, strategy). Each drawn value is wrong for that field.
BAD_FIELDS = [
    ("model", st.one_of(st.just(""), NOT_NUMBER.filter(lambda v: not isinstance(v, str)), st.just("no-such-model"))),
    ("max_tokens", st.one_of(st.integers(max_value=0), st.integers(min_value=UINT32), NOT_INT)),
    ("min_tokens", st.one_of(st.integers(max_value=-1), st.integers(min_value=UINT32), NOT_INT)),
    ("temperature", st.one_of(st.floats(max_value=-0.01), st.floats(min_value=2.01, allow_infinity=False),
                              NOT_NUMBER)),
    ("top_p", st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.01, allow_infinity=False), NOT_NUMBER)),
    ("top_k", st.one_of(st.integers(max_value=-2), st.integers(min_value=2**31), NOT_INT)),
    ("seed", st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64), NOT_INT)),
    ("stop", st.one_of(st.integers(), st.lists(st.integers(), min_size=1, max_size=3), st.just([""]),
                       st.lists(st.just("x"), min_size=17, max_size=20), st.just(["\ud800"]))),
    ("stop_token_ids", st.one_of(st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
                                 st.lists(st.integers(min_value=UINT32), min_size=1, max_size=3), st.text(min_size=1))),
    ("n", st.one_of(st.integers(max_value=0), st.integers(min_value=17, max_value=2**80))),
    ("presence_penalty", st.one_of(st.floats(min_value=2.01, allow_infinity=False), NOT_NUMBER)),
    ("stream", st.one_of(st.integers(), st.text(min_size=1))),
    ("stream_options", st.just({"include_usage": True})),  # only allowed with stream: true
    ("conversation_id", st.one_of(st.just(""), st.integers(), st.text(min_size=257, max_size=300))),
]
CHAT_ONLY = [
    ("messages", st.one_of(st.just([]), JSON_SCALARS, st.lists(JSON_SCALARS, min_size=1, max_size=3),
                           st.just([{"role": "wizard", "content": "hi"}]),
                           st.just([{"role": "user", "content": 5}]),
                           st.just([{"role": "user", "content": [{"type": "video", "url": "x"}]}]),
                           st.just([{"role": "user", "content": "\udfff"}]),
                           st.just([{"role": "user", "content": [{"type": "image_url", "image_url": {
                               "url": "file:///etc/passwd"}}]}]),
                           st.just([{"role": "user", "content": [{"type": "image_url", "image_url": {
                               "url": "https://a.example/" + "x" * 100_000}}]}]),
                           st.just([{"role": "assistant", "content": [{"type": "image_url", "image_url": {
                               "url": "https://a.example/1.png"}}]}]))),
    ("response_format", st.one_of(st.just({"type": "xml"}), st.integers(), st.just({"type": "json_schema"}))),
    ("top_logprobs", st.one_of(st.integers(min_value=21), st.just(3))),  # 3: logprobs not asked for
    ("multi_modal_uuids", st.one_of(st.just(["a"]), st.integers())),  # the request has no images
]
COMPLETION_ONLY = [
    ("prompt", st.one_of(st.just(""), st.just([]), st.integers(), st.just(["a", "b"]), st.just([1, "x"]),
                         st.lists(st.integers(min_value=UINT32), min_size=1, max_size=2), st.just("\ud83d"))),
    ("echo", st.just(True)),
]


def broken_bodies() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=40).filter(lambda b: not _is_json_object(b)),
        st.builds(lambda depth: ("[" * depth + "]" * depth).encode(), st.integers(5_000, 20_000)),
        st.builds(lambda n: ('{"model": "tiny-chat", "max_tokens": ' + "9" * n + "}").encode(),
                  st.integers(4_400, 6_000)),
        JSON_VALUES.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode()),
        st.just(b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "\\ud800"}]}'),
        st.just(b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'),
        st.just(b""),
    )


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except (ValueError, RecursionError):
        return False


def mutated(base: dict, fields) -> st.SearchStrategy[bytes]:
    def apply(choice):
        (name, _), value = choice
        body = dict(base)
        if name == "stream_options":
            body.pop("stream", None)
        if name == "top_logprobs" and value == 3:
            body.pop("logprobs", None)
        body[name] = value
        return json.dumps(body).encode()

    return st.sampled_from(fields).flatmap(lambda field: st.tuples(st.just(field), field[1])).map(apply)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    deployment = Deployment(tmp_path_factory.mktemp("fuzz"), "aggregated", {"aggregated": [("--time-scale", "0")]})
    yield deployment
    deployment.close()


def check(client: httpx.Client, path: str, raw: bytes) -> None:
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, (response.status_code, raw[:200], response.text[:300])
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert len(response.content) < 4096  # an error never echoes a huge input back


SETTINGS = settings(max_examples=1200, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_requests_are_4xx_in_the_openai_format_and_the_server_keeps_serving(server, path):
    chat = path == "/v1/chat/completions"
    base = chat_body(max_tokens=2) if chat else {"model": "tiny-chat", "prompt": "hi", "max_tokens": 2}
    fields = BAD_FIELDS + (CHAT_ONLY if chat else COMPLETION_ONLY)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        @SETTINGS
        @given(st.one_of(mutated(base, fields), broken_bodies()))
        def property_(raw):
            check(client, path, raw)

        property_()
        normal = client.post(path, json=base)
    assert normal.status_code == 200, normal.text
