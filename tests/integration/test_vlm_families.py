"""The tiny VLMs of the seed's cache families (``kv.load("tiny-vlm:<arch>")``: qwen2_vl dense,
qwen3_5 GatedDeltaNet hybrid, gemma4 sliding window + KV-shared layers) with every store.

The facts asserted:
  1. each adapter matches mlx-vlm: RequestModel's cold logits equal mlx-vlm's own
     ``model(input_ids, pixel_values, ...)`` forward pass (gemma4: with the ``mm_token_type_ids``
     its processor makes, so the tokens of one image attend to each other), and a prompt
     prefilled in two pieces (cut before, at, inside and after the image) equals one pass;
     gemma4 refuses a piece that ends or starts inside an image, naming it;
  2. per tiny VLM x store, exact reused token counts for (a) a second text-only request with the
     same system prompt, (b) the same image again in the next turn, (c) a different image with
     the same ids: reuse stops at or before the image's first placeholder; every verify_diff
     within LOGIT_TOL of a cold run. Sliding and hybrid families reuse at checkpoints (message
     ends and the prompt end) exactly as their text families do, or refuse naming the layer;
  3. the ids-only mutant (image_keys=False) replays another image's KV: verify_diff > WRONG_KV_MIN;
  4. gemma4 is never restored inside an image: the reuse core cuts such a match back to the
     image's token_start (qwen2_vl keeps it), the Engine takes no checkpoint there.

Mutants checked by hand (each test names its own): plain positions for the M-RoPE models, gemma4
image features scaled like token embeddings, gemma4 per-layer inputs from the placeholder id,
features sliced from the chunk start, qwen3_5's recurrent state not written back after a chunk,
mlx-vlm's cache classes used as they are, decode positions without the M-RoPE delta, cache keys
without image hashes (kvlab.keys: "other image" verify_diff 3.1 / 8.2 / 7.0); gemma4 without
token types (5.8), without ImageBlockMask (9.3), without the refusals in RequestModel, the reuse
core's restorable_limit or the Engine's stop filter (each test names what it then sees).

LOGIT_TOL: float32 tiny models; restored KV/state is what a cold prefill computes, so cached and
cold logits differ only by the order of float additions of a prompt run in pieces (measured
3e-6..2e-5).
"""

import json
import shutil

import numpy as np
import pytest

import kvlab as kv
from kvlab.primitives.tolerance import tolerance

pytest.importorskip("mlx_vlm")

import mlx.core as mx  # noqa: E402  (after kvlab: OpenBLAS first)
from PIL import Image  # noqa: E402

from kvlab.primitives.snapshots import advance, prefill  # noqa: E402
from kvlab.vlm import archs  # noqa: E402

pytestmark = [pytest.mark.vlm, pytest.mark.model]

LOGIT_TOL = tolerance("float32")  # 1e-4
WRONG_KV_MIN = 1.0  # another image's KV moves the next-token logits by 3.1 / 8.2 / 7.0 (measured)
BLOCK = 16
ARCHS = ("qwen2_vl", "qwen3_5", "gemma4")
FAMILY = {"qwen2_vl": "dense", "qwen3_5": "hybrid", "gemma4": "sliding"}
STORES = tuple(n for n in kv.stores.STORE_NAMES if n != "none")
LAYOUT = {"qwen2_vl": "4 x full-attention KV",
          "qwen3_5": "2 x recurrent state (ArraysCache), 2 x full-attention KV",
          "gemma4": "2 x sliding window of 32, 2 x full-attention KV, 2 x no cache (shared-KV or MLP-only layer)"}
SYSTEM = "You describe pictures in one short sentence. Be precise and plain. Answer in English, never guess."


def _image(seed: int, h: int = 56, w: int = 84) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _text(question):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _msgs(image, question="What is in this picture?"):
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "image": image},
                                         {"type": "text", "text": question}]}]


def _next_turn(messages):
    return messages + [{"role": "assistant", "content": "A pattern."},
                       {"role": "user", "content": "And its colours?"}]


