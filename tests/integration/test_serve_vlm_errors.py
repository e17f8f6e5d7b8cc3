"""`kvlab serve` with a VLM: bad input gets a 400 that says what to do (web URLs, unreadable or
missing images, images to a text model, images over the context, an image block in an assistant
turn), and nothing refused counts as served; which model names serve a VLM."""

import json

import pytest

import kvlab as kv

pytest.importorskip("mlx_vlm")

from vlm_requests import anthropic_body as _anthropic  # noqa: E402  (tests/integration: helpers)
from vlm_requests import data_url as _data_url  # noqa: E402
from vlm_requests import image_msgs as _image_msgs  # noqa: E402
from vlm_requests import png as _png  # noqa: E402
from vlm_requests import post as _post  # noqa: E402

pytestmark = [pytest.mark.vlm, pytest.mark.model, pytest.mark.serving]


@pytest.fixture(scope="module")
def vlm():
    return kv.load_vlm("tiny")


@pytest.fixture
def warm(vlm):
    made = []

    def _warm(store="radix"):
        made.append(kv.serve(vlm, store, api_key=""))
        return made[-1]

    yield _warm
    for s in made:
        s.stop()
        assert not s.running


def test_vlm_names(vlm, tiny):
    from kvlab.loader import is_vlm_name

    assert [is_vlm_name(n) for n in ("tiny-vlm", "tiny-vlm:gemma4", vlm.path, "tiny", tiny.path)] == \
        [True, True, True, False, False]


# -- 5. bad input: a 400 that says what to do ---------------------------------------------------

def test_bad_input_is_a_400_saying_what_to_do(vlm, tiny, warm, tmp_path):
    server = warm("radix")
    ok = _data_url(_png(7))
    # the tiny processor's max_pixels (224 x 224) makes an image 64 tokens at most: 64 fill the context
    big = [_data_url(_png(colour=90, size=(224, 224)))] * 64
    cases = [
        (_image_msgs("https://example.com/cat.png", "?"), "is a web URL; kvlab serve never downloads"),
        (_image_msgs("data:image/png;base64,iVBORw0KGgo=", "?"), "the image cannot be decoded"),
        (_image_msgs(f"file://{tmp_path / 'missing.png'}", "?"), "no image file at"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "without an image"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in big]}],
         "exceeds the model's context of 4096 tokens; send fewer or smaller images"),
    ]
    for msgs, says in cases:
        status, body = _post(server, "/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 4})
        assert status == 400 and says in json.dumps(body), (says, body)
    bad_block = _anthropic(_png(7), "?")
    bad_block["messages"][0]["content"][1]["source"] = {"type": "url", "url": "http://example.com/x.png"}
    status, body = _post(server, "/v1/messages", bad_block)
    assert status == 400 and body["type"] == "error" and "never downloads" in body["error"]["message"]
    image_blocks = _anthropic(_png(7), "?")["messages"][0]["content"]
    status, body = _post(server, "/v1/messages", {**_anthropic(_png(7), "?"), "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": image_blocks}]})
    assert status == 400 and "image in user turns" in body["error"]["message"]
    # the server still answers; the three refused on the generation thread count as failed, the
    # rest never reached it, and none is a served request
    msgs = _image_msgs(ok, "?")
    status, body = _post(server, "/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 2})
    assert status == 200 and [r["prompt_tokens"] for r in server.requests()] == [len(kv.tokenise(vlm, msgs).ids)]
    assert server.stats()["failed"] == 3 and server.invariants()["ok"]
    text = kv.serve(tiny, "radix", api_key="")
    try:
        status, body = _post(text, "/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 2})
    finally:
        text.stop()
    assert status == 400 and "is a text model: serve a vision-language model" in json.dumps(body), body
