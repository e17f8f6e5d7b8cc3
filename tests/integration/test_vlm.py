"""kvlab.vlm on the tiny random-weight qwen2_vl: image-aware prefix caching (vllm-mlx#718).

The facts asserted:
  1. identical token ids with different images: ids-only keys replay the wrong image's KV
     (verify_diff > WRONG_KV_MIN), image keys match a cold run (verify_diff <= LOGIT_TOL);
  2. text-only requests on the VLM reuse like a text model does;
  3. an image request reuses exactly the text before its image (block-rounded for PagedStore);
  4. bad input (unreadable image, image in a text model, placeholder/image count mismatch,
     processor mismatch) raises ImageError / TemplateError with a message that says what to do.
"""

import os

import numpy as np
import pytest

import kvlab as kv
from kvlab.primitives.tolerance import tolerance

pytest.importorskip("mlx_vlm")

import mlx.core as mx  # noqa: E402  (after kvlab: OpenBLAS first)
from PIL import Image  # noqa: E402

from kvlab import vlm as kvlm  # noqa: E402
from kvlab.errors import ImageError, TemplateError  # noqa: E402

pytestmark = [pytest.mark.vlm, pytest.mark.model]

LOGIT_TOL = tolerance("float32")  # 1e-4: float32 tiny model(s), cached vs cold max |logit difference|
WRONG_KV_MIN = 0.1   # another image's KV moves the tiny VLM's next-token logits by ~3
BLOCK = 16
SYSTEM = "You describe pictures in one short sentence. Be precise and plain."


def _image(seed: int, h: int = 56, w: int = 84) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _msgs(image, question="What is in this picture?"):
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                         {"type": "image", "image": image},
                                         {"type": "text", "text": question}]}]


@pytest.fixture(scope="module")
def vlm():
    return kv.load_vlm("tiny")


def _stores():
    return [pytest.param(lambda: kv.RadixStore(), 1, id="radix"),
            pytest.param(lambda: kv.PagedStore(block_size=BLOCK, num_blocks=512), BLOCK, id="paged")]


def _rounded(n: int, block: int) -> int:
    return n // block * block


# -- loading ----------------------------------------------------------------------------------

def test_load_tiny(vlm):
    assert vlm.kind == "vlm" and vlm.arch == "qwen2_vl" and vlm.dtype == "float32"
    assert vlm.path.name.startswith("tiny-qwen2vl-") and (vlm.path / "kvlab.json").is_file()
    assert isinstance(vlm.config["vision_config"]["mlp_ratio"], int)
    assert vlm.fingerprint == kv.load_vlm("tiny").fingerprint == kv.fingerprint(vlm)
    # the cache is mlx-lm's, so kvlab snapshots apply
    from mlx_lm.models.cache import KVCache

    cache = vlm.make_cache()
    assert len(cache) == 4 and all(type(c) is KVCache for c in cache)
    assert vlm.image_token_id == vlm.tokenizer._tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert repr(vlm).startswith("VLModel('tiny-vlm', qwen2_vl") and "\n" not in repr(vlm)
    assert "<table>" in vlm._repr_html_()


def test_load_local_folder(vlm):
    again = kv.load_vlm(vlm.path)
    assert again.fingerprint == vlm.fingerprint and again.kind == "vlm"


def test_load_errors(tmp_path, vlm):
    with pytest.raises(kv.ModelNotFoundError, match="neither"):
        kv.load_vlm(tmp_path / "missing")
    with pytest.raises(kv.ModelNotFoundError, match="vision_config"):
        kv.load_vlm(kv.load("tiny").path)  # a text model's folder


# -- tokenising -------------------------------------------------------------------------------

