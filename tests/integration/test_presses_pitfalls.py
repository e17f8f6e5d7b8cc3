"""Each known failure of KV-cache eviction on MLX, as a test that fails on it (the mutant is named
in each test; those marked "caught" were run and fail). The exact oracle itself is in test_presses_oracle.py,
the cache class without a model in tests/unit/test_kept_cache.py.
"""

import mlx.core as mx
import numpy as np
import pytest

import kvlab as kv
from kvlab.errors import PressError
from kvlab.models import attention
from kvlab.presses import continue_logits, oracle_logits
from kvlab.presses.apply import apply_press, full_layers, ropes_of
from kvlab.presses.capture import Capture
from kvlab.presses.compress import Prefilled
from kvlab.primitives.kept_cache import KeptKVCache, QuantizedKeptKVCache
from kvlab.primitives.kv_format import maybe_quantize
from kvlab.primitives.snapshots import prefill, restore
from kvlab.primitives.tolerance import tolerance

pytestmark = pytest.mark.model


def ids_of(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1000, 20000, n).tolist()


def plain(m, ids, *blocks):
    """Logits of ``blocks`` after ``ids`` on an uncompressed cache, one forward per block."""
    _, cache = prefill(m, ids)
    return mx.concatenate([prefill(m, list(b), cache, all_logits=True)[0] for b in blocks], axis=0)


def test_ratio_zero_is_bit_identical_to_no_press(tiny):
    # mutant caught: a budget that drops a row at ratio 0 (int(T * (1 - r)) - 1), or a kept cache
    # that reorders or re-rotates rows (its offset or mask differing from KVCache's)
    ids, question = ids_of(150), ids_of(5, 1)
    want = plain(tiny, ids, question, [7])
    grid = [kv.press(n, 0.0) for n in ("knorm", "streaming_llm", "expected_attention")] + [
        kv.press("snapkv", 0.0, window_size=16), kv.press("adakv", 0.0, press="knorm"),
        kv.press("chunkkv", 0.0, press="knorm"), kv.press("pyramid", 0.0, window_size=16,
                                                          press=kv.press("snapkv", 0.0, window_size=16))]
    pre = Prefilled(tiny, ids, grid)
    for press in grid:
        c = pre.compress(press)
        assert isinstance(c.cache[0], KeptKVCache) and c.kept_tokens == 150, press.key
        assert mx.array_equal(continue_logits(tiny, c, question, [7]), want), press.key


def one_forward(m, ids, press):
    """kvpress's way, as the reference: ``with press(model): model(input_ids)``, one forward over
    the whole prompt, then the press."""
    cache = m.make_cache()
    layers = full_layers(cache)
    cap = Capture({id(c): i for i, _, c in layers}, press.needs, ropes_of(m.net, layers))
    with attention.wrapping(cap):
        mx.eval(m.net(mx.array(ids)[None], cache=cache))
    return apply_press(press, cache, cap, layers)[0]


@pytest.mark.parametrize("name", ["snapkv", "observed_attention", "expected_attention"])
def test_prefill_step_does_not_change_what_is_kept(tiny, name):
    # 603 tokens (not a multiple of 32) in steps of 32 (the 64-query window spans three steps and
    # the last token's own), 512 and 4096, each against one forward over the whole prompt.
    # Mutants caught: the window taken from the last step only (the capture overwriting instead of
    # concatenating); attention sums or query statistics of the last step only
    ids, question = ids_of(603), ids_of(5, 1)
    press = kv.press(name, 0.5)
    want = one_forward(tiny, ids, press)
    runs = [kv.compress(tiny, ids, press, step=s) for s in (32, 512, 4096)]
    for c in runs:
        assert all(mx.array_equal(a, b) for a, b in zip(want, c.kept))
    logits = [continue_logits(tiny, c, question) for c in runs]
    assert all(float(mx.abs(x - logits[0]).max()) <= tolerance(tiny) for x in logits[1:])


@pytest.mark.parametrize("name", ["knorm", "snapkv", "tova"])
def test_last_prefill_logits_are_the_uncompressed_models(tiny, name):
    # mutant caught: evicting inside the prefill step, before the step's queries attend to the keys
    # it produced (the last logits change; with eviction inside a multi-token step the keys are no
    # longer contiguous under the "causal" fast path, which corrupts attention silently)
    ids = ids_of(333)
    want, _ = prefill(tiny, ids)
    c = kv.compress(tiny, ids, kv.press(name, 0.75, **({"window_size": 32} if name == "snapkv" else {})))
    assert mx.array_equal(c.context_logits, want) and mx.array_equal(c.logits, want)


def test_context_end_compresses_the_context_and_runs_the_question_at_its_true_positions(tiny):
    # kvpress's pipeline: the question is not in the compressed part (which "artificially favors
    # SnapKV" otherwise); mutant caught: the question run before compressing (the window would be
    # the question's) or at positions starting from the kept row count
    ids, question = ids_of(200), ids_of(8, 2)
    press = kv.press("snapkv", 0.5, window_size=16)
    c = kv.compress(tiny, ids + question, press, context_end=200)
    alone = kv.compress(tiny, ids, press)
    assert c.tokens == 200 and all(mx.array_equal(a, b) for a, b in zip(c.kept, alone.kept))
    assert float(mx.abs(c.logits - continue_logits(tiny, alone, question)[-1]).max()) <= 1e-5
    assert c.cache[1].offset == 208 and c.cache[1].rows == 100 + 8