@pytest.fixture(scope="module", params=ARCHS)
def vlm(request):
    return kv.load(f"tiny-vlm:{request.param}")


def _rounded(n, block):
    return n // block * block


def _common(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# -- loading ----------------------------------------------------------------------------------

def test_each_tiny_vlm_has_its_family_cache_and_qwen_vision_tokens(vlm):
    # mutant caught: mlx-vlm's own make_cache used as it is: its cache classes share mlx-lm's
    # names (so the layout reads the same) but not their types, which kvlab's snapshots dispatch on
    assert vlm.layout.summary() == LAYOUT[vlm.arch]
    assert {type(c).__module__ for c in vlm.make_cache()} == {"mlx_lm.models.cache"}
    assert vlm.kind == "vlm" and vlm.dtype == "float32" and (vlm.path / "kvlab.json").is_file()
    tok = vlm.tokenizer._tokenizer
    assert vlm.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>") == 151655
    toks = kv.tokenise(vlm, _msgs(_image(1)))
    (ref,) = toks.images
    # 56x84 px -> 6 image tokens on every architecture, framed by the config's start/end ids
    assert ref.token_end - ref.token_start == 6
    assert toks.ids[ref.token_start - 1] == tok.convert_tokens_to_ids("<|vision_start|>") == 151652
    assert toks.ids[ref.token_end] == tok.convert_tokens_to_ids("<|vision_end|>") == 151653
    same = kv.load_vlm(f"tiny:{vlm.arch}")
    assert same.fingerprint == vlm.fingerprint and repr(same).startswith("VLModel(")
    assert "<table>" in vlm._repr_html_() and repr(vlm.adapter).startswith(type(vlm.adapter).__name__)


def test_unknown_architectures_are_refused(tmp_path):
    with pytest.raises(kv.ModelNotFoundError, match="tiny-vlm:qwen2_vl, tiny-vlm:qwen3_5, tiny-vlm:gemma4"):
        kv.load("tiny-vlm:llava")
    folder = tmp_path / "llava"
    shutil.copytree(kv.load_vlm("tiny").path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "llava"}))
    with pytest.raises(kv.ModelNotFoundError, match="supports qwen2_vl, qwen3_5, gemma4.*architecture-specific"):
        kv.load_vlm(folder)


# -- the adapters match mlx-vlm -----------------------------------------------------------------

def _mlx_vlm_extra(vlm, toks, px):
    """What mlx-vlm's generation passes with the ids besides pixels: qwen's image grid; gemma4's
    ``mm_token_type_ids`` (1 at image placeholders, as mlx_vlm/models/gemma4/processing_gemma4.py
    makes them), which turn on its bidirectional attention within an image."""
    if vlm.arch != "gemma4":
        return {"image_grid_thw": mx.array([px.grid])}
    return {"mm_token_type_ids": (mx.array(toks.ids)[None] == vlm.image_token_id).astype(mx.int32)}


def _mlx_vlm_logits(vlm, toks, img):
    from mlx_vlm.models.cache import make_prompt_cache

    px = vlm.process_image(img)
    return vlm.module(mx.array(toks.ids)[None], pixel_values=px.pixel_values,
                      cache=make_prompt_cache(vlm.module.language_model), **_mlx_vlm_extra(vlm, toks, px)).logits[0]


def test_cold_logits_match_mlx_vlm(vlm):
    """The anchor. Mutants caught: plain positions for the M-RoPE models (RequestModel.positions
    without get_rope_index: diff 4.0 qwen2_vl, 1.9 qwen3_5); gemma4's image features scaled by sqrt(hidden) like token
    embeddings (diff 11.7), or its image tokens' per-layer inputs taken from the placeholder id
    instead of 0 (diff 10.7)."""
    img = _image(7)
    toks = kv.tokenise(vlm, _msgs(img))
    mine, _ = vlm.prefill(toks, all_logits=True)
    ref = _mlx_vlm_logits(vlm, toks, img)
    assert mine.shape == ref.shape == (len(toks.ids), vlm.vocab_size)
    assert float(mx.abs(mine - ref).max()) <= LOGIT_TOL
    # the image matters: another image moves the logits after it by far more than the tolerance
    other, _ = vlm.prefill(kv.tokenise(vlm, _msgs(_image(8))), all_logits=True)
    assert float(mx.abs(other[-1] - mine[-1]).max()) > WRONG_KV_MIN