def test_tokenise_images(vlm):
    a = _image(1)
    toks = kv.tokenise(vlm, _msgs(a))
    (ref,) = toks.images
    # 56x84 px -> a 4x6 patch grid -> 2x3 merged tokens
    assert ref.token_end - ref.token_start == 6 and ref.message_index == 1
    assert toks.ids[ref.token_start:ref.token_end] == (vlm.image_token_id,) * 6
    assert toks.ids[ref.token_start - 1] == vlm.tokenizer._tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert toks.spans[1].token_start <= ref.token_start < ref.token_end <= toks.spans[1].token_end
    assert [s.role for s in toks.spans] == ["system", "user"]
    assert toks.text[toks.spans[0].char_start:toks.spans[0].char_end].count(SYSTEM) == 1
    # the same pixels hash alike, from any source; other pixels do not
    arr = np.asarray(a)
    assert kv.tokenise(vlm, _msgs(arr)).images[0].hash == ref.hash
    b = kv.tokenise(vlm, _msgs(_image(2)))
    assert b.ids == toks.ids and b.images[0].hash != ref.hash


def test_image_hash_is_of_pixels_not_names(vlm, tmp_path):
    img = _image(3)
    img.save(tmp_path / "one.png")
    img.save(tmp_path / "two.png")
    h1 = kv.tokenise(vlm, _msgs(str(tmp_path / "one.png"))).images[0].hash
    h2 = kv.tokenise(vlm, _msgs(tmp_path / "two.png")).images[0].hash
    assert h1 == h2 == kvlm.image_hash(img) and len(h1) == 64  # sha256
    _image(4).save(tmp_path / "one.png")  # same name, new pixels
    assert kv.tokenise(vlm, _msgs(str(tmp_path / "one.png"))).images[0].hash != h1


def test_two_images_and_text_only(vlm):
    msgs = [{"role": "user", "content": [{"type": "image", "image": _image(5)},
                                         {"type": "text", "text": "and"},
                                         {"type": "image", "image": _image(6, 112, 56)},
                                         {"type": "text", "text": "differ how?"}]}]
    toks = kv.tokenise(vlm, msgs)
    assert [im.token_end - im.token_start for im in toks.images] == [6, 8]
    assert toks.images[0].token_end < toks.images[1].token_start
    text = kv.tokenise(vlm, [{"role": "user", "content": "Hi"}])
    assert text.images == () and vlm.image_token_id not in text.ids


# -- the forward pass -------------------------------------------------------------------------

def test_cold_prefill_matches_mlx_vlm(vlm):
    """RequestModel's cold logits equal mlx-vlm's own multimodal forward pass."""
    img = _image(7)
    toks = kv.tokenise(vlm, _msgs(img))
    mine, _ = vlm.prefill(toks, all_logits=True)
    px = vlm.process_image(img)
    ref = vlm.module(mx.array(toks.ids)[None], pixel_values=px.pixel_values,
                    image_grid_thw=mx.array([px.grid]), cache=vlm.make_cache()).logits[0]
    assert float(mx.abs(mine - ref).max()) <= LOGIT_TOL


def test_prefill_on_restored_prefix_matches_cold(vlm):
    """Restored to before, inside, at the end of and after the image: same logits as cold."""
    toks = kv.tokenise(vlm, _msgs(_image(8)))
    (ref,) = toks.images
    cold, cache = vlm.prefill(toks, all_logits=True)
    snap = kv.snapshot(cache)
    for cut in (5, ref.token_start - 1, ref.token_start, ref.token_start + 2, ref.token_end,
                len(toks.ids) - 1):
        net = vlm.for_request(toks)
        from kvlab.primitives.snapshots import prefill

        warm, _ = prefill(net, toks.ids[cut:], kv.restore(kv.trim(snap, snap.offset - cut)),
                          all_logits=True)
        assert float(mx.abs(warm - cold[cut:]).max()) <= LOGIT_TOL, cut
        # the vision tower runs only when the uncached part covers placeholders
        assert net.vision_calls == (1 if cut < ref.token_end else 0), cut


def test_decode_positions_match_mlx_vlm(vlm):
    """After the prompt, M-RoPE positions continue from the prompt's last position (mlx-vlm's
    rope_deltas): one decode step through RequestModel equals mlx-vlm's stateful decode."""
    img = _image(9)
    toks = kv.tokenise(vlm, _msgs(img))
    px = vlm.process_image(img)
    theirs = vlm.make_cache()
    vlm.module(mx.array(toks.ids)[None], pixel_values=px.pixel_values,
              image_grid_thw=mx.array([px.grid]), cache=theirs)
    nxt = mx.array([[1234]])
    ref = vlm.module.language_model(nxt, cache=theirs).logits
    _, ours = vlm.prefill(toks)
    net = vlm.for_request(toks)
    assert float(mx.abs(net(nxt, cache=ours) - ref).max()) <= LOGIT_TOL
    assert net.positions(len(toks.ids), len(toks.ids) + 1)[0, 0, 0].item() < len(toks.ids)


