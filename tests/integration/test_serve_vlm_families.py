"""kvlab serve on the seed's VLM families (tiny qwen3_5: GatedDeltaNet hybrid; tiny gemma4: sliding
window + KV-shared layers, image tokens attending to each other): served reuse equals the
Engine's on the same requests (one reuse core), every answer equals a cache-less server's.

Facts asserted, radix store, greedy decoding:
  1. with ``--checkpoints message_ends`` (the Engine's default for these caches) each request's
     usage ``cached_tokens`` equals ``kv.Engine(model, radix)``'s reused tokens (exact list);
  2. with the server's default ``segment_ends`` an image request reuses the system segment a
     previous request left (mutant: segment_ends skipping every request with images -> 0);
  3. no answer differs from a ``--store none`` server's.
"""

import base64
import io
import sys
from pathlib import Path

import openai
import pytest
from PIL import Image

import kvlab as kv
from kvlab.checkpoints import segment_ends

sys.path.insert(0, str(Path(__file__).parent))
from vlm_requests import ASK, MAX, data_url, image_msgs, png, text_msgs  # noqa: E402

pytest.importorskip("mlx_vlm")
pytestmark = [pytest.mark.vlm, pytest.mark.model, pytest.mark.serving]

ARCHS = ("qwen3_5", "gemma4")


def _requests():
    return [image_msgs(data_url(png(1)), ASK.format("colour")), image_msgs(data_url(png(1)), ASK.format("shape")),
            image_msgs(data_url(png(2)), ASK.format("colour")), text_msgs("What is a cat?"),
            text_msgs("Name three colours.")]


def _engine_messages(msgs):
    """The same conversation with PIL images, as kv.Engine takes it."""
    def part(p):
        if p.get("type") != "image_url":
            return p
        raw = base64.b64decode(p["image_url"]["url"].split(",", 1)[1])
        return {"type": "image", "image": Image.open(io.BytesIO(raw))}
    return [{**m, "content": [part(p) for p in m["content"]]} if isinstance(m["content"], list) else m
            for m in msgs]


def _serve_all(model, store, **kw):
    server = kv.serve(model, store, api_key="", block_size=16, **kw)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)
        out = []
        for msgs in _requests():
            r = client.chat.completions.create(model="tiny-vlm", messages=msgs, max_tokens=MAX, temperature=0)
            out.append((r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens))
        return out
    finally:
        server.stop()


@pytest.fixture(scope="module", params=ARCHS)
def served(request):
    model = kv.load(f"tiny-vlm:{request.param}")
    return model, _serve_all(model, "none"), _serve_all(model, "radix", checkpoints="message_ends"), \
        _serve_all(model, "radix")


def test_served_reuse_equals_the_engines_and_answers_equal_cold(served):
    model, cold, message_ends, _ = served
    engine = kv.Engine(model, kv.stores.make_store("radix"))
    expected = [engine.run(_engine_messages(m), MAX).reused_tokens for m in _requests()]
    assert [cached for _, cached in message_ends] == expected
    assert expected[1] > 0  # the same image again reuses (at the system message end, a checkpoint)
    assert [a for a, _ in message_ends] == [a for a, _ in cold]
    assert all(cached == 0 for _, cached in cold)


def test_default_segment_ends_cuts_image_requests_after_the_system_segment(served):
    model, cold, _, default = served
    toks = kv.tokenise(model, _engine_messages(_requests()[0]))
    system_segment = segment_ends(toks, model.tokenizer)
    assert len(system_segment) == 1 and 0 < system_segment[0] < toks.images[0].token_start
    # requests 2-4 share the system segment of request 1 (and no later checkpoint they can use)
    assert [cached for _, cached in default][:4] == [0] + [system_segment[0]] * 3
    assert [a for a, _ in default] == [a for a, _ in cold]