def test_text_only_net_and_decode_match_mlx_vlm(vlm):
    """``kv.prefill(vlm, ids)`` (the text-only net) equals mlx-vlm's language model, and one decode
    step after an image prompt equals mlx-vlm's own stateful decode (M-RoPE continues from the
    prompt's last position; plain positions from the offset). Mutant caught: decode positions
    continuing from the token count instead of the M-RoPE delta (qwen2_vl / qwen3_5)."""
    from mlx_vlm.models.cache import make_prompt_cache

    lm = vlm.module.language_model
    ids = kv.tokenise(vlm, _text("Name a colour.")).ids
    mine, _ = kv.prefill(vlm, ids, all_logits=True)
    x = mx.array(ids)[None]
    # positions passed explicitly: mlx-vlm's M-RoPE models keep the last image request's positions
    extra = {} if vlm.arch == "gemma4" else {"position_ids": lm.get_rope_index(x, None, None, None)[0]}
    ref = lm(x, cache=make_prompt_cache(lm), **extra).logits[0]
    assert float(mx.abs(mine - ref).max()) <= LOGIT_TOL
    img = _image(12)
    toks = kv.tokenise(vlm, _msgs(img))
    px = vlm.process_image(img)
    theirs = make_prompt_cache(lm)
    vlm.module(mx.array(toks.ids)[None], pixel_values=px.pixel_values, cache=theirs, **_mlx_vlm_extra(vlm, toks, px))
    nxt = mx.array([[1234]])
    ref = lm(nxt, cache=theirs).logits
    _, ours = vlm.prefill(toks)
    assert float(mx.abs(vlm.for_request(toks)(nxt, cache=ours) - ref).max()) <= LOGIT_TOL


def test_gemma4_causal_images_differ_from_mlx_vlm(monkeypatch):
    """The mutant of the anchor for gemma4: the adapter without token types (the tiny model's
    images attending causally, as before TINY_ARCHS_VERSION 2) is not mlx-vlm's Gemma 4, whose
    tokens of one image see each other (``use_bidirectional_attention: "vision"``)."""
    vlm = kv.load("tiny-vlm:gemma4")
    assert vlm.module.language_model.config.use_bidirectional_attention == "vision"
    assert vlm.adapter.bidirectional(vlm.module) and not kv.load("tiny-vlm:qwen3_5").adapter.bidirectional(None)
    img = _image(7)
    toks = kv.tokenise(vlm, _msgs(img))
    ref = _mlx_vlm_logits(vlm, toks, img)
    monkeypatch.setattr(archs.Gemma4Adapter, "token_types", lambda self, module, ids: mx.zeros_like(ids))
    causal, _ = vlm.prefill(toks, all_logits=True)
    assert float(mx.abs(causal - ref).max()) > WRONG_KV_MIN  # measured 5.8
    start = toks.images[0].token_start  # the text before the image is the same either way
    assert float(mx.abs(causal[:start] - ref[:start]).max()) <= LOGIT_TOL