# -- the engine: the three facts ----------------------------------------------------------------

@pytest.mark.parametrize("make_store,block", _stores())
def test_ids_only_keys_replay_the_wrong_image(vlm, make_store, block):
    a, b = _msgs(_image(10)), _msgs(_image(11))
    engine = kv.Engine(vlm, make_store(), image_keys=False, verify=True)
    engine.run(a, max_tokens=2)
    r = engine.run(b, max_tokens=2)
    assert r.prompt_tokens == len(kv.tokenise(vlm, b).ids)
    assert r.reused_tokens == _rounded(r.prompt_tokens - 1, block)  # it reused the image A KV
    assert r.verify_diff > WRONG_KV_MIN


@pytest.mark.parametrize("make_store,block", _stores())
def test_image_keys_match_cold(vlm, make_store, block):
    a, b = _msgs(_image(12)), _msgs(_image(13))
    start = kv.tokenise(vlm, b).images[0].token_start
    engine = kv.Engine(vlm, make_store(), verify=True)  # image_keys=True is the default
    engine.run(a, max_tokens=3)
    r = engine.run(b, max_tokens=3)
    assert r.reused_tokens == _rounded(start, block)  # the text before the placeholders
    assert r.verify_diff <= LOGIT_TOL
    cold = kv.Engine(vlm, None).run(b, max_tokens=3)
    assert r.output_ids == cold.output_ids
    # the same image again, another question: reuse runs through the image
    r2 = engine.run(_msgs(_image(13), "And its colours?"), max_tokens=3)
    assert r2.reused_tokens > kv.tokenise(vlm, b).images[0].token_end - block
    assert r2.verify_diff <= LOGIT_TOL


@pytest.mark.parametrize("make_store,block", _stores())
def test_text_only_requests_reuse(vlm, make_store, block):
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    second = first + [{"role": "assistant", "content": "Blue."},
                      {"role": "user", "content": "Another one, please, and a longer answer."}]
    t1, t2 = kv.tokenise(vlm, first), kv.tokenise(vlm, second)
    common = next((i for i, (x, y) in enumerate(zip(t1.ids, t2.ids)) if x != y), len(t1.ids))
    engine = kv.Engine(vlm, make_store(), verify=True)
    engine.run(first, max_tokens=2)
    r = engine.run(second, max_tokens=2)
    assert r.reused_tokens == _rounded(common, block) > 0
    assert r.verify_diff <= LOGIT_TOL


@pytest.mark.parametrize("make_store,block", _stores())
def test_image_request_after_text_reuses_text_before_image(vlm, make_store, block):
    """A text-only request with the same leading text: the image request reuses exactly the text
    before its image. The rendering puts <|vision_start|> just before the placeholders (at
    token_start - 1), and a text-only prompt never has that token there, so the shared text ends
    at token_start - 1; after an image request with the same text it is token_start."""
    text = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Look:"}]
    toks = kv.tokenise(vlm, _msgs(_image(14)))
    start = toks.images[0].token_start
    engine = kv.Engine(vlm, make_store(), verify=True)
    engine.run(text, max_tokens=1)
    r = engine.run(toks, max_tokens=1)
    assert r.reused_tokens == _rounded(start - 1, block)
    assert r.verify_diff <= LOGIT_TOL


def test_image_keys_false_documented_and_events(vlm):
    engine = kv.Engine(vlm, kv.RadixStore(), image_keys=False)
    toks = engine.tokens_of(_msgs(_image(15)))[0]
    assert engine.key_of(_msgs(_image(15))).extra_keys == () and len(toks.images) == 1
    key = kv.Engine(vlm, kv.RadixStore()).key_of(_msgs(_image(15)))
    assert key.extra_keys == ((toks.images[0].token_start, toks.images[0].token_end, toks.images[0].hash),)


# -- bad input --------------------------------------------------------------------------------

