"""Images across both stages, end to end: real image bytes, a real HTTP image server, sim workers, serve.

The workers are revision-3 TensorRT-LLM (tensorrt_llm/openengine/server.py @ 01138754b3f4): the one
that serves images, reporting them per path in ModelInfo.multimodal_capabilities. It refuses a prompt
whose image placeholders do not match the images, so every 200 here also proves the orchestrator
wrote the model's own placeholder (tiny-chat's `<|image|>`, from its chat template).
"""

import base64
import http.server
import io
import threading

import httpx
import pytest
import trio

from orchestrator.testkit.plugin import write_config
from serve_helpers import Deployment
from sim_helpers import recent_requests

PIL = pytest.importorskip("PIL.Image")
FAST = ("--time-scale", "0.02", "--schema-revision", "3")
REVISION_1 = ("--time-scale", "0.02")
# the test's image server is on loopback, refused by default
# (tensorrt_llm/grpc/openengine: supports_multimodal=false, media UNIMPLEMENTED)
LOCAL_IMAGES = {"image_url_allowlist": ["127.0.0.1"]}


def image_bytes(fmt: str, color) -> bytes:
    buffer = io.BytesIO()
    PIL.new("RGB", (8, 8), color).save(buffer, format=fmt)
    return buffer.getvalue()


PNG = image_bytes("PNG", (200, 10, 10))
JPEG = image_bytes("JPEG", (10, 200, 10))