def test_prompt_in_two_pieces_equals_one_pass(vlm):
    """Cut before, at, inside and after the image (and one token before the end): the second
    piece runs on the first piece's cache, so features and positions must start at the cache
    offset. The first piece runs as one chunk (``advance``). gemma4's image tokens see each other,
    so a piece may neither end nor start inside an image: both are refused, naming the image.
    Mutants caught: image features taken from the chunk start instead of the placeholder start;
    gemma4 without ImageBlockMask (mlx-vlm drops its image overlay on top of a cached prefix:
    cuts at or before the image 9.3 off); the refusals removed (a first piece ending inside the
    image, then the rest: 3.8 off)."""
    toks = kv.tokenise(vlm, _msgs(_image(9)))
    (ref,) = toks.images
    s, e = ref.token_start, ref.token_end
    cold, _ = vlm.prefill(toks, all_logits=True)
    inside = s + 2
    for cut in (s - 1, s, inside, e, e + 1, len(toks.ids) - 1):
        net = vlm.for_request(toks)
        if vlm.arch == "gemma4" and cut == inside:
            with pytest.raises(kv.ImageError) as err:
                advance(net, toks.ids[:cut], vlm.make_cache())
            assert str(err.value) == (f"a chunk 0:{cut} ends inside image 0 (tokens {s}:{e}): gemma4 attends "
                                      f"bidirectionally within an image, so its tokens run in one chunk; end "
                                      f"the chunk at or before {s}, or at or after {e}")
            # a cache that holds part of the image (here made by the text-only net) is refused too
            _, part = prefill(vlm, kv.tokenise(vlm, _text("Name a colour, then a fruit, then a tree.")).ids[:cut])
            with pytest.raises(kv.ImageError) as err:
                net(mx.array(toks.ids[cut:])[None], cache=part)
            assert str(err.value) == (f"cannot prefill from {cut}: position {cut} is inside image 0 (tokens "
                                      f"{s}:{e}): gemma4 attends bidirectionally within an image; restore at "
                                      f"or before token_start {s}")
            continue
        cache = advance(net, toks.ids[:cut], vlm.make_cache())
        warm, _ = prefill(net, toks.ids[cut:], cache, all_logits=True)
        assert float(mx.abs(warm - cold[cut:]).max()) <= LOGIT_TOL, cut


# -- the engine: every store on every tiny VLM --------------------------------------------------

def _expected(arch, store, case, prev, cur, text):
    """What (a) text / (b) same image / (c) other image reuses, from the tokens and the family.

    Full-KV (dense) models restore any prefix: the shared prefix, capped before the last token,
    cut at the first image whose pixels differ, rounded down to whole blocks by the paged store.
    Sliding and hybrid models restore only where a snapshot was taken: the end of a message or
    of a prompt (kv.Engine's ``message_ends`` checkpoints), as their text families do."""
    sys_end = cur.spans[0].token_end
    shared = min(_common(prev.ids, cur.ids), len(cur.ids) - 1)
    if case == "other image":
        shared = min(shared, cur.images[0].token_start)
        if store == "disk":  # an entry keyed with images serves only as a whole prefix (DiskStore):
            prev, shared = text, _common(text.ids, cur.ids)  # the text-only entry is what is left
    if store == "system":  # keeps the system prompt only
        return sys_end
    if FAMILY[arch] == "dense":
        return _rounded(shared, BLOCK) if store == "paged" else shared
    stops = [s.token_end for s in prev.spans] + [len(prev.ids)]
    at = max(s for s in stops if s <= shared)
    if store == "paged":
        # paged checkpoints sit at block ends; it holds none of gemma4's window of 32 at a block end
        # before the window fills (refused, see _refusal), as for tiny:gemma4_text
        at = _rounded(at, BLOCK)
        return 0 if arch == "gemma4" and at < 32 else at
    if store == "mlx-lru" and case == "other image":
        # mlx-lm's LRU finds the longer entry of the other image, cannot trim it, and does not fall
        # back to a shorter checkpoint (refused, see _refusal)
        return 0
    return at


