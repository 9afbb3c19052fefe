"""Image media rules (pure): ordering, URL / data URI / UUID mixes, and every rejection."""

import base64

import pytest

from orchestrator.convert import MediaLimits, parse_chat
from orchestrator.convert.api import Part
from orchestrator.errors import InvalidRequest

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 32
PNG_URI = "data:image/png;base64," + base64.b64encode(PNG).decode()


def image(url, **extra):
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def body(*messages, **extra):
    return {"model": "m", "messages": list(messages), **extra}


def user(*parts):
    return {"role": "user", "content": list(parts)}


def rejected(request, limits=None) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse_chat(request, limits or MediaLimits())
    return info.value


def test_images_keep_their_order_across_messages_and_parts():
    req = parse_chat(body(
        user({"type": "text", "text": "first"}, image("https://a.example/1.png"), image(PNG_URI, uuid="u2")),
        {"role": "assistant", "content": "ok"},
        user(image("http://b.example/3.jpg"), {"type": "text", "text": "last"}),
    ))
    assert [(i.url, i.data_uri is not None, i.uuid) for i in req.images] == [
        ("https://a.example/1.png", False, None), (None, True, "u2"), ("http://b.example/3.jpg", False, None)]
    assert req.images[1].mime_type == "image/png"
    assert req.messages[0].content == (Part("text", "first"), Part("image"), Part("image"))
    assert [i.where for i in req.images] == ["messages[0].content[1]", "messages[0].content[2]",
                                             "messages[2].content[0]"]


def test_request_level_uuids_are_matched_by_position_and_may_skip_with_null():
    req = parse_chat(body(user(image("https://a.example/1.png"), image(PNG_URI)),
                          multi_modal_uuids=["first", None]))
    assert [i.uuid for i in req.images] == ["first", None]


def test_bare_string_image_url_and_detail_are_accepted():
    req = parse_chat(body(user({"type": "image_url", "image_url": "https://a.example/x.png"},
                               {"type": "image_url", "image_url": {"url": PNG_URI, "detail": "low"}})))
    assert len(req.images) == 2


@pytest.mark.parametrize("url, words", [
    ("file:///etc/passwd", "scheme 'file' is not allowed"),
    ("ftp://host/x.png", "scheme 'ftp'"),
    ("javascript:alert(1)", "scheme 'javascript'"),
    ("just-a-path.png", "scheme '(none)'"),
    ("https://", "no host"),
    ("data:image/png,notbase64", "must be base64"),
    ("data:text/plain;base64,aGVsbG8=", "not an image/* type"),
    ("data:image/png;base64,@@@@", "does not decode"),
    ("data:image/png;base64", "malformed data URI"),
])
def test_bad_image_urls_are_rejected_naming_message_and_part(url, words):
    error = rejected(body({"role": "user", "content": "x"}, user({"type": "text", "text": "t"}, image(url))))
    assert words in error.message
    assert error.message.startswith("messages[1].content[1]")


def test_too_many_images_is_rejected():
    error = rejected(body(user(*[image("https://a.example/x.png")] * 3)), MediaLimits(max_images=2))
    assert "3 images" in error.message and "at most 2" in error.message


def test_too_many_bytes_per_image_and_in_total_are_rejected():
    big = "data:image/png;base64," + base64.b64encode(PNG * 10).decode()
    assert "over the" in rejected(body(user(image(big))), MediaLimits(max_image_bytes=100)).message
    error = rejected(body(user(image(PNG_URI), image(PNG_URI), image(PNG_URI))),
                     MediaLimits(max_total_image_bytes=100))
    assert "in total" in error.message and "content[2]" in error.message


@pytest.mark.parametrize("uuids, words", [
    (["only-one"], "has 1 entries but the request has 2 images"),
    (["a", "b", "c"], "has 3 entries"),
    ("not-a-list", "expected a list"),
    (["a", ""], "non-empty string"),
    (["a", 7], "non-empty string"),
])
def test_bad_uuid_lists_are_rejected(uuids, words):
    request = body(user(image("https://a.example/1.png"), image(PNG_URI)), multi_modal_uuids=uuids)
    assert words in rejected(request).message


def test_part_uuid_must_be_a_non_empty_string_and_agree_with_the_list():
    assert "non-empty string" in rejected(body(user(image(PNG_URI, uuid="")))).message
    assert "contradicts" in rejected(body(user(image(PNG_URI, uuid="a")), multi_modal_uuids=["b"])).message


def test_images_outside_user_messages_are_rejected():
    error = rejected(body({"role": "system", "content": [image(PNG_URI)]}))
    assert "only allowed in user messages" in error.message