def test_unreadable_images(vlm, tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"this is not a png")
    cases = [(tmp_path / "nope.png", "no image file"), (str(bad), "cannot be decoded"),
             (np.zeros((8, 8, 3), np.float32), "uint8"), (object(), "cannot read an image"),
             ("https://example.com/cat.png", "never downloads")]
    for source, words in cases:
        with pytest.raises(ImageError, match=words):
            kv.tokenise(vlm, _msgs(source))
    with pytest.raises(ImageError, match="without an image"):
        kv.tokenise(vlm, [{"role": "user", "content": [{"type": "image"}]}])
    with pytest.raises(ImageError, match="cannot be decoded"):
        kv.Engine(vlm, kv.RadixStore()).run(_msgs(str(bad)))


def test_image_in_text_only_model(tiny):
    with pytest.raises(TemplateError, match="load_vlm"):
        kv.tokenise(tiny, _msgs(_image(16)))
    with pytest.raises(TemplateError, match="load_vlm"):
        kv.Engine(tiny, kv.RadixStore()).run(_msgs(_image(16)))


def test_placeholder_count_mismatch(vlm):
    written = "<|vision_start|><|image_pad|><|vision_end|>"  # image tokens typed into the text
    extra = [{"role": "user", "content": [{"type": "image", "image": _image(17)},
                                          {"type": "text", "text": written}]}]
    with pytest.raises(TemplateError, match="2 image placeholders .* for 1 image"):
        kv.tokenise(vlm, extra)
    with pytest.raises(TemplateError, match="0 image placeholders"):
        kv.tokenise(vlm, _msgs(_image(17)), chat_template="{% for m in messages %}x{% endfor %}")
    with pytest.raises(TemplateError, match="videos"):
        kv.tokenise(vlm, [{"role": "user", "content": [{"type": "video", "video": "a.mp4"},
                                                       {"type": "image", "image": _image(17)}]}])


def test_placeholders_without_pixels(vlm):
    ids = kv.tokenise(vlm, _msgs(_image(18))).ids
    with pytest.raises(ImageError, match="carry no pixels"):
        kv.Engine(vlm, kv.RadixStore()).run(list(ids))


def test_processor_mismatch(vlm, monkeypatch):
    """A preprocessor whose merge size disagrees with the model: placeholders != features."""
    monkeypatch.setattr(vlm.processor.image_processor, "merge_size", 1)
    toks = kv.tokenise(vlm, _msgs(_image(19)))  # 24 placeholders for 6 features
    monkeypatch.undo()
    try:
        with pytest.raises(ImageError, match="do not match"):
            vlm.prefill(toks)
    finally:
        vlm._memo.pop(toks.images[0].hash, None)  # drop the mis-processed entry