@pytest.mark.parametrize("store", STORES)
def test_every_store_reuses_exactly_and_never_past_another_image(vlm, store, tmp_path):
    """Mutants caught: image hashes dropped from the keys (case c reuses through the other image,
    verify_diff > 3); a restored recurrent/window state served past where it was taken (verify)."""
    engine = kv.Engine(vlm, kv.stores.make_store(store, budget_bytes=64 << 20, disk_path=tmp_path / store,
                                                 model=vlm), verify=True)
    seen = {}
    cases = [("first", _text("Name a colour."), None), ("text", _text("Name a fruit, please."), "first"),
             ("image", _msgs(_image(1)), None), ("same image", _next_turn(_msgs(_image(1))), "image"),
             ("other image", _msgs(_image(2)), "same image")]
    got, want = {}, {}
    for case, msgs, prev in cases:
        toks = kv.tokenise(vlm, msgs)
        r = engine.run(toks, max_tokens=2)
        assert r.verify_diff <= LOGIT_TOL, (case, r.verify_diff)
        if prev is not None:
            got[case], want[case] = r.reused_tokens, _expected(vlm.arch, store, case, seen[prev], toks,
                                                                  seen.get("text"))
            if want[case] == 0:
                assert _refusal(r.why), (case, r.why)
        seen[case] = toks
    assert got == want
    image = seen["same image"].images[0]
    if store != "system":  # (b) reuses through the image
        assert got["same image"] >= _rounded(image.token_end, BLOCK)
    assert got["other image"] <= seen["other image"].images[0].token_start


def _refusal(why: str) -> bool:
    """A reason that names the layer (or mlx-lm's cache) that prevents reuse."""
    return "layer 0" in why or "not trimmable" in why


@pytest.mark.parametrize("store", ["radix", "paged"])
def test_ids_only_keys_replay_the_wrong_image(vlm, store):
    """The seed's pitfall (vllm-mlx#718): identical ids, another image. With image_keys=False the
    store replays image A's KV for image B and the logits move by > WRONG_KV_MIN; with image keys
    (test above) reuse stops at the placeholders and matches cold."""
    a, b = kv.tokenise(vlm, _msgs(_image(10))), kv.tokenise(vlm, _msgs(_image(11)))
    assert a.ids == b.ids and a.images[0].hash != b.images[0].hash
    engine = kv.Engine(vlm, kv.stores.make_store(store, budget_bytes=64 << 20), image_keys=False, verify=True)
    engine.run(a, max_tokens=1)
    r = engine.run(b, max_tokens=1)
    assert r.reused_tokens == len(b.ids) - 1  # a snapshot at the prompt end minus one (or its checkpoint)
    assert r.verify_diff > WRONG_KV_MIN


# -- never restored inside an image whose tokens see each other ----------------------------------

def _short(image, question):
    return [{"role": "system", "content": "Hi."},
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]


@pytest.mark.parametrize("arch", ["gemma4", "qwen2_vl"])
def test_reuse_core_cuts_a_match_inside_a_bidirectional_image_back_to_its_start(arch):
    """A store answer that ends inside an image (the core's ``limit``, as the served path passes
    it, at image start + 3): gemma4 restores exactly up to token_start, recording why (a
    ``refused`` row for the 3 tokens, naming the image); causal qwen2_vl restores all of it. Both
    then match cold. A 25-token prompt, so gemma4's window of 32 has not wrapped and can be cut.
    Mutant caught: the core without the model's restorable_limit (gemma4 restores 14 tokens with
    no reason recorded, and RequestModel then refuses the rest: "cannot prefill from 14: position
    14 is inside image 0 ..."; without that refusal too, nothing would stop a cache cut inside an
    image that a chunk ending there produced: 3.8 off, see the two-piece test)."""
    from kvlab.keys import cache_key
    from kvlab.reuse import PrefixCache

    vlm = kv.load(f"tiny-vlm:{arch}")
    toks = kv.tokenise(vlm, _short(_image(3), "What?"))
    (im,) = toks.images
    assert (len(toks.ids), im.token_start, im.token_end) == (25, 11, 17)
    rows = []
    core = PrefixCache(kv.RadixStore(), vlm, emit=lambda *row, **extra: rows.append(row))
    cold, cache = vlm.prefill(toks, all_logits=True)
    key = cache_key(toks)
    core.offer(1, key, toks, kv.snapshot(cache, tokens=toks.ids, model=vlm))
    core.drain(1, key)
    found = core.lookup(2, key, toks, limit=14)
    why = ("position 14 is inside image 0 (tokens 11:17): gemma4 attends bidirectionally within an image; "
           "restore at or before token_start 11")
    if arch == "gemma4":
        assert (found.reused, found.refused, found.why) == (11, 3, why)
        assert [r[1:] for r in rows if r[0] == 2 and r[1] in ("refused", "hit")] == [
            ("refused", 3, 0, 2, why), ("hit", 11, 0, 2, "exact")]
        assert {k: v for k, v in found.missed.reasons.items() if v} == {"partial_block": 1, "not_trimmable": 13}
    else:
        assert (found.reused, found.refused, found.why) == (14, 0, "")
    warm, _ = vlm.prefill(toks, found.cache, all_logits=True)
    assert float(mx.abs(warm - cold[found.reused:]).max()) <= LOGIT_TOL