def test_sliding_recurrent_and_chunked_layers_are_left_and_said_so(family):
    # mutant caught: compressing a RotatingKVCache or a ChunkedKVCache as if it were full KV
    # (its rows are a window, not positions 0..T-1)
    for name, left in (("gemma3_text", "sliding window of 32"), ("qwen3_5", "recurrent state (ArraysCache)"),
                       ("llama4", "chunked attention of 32")):
        m = family(name)
        c = kv.compress(m, ids_of(120), kv.press("knorm", 0.5))
        others = tuple(i for i, kind in enumerate(m.layout.kinds) if kind != "full")
        assert others and c.layers_left == tuple((i, left) for i in others), (name, c.layers_left)
        assert sorted(c.layers_compressed + tuple(i for i, _ in c.layers_left)) == list(range(len(c.cache)))
        assert all(c.kept[i] is None for i, _ in c.layers_left)


def test_cache_list_parts_are_compressed_part_by_part(family):
    m = family("falcon_h1")
    ids, question = ids_of(120), ids_of(5, 3)
    pre = Prefilled(m, ids, [kv.press("knorm", 0.5)])
    c = pre.compress(kv.press("knorm", 0.5))
    assert c.layers_compressed == tuple(range(len(c.cache)))
    assert all(isinstance(layer.caches[1], KeptKVCache) and type(layer.caches[0]).__name__ == "ArraysCache"
               for layer in c.cache)
    got = continue_logits(m, c, question, [9])
    assert mx.array_equal(got, oracle_logits(m, c, question, [9], full=pre.snapshot, gather=True))


def test_quantized_kv_is_compressed_then_quantized(smol):
    # mutants caught: quantizing before scoring (the kept set follows the quantized keys), leaving
    # the compressed layers in float, or a quantized kept cache whose appended rows, offset or mask
    # differ from mlx-lm's QuantizedKVCache (ratio 0 must continue exactly as mlx-lm's does)
    ids, question = ids_of(90), ids_of(4, 4)
    press, keep_all = kv.press("knorm", 0.5), kv.press("knorm", 0.0)
    pre = Prefilled(smol, ids, [press])
    flt, q4 = pre.compress(press), pre.compress(press, kv_bits=4, kv_group_size=64)
    assert all(isinstance(c, QuantizedKeptKVCache) and (c.bits, c.group_size) == (4, 64) for c in q4.cache)
    assert all(mx.array_equal(a, b) for a, b in zip(flt.kept, q4.kept))
    packed = mx.quantize(flt.cache[3].keys_and_values()[0], group_size=64, bits=4)
    assert all(mx.array_equal(a, b) for a, b in zip(packed, q4.cache[3].keys_and_values()[0]))
    assert q4.bytes_kept < flt.bytes_kept / 3
    whole = pre.compress(keep_all, kv_bits=4, kv_group_size=64)
    cache = maybe_quantize(restore(pre.snapshot), 4, 64, 0)
    want = prefill(smol, question, cache, all_logits=True)[0]
    assert mx.array_equal(continue_logits(smol, whole, question), want)


def test_bad_input_gets_kvlab_errors_that_say_what_to_do(tiny, family):
    with pytest.raises(PressError, match="has no full-attention layer .*would compress nothing"):
        kv.compress(family("mamba2"), ids_of(40), kv.press("knorm", 0.5))
    with pytest.raises(PressError, match="compress takes a press|made with kv.press"):
        kv.compress(tiny, ids_of(40), "knorm")
    with pytest.raises(PressError, match="not more than its window of 64"):
        kv.compress(tiny, ids_of(40), kv.press("snapkv", 0.5))
    # a query-aware press on a layer whose attention kvlab cannot read (the dispatcher removed,
    # as for attention code that does not go through mlx-lm's scaled_dot_product_attention)
    attention.uninstall()
    try:
        with pytest.raises(PressError, match="needs the window's queries on layer 0.*query-agnostic press"):
            kv.compress(tiny, ids_of(100), kv.press("snapkv", 0.5, window_size=16))
    finally:
        attention.install()
    with pytest.raises(kv.errors.RequestError, match="context_end must be an int in 1..40"):
        kv.compress(tiny, ids_of(40), kv.press("knorm", 0.5), context_end=41)


def test_a_restored_compressed_cache_continues_exactly(tiny, tmp_path):
    # save/load and snapshot/restore of a compressed cache give bit-identical continuations
    c = kv.compress(tiny, ids_of(150), kv.press("knorm", 0.5))
    snap = kv.snapshot(c.cache, model=tiny)
    path = kv.save(snap, tmp_path / "c.safetensors", model=tiny)
    loaded = kv.load_snapshot(path, tiny)
    question = ids_of(5, 5)
    a = prefill(tiny, question, restore(snap), all_logits=True)[0]
    b = prefill(tiny, question, restore(loaded), all_logits=True)[0]
    assert mx.array_equal(a, b) and mx.array_equal(a, continue_logits(tiny, c, question))