def test_missing_mlx_vlm_message(monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "mlx_vlm" or name.startswith("mlx_vlm."):
            raise ImportError("no mlx_vlm here")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(kvlm.VLMUnavailableError, match=r"kvlab\[vlm\]"):
        kv.load_vlm("tiny")


def test_reprs(vlm):
    toks = kv.tokenise(vlm, _msgs(_image(20)))
    net = vlm.for_request(toks)
    assert repr(net).startswith("RequestModel('tiny-vlm'") and "1 images" in repr(net)
    assert "<table>" in net._repr_html_()
    assert repr(toks.images[0]).startswith("ImageRef(")
    px = vlm.process_image(_image(20))
    assert repr(px) == f"Pixels({px.hash[:12]}, grid 1x4x6, 6 tokens)" and "<b>Pixels" in px._repr_html_()
    assert os.fspath(vlm.path) in vlm._repr_html_()


# -- the model interface a text model shares (issue 9 §2) ---------------------------------------

def test_net_runs_text_only_ids_like_mlx_vlm(vlm):
    """``vlm.net`` is the text-only net: ``kv.prefill(vlm, ids)`` equals mlx-vlm's own forward
    pass and ``vlm.prefill(tokens)``. Mutant caught: ``net`` left as the mlx-vlm module (its call
    returns an output object, not logits, and kv.prefill fails)."""
    from kvlab.primitives.snapshots import Runnable

    toks = kv.tokenise(vlm, [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": "Name a colour."}])
    mine, cache = kv.prefill(vlm, toks.ids, all_logits=True)
    # positions passed explicitly: mlx-vlm's own call reuses the positions of the last image
    # request it ran (state kept between calls), so without them the reference depends on test order
    ids = mx.array(toks.ids)[None]
    positions, _ = vlm.module.language_model.get_rope_index(ids, None, None, None)
    ref = vlm.module.language_model(ids, cache=vlm.make_cache(), position_ids=positions).logits[0]
    assert mine.shape == (len(toks.ids), vlm.vocab_size)
    assert float(mx.abs(mine - ref).max()) <= LOGIT_TOL
    theirs, _ = vlm.prefill(toks, all_logits=True)
    assert float(mx.abs(mine - theirs).max()) <= LOGIT_TOL
    assert cache[0].offset == len(toks.ids)
    # both nets are kvlab Runnables: kv.prefill checks their ids and makes their caches
    assert isinstance(vlm, Runnable) and isinstance(vlm.net, Runnable)
    assert isinstance(vlm.for_request(toks), Runnable) and vlm.for_request(toks).net.tokens is toks
    assert repr(vlm.net) == "RequestModel('tiny-vlm', text-only, 0 images, 0 vision calls)"


def test_net_refuses_image_placeholders_without_pixels(vlm):
    """Image placeholder ids through the text-only net would silently embed the placeholder
    token instead of the image: ImageError pointing to the Tokens path. Mutant caught: drop the
    placeholder check in RequestModel for tokens=None -> kv.prefill runs and returns logits."""
    ids = kv.tokenise(vlm, _msgs(_image(21))).ids
    with pytest.raises(ImageError, match=r"carry no pixels.*vlm\.prefill"):
        kv.prefill(vlm, ids)
    with pytest.raises(kv.KvlabError, match="takes the Tokens"):
        vlm.prefill(list(ids))


def test_request_model_checks_ids(vlm):
    toks = kv.tokenise(vlm, _msgs(_image(22)))
    net = vlm.for_request(toks)
    v = vlm.vocab_size
    with pytest.raises(kv.TokenIdError, match=rf"position 1 holds id {v}, .*\[0, {v}\)"):
        net.check_ids([5, v])
    _, cache = vlm.prefill(toks)
    n = len(toks.ids)
    # decoding past the prompt: the position named is the request's, not the chunk's
    with pytest.raises(kv.TokenIdError, match=rf"position {n + 1} holds id -3,"):
        net(mx.array([[7, -3]]), cache=cache)
    assert cache[0].offset == n  # rejected before anything ran


CHILD = """
import mlx.core as mx

vlm = kv.load_vlm("tiny")
V = vlm.vocab_size
msgs = [{"role": "user", "content": "Hi"}]
toks = kv.tokenise(vlm, msgs)

net = vlm.for_request(toks)
attempt("prefill_vlm", lambda: kv.prefill(vlm, [1, 10**9]))
attempt("prefill_net", lambda: kv.prefill(net, [1, 2, V]))
attempt("call_net", lambda: net(mx.array([[10**9]]), cache=vlm.make_cache()))
attempt("call_text_net", lambda: vlm.net(mx.array([[3, V + 7]]), cache=vlm.make_cache()))
attempt("engine", lambda: kv.Engine(vlm, kv.RadixStore()).run([4, -5], max_tokens=1))
"""


def test_out_of_vocabulary_ids_get_a_kvlab_error_not_a_crash(tmp_path):
    """Issue 9 §7 for the VLM: MLX gathers embeddings without a bounds check, so an id past the
    vocabulary kills the process. Run in a child that must survive. Mutant caught: drop the range
    check in RequestModel._checked -> the child dies (call_net, call_text_net)."""
    from child_attempts import run_attempts

    got = run_attempts(CHILD, tmp_path)  # asserts the child survived
    v = got["vocab"]
    for case, position, value in (("prefill_vlm", 1, 10**9), ("prefill_net", 2, v),
                                  ("call_net", 0, 10**9), ("call_text_net", 1, v + 7),
                                  ("engine", 1, -5)):
        assert got[case].startswith("TokenIdError: "), (case, got[case])
        assert f"position {position} holds id {value}" in got[case] and f"[0, {v})" in got[case], got[case]