def test_engine_checkpoints_skip_the_inside_of_a_bidirectional_image():
    """gemma4 with a checkpoint every 4 tokens: the stops 12 and 16 fall inside the image (11:17)
    and are skipped (the prefill runs 8:20 in one chunk), every other stop is taken. The next
    request (same ids, another image) reuses exactly up to the image's token_start 11 (the stop
    at 20, cut back: its window of 32 has not wrapped), so the whole other image runs on top of
    a restored cache, and matches cold.
    Mutants caught: the engine's stops not filtered (ImageError: "a chunk 8:12 ends inside image
    0"); ImageBlockMask dropped (mlx-vlm's overlay is lost on top of a cached prefix: verify_diff
    0.56)."""
    vlm = kv.load("tiny-vlm:gemma4")
    engine = kv.Engine(vlm, kv.RadixStore(), checkpoints="every:4", verify=True)
    long = "What? Describe the colours, the shapes and the light of it in a few plain words."
    a, b = kv.tokenise(vlm, _short(_image(3), long)), kv.tokenise(vlm, _short(_image(4), long))
    assert (a.images[0].token_start, a.images[0].token_end) == (11, 17)
    engine.run(a, max_tokens=1)
    ev = engine.events
    stops = ev.filter((ev["event"] == "offer") & (ev["detail"] == "checkpoint"))["tokens"].to_list()
    assert len(a.ids) > 32 and stops == list(range(4, len(a.ids), 4))[:2] + list(range(20, len(a.ids), 4))
    r = engine.run(b, max_tokens=1)
    assert a.ids == b.ids and a.images[0].hash != b.images[0].hash
    assert r.reused_tokens == 11
    assert r.verify_diff <= LOGIT_TOL


def test_a_bidirectional_image_across_a_prefill_chunk_runs_in_one_chunk(monkeypatch):
    # a prompt whose image straddles a PREFILL_STEP boundary: kvlab's prefill lengthens that chunk
    # to the image's end (RequestModel.chunk_length), so gemma4 runs and equals one pass; qwen2_vl
    # (causal over images) keeps the plain chunks. Mutant: chunks() ignoring chunk_length -> gemma4
    # raises "a chunk 0:24 ends inside image 0".
    from kvlab.primitives import snapshots

    for arch in ("gemma4", "qwen2_vl"):
        m = kv.load(f"tiny-vlm:{arch}")
        toks = kv.tokenise(m, _msgs(_image(3)))
        im = toks.images[0]
        one_pass, _ = prefill(m.for_request(toks), toks.ids)
        step = im.token_start + 2  # the first chunk would end two tokens into the image
        monkeypatch.setattr(snapshots, "PREFILL_STEP", step)
        net = m.for_request(toks)
        spans = list(snapshots.chunks(net, len(toks.ids) - 1, m.make_cache()))
        first = (0, im.token_end) if arch == "gemma4" else (0, step)
        assert spans[0] == first, (arch, spans)
        chunked, _ = prefill(net, toks.ids)
        assert float(mx.abs(chunked - one_pass).max()) <= LOGIT_TOL, arch
        monkeypatch.undo()