@pytest.fixture(scope="module")
def image_server():
    """A local HTTP server with /cat.jpg (the engine fetches it for real)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/cat.jpg":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("content-type", "image/jpeg")
            self.send_header("content-length", str(len(JPEG)))
            self.end_headers()
            self.wfile.write(JPEG)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def image_request(url_base, **extra):
    data_uri = "data:image/png;base64," + base64.b64encode(PNG).decode()
    return {"model": "tiny-chat", "max_tokens": 12, "seed": 11, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Compare these pictures."},
                                     {"type": "image_url", "image_url": {"url": data_uri}, "uuid": "red-square"}]},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url_base + "/cat.jpg"}},
                                     {"type": "text", "text": "And this one?"}]}],
        "multi_modal_uuids": ["red-square", "green-cat"], **extra}


@pytest.fixture(scope="module")
def agg(tmp_path_factory):
    deployment = Deployment(tmp_path_factory.mktemp("img-agg"), "aggregated", {"aggregated": [FAST]},
                            limits=LOCAL_IMAGES)
    yield deployment
    deployment.close()


@pytest.fixture(scope="module")
def disagg(tmp_path_factory):
    deployment = Deployment(tmp_path_factory.mktemp("img-disagg"), "disaggregated",
                            {"prefill": [FAST], "decode": [FAST]}, limits=LOCAL_IMAGES)
    yield deployment
    deployment.close()


async def test_two_images_give_identical_tokens_in_agg_and_disagg_and_reach_both_legs_intact(
        agg, disagg, image_server, engine_client):
    async with httpx.AsyncClient(timeout=30) as http:
        a = await http.post(agg.url + "/v1/chat/completions", json=image_request(image_server))
        d = await http.post(disagg.url + "/v1/chat/completions", json=image_request(image_server))
    assert a.status_code == d.status_code == 200, (a.text, d.text)
    assert a.json()["choices"][0]["message"]["content"] == d.json()["choices"][0]["message"]["content"]
    # the engine expanded both images: 2 x 576 tokens on top of the text
    assert a.json()["usage"]["prompt_tokens"] == d.json()["usage"]["prompt_tokens"] > 2 * 576

    expected = [("data_uri", "data:image/png;base64,", "red-square"),
                ("url", image_server + "/cat.jpg", "green-cat")]

    def media_of(record):
        return [(m["source"], m["value"][: len(e[1])], m["uuid"]) for m, e in zip(record["media"], expected)]

    (agg_leg,) = list(await recent_requests(engine_client, agg.worker("aggregated")))
    assert agg_leg["kind"] == "full" and media_of(agg_leg) == expected
    (ctx_leg,) = await recent_requests(engine_client, disagg.worker("prefill"))
    (gen_leg,) = await recent_requests(engine_client, disagg.worker("decode"))
    assert ctx_leg["kind"] == "context_only" and gen_leg["kind"] == "generation_only"
    assert media_of(ctx_leg) == media_of(gen_leg) == expected
    assert [m["identity"] for m in ctx_leg["media"]] == [m["identity"] for m in gen_leg["media"]] == \
        ["red-square", "green-cat"]
    assert ctx_leg["prompt_tokens"] == gen_leg["prompt_tokens"] == agg_leg["prompt_tokens"]


async def test_images_without_uuids_are_identified_by_their_bytes_on_both_legs(disagg, image_server, engine_client):
    body = image_request(image_server)
    del body["multi_modal_uuids"]
    del body["messages"][0]["content"][1]["uuid"]
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(disagg.url + "/v1/chat/completions", json=body)
    assert response.status_code == 200
    ctx_leg = (await recent_requests(engine_client, disagg.worker("prefill")))[-1]
    gen_leg = (await recent_requests(engine_client, disagg.worker("decode")))[-1]
    identities = [m["identity"] for m in ctx_leg["media"]]
    assert identities == [m["identity"] for m in gen_leg["media"]]
    assert all(i.startswith("sha256:") for i in identities) and identities[0] != identities[1]


@pytest.mark.parametrize("prefill_flags, decode_flags, refusing, signals", [
    (("--no-multimodal",), (), "prefill", "supports_multimodal=false"),
    ((), ("--image-paths", "aggregate"), "decode",
     "supports_multimodal=true, image not in multimodal_capabilities.prefill_decode_modalities"),
    (("--multimodal", "--image-paths", "none"), (), "prefill", "image not in"),  # the signals disagree: no
    (("--no-multimodal", "--image-paths", "both"), (), "prefill", "supports_multimodal=false, image in"),
    (REVISION_1, REVISION_1, "prefill", "supports_multimodal=false"),  # revision 1 sends only the flag
])
async def test_images_are_refused_unless_every_signal_of_every_worker_says_yes(
        tmp_path, sim_workers, orchestrator_servers, image_server, prefill_flags, decode_flags, refusing, signals):
    prefill = sim_workers.start("prefill", *(prefill_flags if prefill_flags == REVISION_1 else (*FAST, *prefill_flags)))
    decode = sim_workers.start("decode", *(decode_flags if decode_flags == REVISION_1 else (*FAST, *decode_flags)))
    server = orchestrator_servers.start(write_config(
        tmp_path / "gate.yaml", "disaggregated", {"prefill": [prefill.address], "decode": [decode.address]},
        limits=LOCAL_IMAGES))
    async with httpx.AsyncClient(timeout=30) as http:
        refused = await http.post(server.url + "/v1/chat/completions", json=image_request(image_server))
        text_only = await http.post(server.url + "/v1/chat/completions", json={
            "model": "tiny-chat", "max_tokens": 3, "messages": [{"role": "user", "content": "no images"}]})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert "does not accept images" in error["message"] and f"{refusing} worker" in error["message"]
    assert signals in error["message"] and error["code"] == "images_not_supported"
    assert text_only.status_code == 200


async def test_a_configured_window_tighter_than_the_engine_refuses_image_requests(
        tmp_path, sim_workers, orchestrator_servers, image_server):
    worker = sim_workers.start("aggregated", *FAST)
    server = orchestrator_servers.start(write_config(
        tmp_path / "window.yaml", "aggregated", {"aggregated": [worker.address]},
        model={"name": "tiny-chat", "dir": "builtin:tiny-chat", "context_window": 4096}, limits=LOCAL_IMAGES))
    async with httpx.AsyncClient(timeout=30) as http:
        refused = await http.post(server.url + "/v1/chat/completions", json=image_request(image_server))
        text = await http.post(server.url + "/v1/chat/completions", json={
            "model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_window"
    assert "4096" in refused.json()["error"]["message"] and "8192" in refused.json()["error"]["message"]
    # text requests get max_tokens from the configured window: min(4096 - prompt, max_output_tokens)
    assert text.status_code == 200


async def test_image_requests_without_max_tokens_are_not_cut_short_by_an_engine_default(agg, image_server):
    """Revision-3 TensorRT-LLM stops at 32 tokens when max_tokens is omitted (converters.to_sampling_params
    @ 58132ce1f654); the orchestrator sends window - text tokens, which the engine clamps to its real room
    (tensorrt_llm/executor/base_worker.py _deduce_max_tokens @ 7b437aaa73bf)."""
    body = image_request(image_server, ignore_eos=True)
    del body["max_tokens"]
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(agg.url + "/v1/chat/completions", json=body)
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == 8192 - usage["prompt_tokens"] > 32


async def test_a_failing_capability_discovery_is_one_shared_503_for_concurrent_image_requests(
        tmp_path, sim_workers, orchestrator_servers, image_server, engine_client):
    worker = sim_workers.start("aggregated", *FAST, "--fail-model-info")
    server = orchestrator_servers.start(write_config(
        tmp_path / "disc.yaml", "aggregated", {"aggregated": [worker.address]},
        limits={"health_interval_s": 30, **LOCAL_IMAGES}))  # keep background health checks out of the count
    results = []
    async with httpx.AsyncClient(timeout=30) as http:
        async def one():
            results.append(await http.post(server.url + "/v1/chat/completions", json=image_request(image_server)))

        async with trio.open_nursery() as nursery:
            for _ in range(12):
                nursery.start_soon(one)
    assert [r.status_code for r in results] == [503] * 12
    messages = {r.json()["error"]["message"] for r in results}
    assert len(messages) == 1 and "capability discovery" in messages.pop()
    async with engine_client(worker.address) as client:
        calls = (await client.load()).attributes.fields["model_info_calls"].number_value
    assert calls < 12  # shared attempts, not one per request


async def test_the_engine_enforces_its_fetch_size_limit(tmp_path, sim_workers, orchestrator_servers, image_server):
    worker = sim_workers.start("aggregated", *FAST, "--media-max-bytes", "100")  # the JPEG is larger
    server = orchestrator_servers.start(write_config(tmp_path / "small.yaml", "aggregated",
                                                     {"aggregated": [worker.address]}, limits=LOCAL_IMAGES))
    body = {"model": "tiny-chat", "max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_server + "/cat.jpg"}}]}]}
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(server.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400 and "more than 100 bytes" in response.json()["error"]["message"]


async def test_media_options_reach_revision_3_workers_that_take_them_and_are_refused_elsewhere(
        disagg, image_server, engine_client, tmp_path, sim_workers, orchestrator_servers):
    """The sibling server takes GenerateRequest.media_options and says so in supports_per_request_media_options
    (docs/openengine-additions.md); a v0.1.0 server would drop the field unseen, so it is never sent there."""
    options = {"image": {"min_pixels": 3136}}
    async with httpx.AsyncClient(timeout=30) as http:
        taken = await http.post(disagg.url + "/v1/chat/completions",
                                json=image_request(image_server, media_io_kwargs=options))
        assert taken.status_code == 200, taken.text
        ctx_leg = (await recent_requests(engine_client, disagg.worker("prefill")))[-1]
        gen_leg = (await recent_requests(engine_client, disagg.worker("decode")))[-1]
        assert ctx_leg["media_options"] == gen_leg["media_options"] == options
        text_only = await http.post(disagg.url + "/v1/chat/completions", json={
            "model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "media_io_kwargs": options})
        assert text_only.status_code == 400 and text_only.json()["error"]["param"] == "media_io_kwargs"


async def test_image_urls_that_name_internal_addresses_never_reach_the_engine(
        tmp_path, sim_workers, orchestrator_servers, engine_client):
    """Workers fetch image URLs themselves: loopback, link-local (metadata), private and credentialed URLs
    are refused before any worker is asked (orchestrator/media_policy.py)."""
    worker = sim_workers.start("aggregated", *FAST)
    server = orchestrator_servers.start(write_config(tmp_path / "ssrf.yaml", "aggregated",
                                                     {"aggregated": [worker.address]}))
    urls = [server.url + "/metrics", "http://127.1/x.png", "http://2130706433/x.png", "http://0x7f000001/x.png",
            "http://[::ffff:127.0.0.1]/x.png", "http://169.254.169.254/latest/meta-data/", "http://10.0.0.7/x.png",
            "http://user:secret@93.184.216.34/x.png",
            # IPv6 spellings that reach IPv4 inside: 6to4 of 127.0.0.1, 169.254.169.254 and 10.0.0.1, Teredo to
            # 127.0.0.1, NAT64 of 127.0.0.1 (each looks global, or looked so, as an IPv6 address)
            "http://[2002:7f00:1::]/", "http://[2002:a9fe:a9fe::]/latest/meta-data/", "http://[2002:0a00:0001::]/x.png",
            "http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/x.png", "http://[64:ff9b::7f00:1]/x.png"]
    async with httpx.AsyncClient(timeout=30) as http:
        for url in urls:
            body = {"model": "tiny-chat", "max_tokens": 3, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}]}]}
            response = await http.post(server.url + "/v1/chat/completions", json=body)
            error = response.json()["error"]
            assert response.status_code == 400 and error["code"] == "image_url_not_allowed", (url, error)
            assert "secret" not in response.text and str(worker.address) not in response.text
    assert await recent_requests(engine_client, worker) == []
