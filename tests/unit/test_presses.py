"""Presses without a model: each rule on a synthetic layer (kvlab.presses.base.View) with known
answers, kvpress's budget arithmetic, and kvlab's errors.

Mutants caught (each was run and fails here): knorm keeping the highest norms (mlx-lm #963);
n_kept rounding up (ceil) or without kvpress's max(1, ...); streaming_llm dropping its sinks;
snapkv without the window kept, without pooling, or averaging over all heads instead of each GQA
group; lagkv with numpy's std (ddof=0); tova scoring per head; adakv pruning per head instead of
across heads; chunkkv keeping rows instead of whole chunks; a press key that ignores an option (two
settings would share a store entry).
"""

import kvlab  # noqa: F401  (OpenBLAS before mlx)

import math

import mlx.core as mx
import numpy as np
import pytest

import kvlab as kv
from kvlab.errors import PressError
from kvlab.presses.attention_scorers import avg_pool
from kvlab.presses.base import View, n_kept
from kvlab.presses.capture import attention_sums, future_rotation, undo_rope

H, HQ, S, D = 2, 4, 40, 8


def view(seed=0, rows=S, queries=None, attention=None, layer=0, n_layers=4) -> View:
    rng = np.random.default_rng(seed)
    keys = mx.array(rng.standard_normal((H, rows, D)).astype(np.float32))
    values = mx.array(rng.standard_normal((H, rows, D)).astype(np.float32))
    positions = mx.broadcast_to(mx.arange(rows, dtype=mx.int32), (H, rows))
    return View(layer, n_layers, keys, values, positions, rows, D ** -0.5, queries, attention)


def test_budget_is_kvpress_int_of_the_kept_fraction_at_least_one():
    assert [n_kept(600, r) for r in (0.0, 0.25, 0.5, 0.75)] == [600, 450, 300, 150]
    assert n_kept(7, 0.5) == 3 and n_kept(3, 0.9) == 1  # int() truncates; never zero


def test_knorm_keeps_the_lowest_key_norms_per_head():
    v = view()
    rows = kv.press("knorm", 0.75).select(v)
    norms = np.linalg.norm(np.array(v.keys), axis=-1)
    for h in range(H):
        assert rows[h].tolist() == sorted(np.argsort(norms[h])[:10].tolist())


def test_streaming_llm_keeps_sinks_and_the_most_recent():
    rows = kv.press("streaming_llm", 0.5).select(view())
    assert rows[0].tolist() == [0, 1, 2, 3] + list(range(24, 40)) and rows[1].tolist() == rows[0].tolist()


def test_ratio_zero_keeps_every_row_in_order():
    for name in ("knorm", "snapkv", "random"):
        assert kv.press(name, 0.0).select(view()).tolist() == [list(range(S))] * H


def test_snapkv_pools_window_attention_per_gqa_group_and_keeps_the_window():
    rng = np.random.default_rng(1)
    q = mx.array(rng.standard_normal((HQ, 8, D)).astype(np.float32))
    v = view(queries=q)
    press = kv.press("snapkv", 0.5, window_size=8, kernel_size=5)
    scores = press.score(v)
    # by hand: softmax of each window query over the keys it may see, mean over the window,
    # avg_pool1d(5, padding 2), mean over the 2 query heads of each KV head
    k, qn = np.repeat(np.array(v.keys), 2, axis=0), np.array(q)
    logits = qn @ k.transpose(0, 2, 1) * D ** -0.5
    qpos, kpos = np.arange(S - 8, S)[:, None], np.arange(S)[None]
    logits = np.where(kpos <= qpos, logits, -np.inf)
    att = np.exp(logits - logits.max(-1, keepdims=True))
    att = (att / att.sum(-1, keepdims=True))[..., : S - 8].mean(1)
    padded = np.pad(att, ((0, 0), (2, 2)))
    pooled = np.stack([padded[:, i: i + 5].mean(-1) for i in range(S - 8)], axis=1)
    want = pooled.reshape(H, 2, -1).mean(1)
    assert np.allclose(np.array(scores[:, : S - 8]), want, atol=1e-6)
    assert np.allclose(np.array(scores[:, S - 8:]), want.max() + 1)  # the window is kept, above every row
    assert set(range(S - 8, S)) <= set(press.select(v)[0].tolist())


def test_avg_pool_matches_torch_semantics():
    x = mx.array([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    assert np.allclose(np.array(avg_pool(x, 3)), [[1.0, 2.0, 3.0, 4.0, 5.0, 11 / 3]])


def test_tova_uses_the_last_query_averaged_over_all_heads():
    rng = np.random.default_rng(2)
    q = mx.array(rng.standard_normal((HQ, 1, D)).astype(np.float32))
    rows = kv.press("tova", 0.5).select(view(queries=q))
    assert rows[0].tolist() == rows[1].tolist() and S - 1 in rows[0].tolist()


def test_observed_attention_averages_each_group_of_the_normalised_sums():
    rng = np.random.default_rng(3)
    att = mx.array(rng.random((HQ, S)).astype(np.float32))
    scores = kv.press("observed_attention", 0.5).score(view(attention=att))
    assert np.allclose(np.array(scores), np.array(att).reshape(H, 2, S).mean(1))


def test_attention_sums_are_causal_softmax_sums():
    rng = np.random.default_rng(4)
    q = mx.array(rng.standard_normal((HQ, 5, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((H, 12, D)).astype(np.float32))
    got = np.array(attention_sums(q, k, 0.3, 7))
    logits = np.array(q) @ np.repeat(np.array(k), 2, 0).transpose(0, 2, 1) * 0.3
    logits = np.where(np.arange(12)[None] <= np.arange(7, 12)[:, None], logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    assert np.allclose(got, (w / w.sum(-1, keepdims=True)).sum(1), atol=1e-5)


def test_lagkv_scores_each_partition_against_the_next_with_torch_unbiased_std():
    v = view(rows=4 + 3 * 8)
    scores = np.array(kv.press("lagkv", 0.5, lag_size=8).score(v))
    assert scores.shape == (H, 28) and (scores[:, :4] == 1).all() and (scores[:, -8:] == 1).all()
    assert sorted(scores[0, 4:12].tolist()) == [i / 8 for i in range(8)]  # ranks within a partition
    raw = np.array(kv.press("lagkv", 0.5, lag_size=8, cross_scoring=True).score(v))[:, 4:20]

    def spread(x):  # kvpress's _get_states_score with torch's std (unbiased)
        parts = x[:, 4:28].reshape(H, 3, 8, D)
        ref, cur = parts[:, 1:], parts[:, :-1]
        lo, hi = ref.min(-2, keepdims=True), ref.max(-2, keepdims=True)
        z = ((cur - lo) / (hi - lo)).std(-1, ddof=1)
        e = np.exp(z - z.max(-1, keepdims=True))
        return (e / e.sum(-1, keepdims=True)).reshape(H, -1)

    want = (spread(np.array(v.keys)) + spread(np.array(v.values))) / 2
    assert np.allclose(raw, want, atol=1e-6)


def test_keydiff_keeps_keys_least_like_the_mean_direction():
    v = view()
    k = np.array(v.keys)
    unit = k / np.linalg.norm(k, axis=-1, keepdims=True)
    anchor = unit.mean(1, keepdims=True)
    cos = (k * anchor).sum(-1) / (np.linalg.norm(k, axis=-1) * np.linalg.norm(anchor, axis=-1))
    rows = kv.press("keydiff", 0.5).select(v)
    assert rows[0].tolist() == sorted(np.argsort(cos[0])[:20].tolist())


def test_adakv_prunes_across_heads_and_keeps_the_layer_total():
    v = view()
    rows = kv.press("adakv", 0.5, press="knorm").select(v)
    used = np.array(rows) >= 0
    assert used.sum() == H * n_kept(S, 0.5) and used.sum(1).tolist() != [20, 20]  # head-wise budgets
    assert rows.shape == (H, S)  # rows stay in place: pruned ones masked (-1), as kvpress's
    compact = kv.press("adakv", 0.5, press="knorm", compact=True).select(v)
    assert compact.shape[1] == int(used.sum(1).max())


def test_chunkkv_keeps_whole_chunks_for_every_head():
    rows = kv.press("chunkkv", 0.5, press="knorm", chunk_length=8).select(view())
    chunks = {r // 8 for r in rows[0].tolist()}
    assert rows[0].tolist() == rows[1].tolist() and len(chunks) == 2 and len(rows[0].tolist()) == 16


def test_pyramid_gives_low_layers_more_rows():
    press = kv.press("pyramid", 0.5, window_size=4)
    budgets = [press.budget(view(rows=400, layer=i, n_layers=4)) for i in range(4)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]
    assert abs(sum(budgets) / 4 - 200) <= 1  # the same total as every layer at 0.5


def test_composed_and_per_layer_derive_their_ratio():
    c = kv.press("composed", presses=[kv.press("streaming_llm", 0.5), kv.press("knorm", 0.5)])
    assert math.isclose(c.ratio, 0.75) and not c.query_aware
    assert len(c.select(view())[0].tolist()) == 10
    p = kv.press("per_layer", press="knorm", ratios=[0.25, 0.75])
    assert p.ratio == 0.5 and p.select(view(layer=1, n_layers=2)).shape == (H, 10)
    with pytest.raises(PressError, match="2 ratios but the model has 4 layers"):
        p.select(view(layer=1, n_layers=4))


def test_a_function_press_checks_its_scores_and_keys_by_its_code():
    def big_values(keys, values, queries):
        return mx.linalg.norm(values, axis=-1)

    def small_values(keys, values, queries):
        return -mx.linalg.norm(values, axis=-1)

    a, b = kv.presses.from_function(big_values, 0.5), kv.presses.from_function(small_values, 0.5)
    assert a.key != b.key and not a.query_aware and kv.presses.from_function(big_values, 0.5, window=4).query_aware
    assert a.select(view()).shape == (H, 20)
    with pytest.raises(PressError, match=r"shape \[heads, rows\]"):
        kv.presses.from_function(lambda k, v, q: mx.zeros((3,)), 0.5).select(view())


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, "0.5", True])
def test_a_ratio_outside_zero_to_one_is_refused(ratio):
    with pytest.raises(PressError, match=r"must be in \[0, 1\)"):
        kv.press("knorm", ratio)


def test_unknown_press_and_option_errors_name_the_choices():
    with pytest.raises(PressError, match="unknown press 'h2o'; kvlab has random, streaming_llm, knorm"):
        kv.press("h2o", 0.5)
    with pytest.raises(PressError, match="snapkv has no option window; its options are"):
        kv.press("snapkv", 0.5, window=8)
    with pytest.raises(PressError, match="needs a ratio"):
        kv.press("knorm")
    with pytest.raises(PressError, match="needs the window's queries"):
        kv.press("snapkv", 0.5, window_size=4).select(view())


def test_repr_and_key_say_the_rule_and_whether_it_reads_the_question():
    snap, knorm = kv.press("snapkv", 0.5, window_size=32), kv.press("knorm", 0.25)
    assert repr(knorm) == "knorm(ratio=0.25): keeps the rows with the lowest key norms · query-agnostic"
    assert repr(snap).endswith("query-aware") and "window_size=32" in snap.key
    assert snap.key != kv.press("snapkv", 0.5, window_size=64).key and not snap.reusable and knorm.reusable
    assert kv.presses.names()[:9] == ("random", "streaming_llm", "knorm", "snapkv", "expected_attention", "tova",
                                      "observed_attention", "keydiff", "lagkv")
    assert kv.presses.names()[9:15] == ("pyramid", "chunkkv", "adakv", "composed", "per_layer", "decoding")
    assert "<b>snapkv</b>" in snap._repr_html_()


def test_rope_is_undone_exactly_and_its_future_mean_is_a_rotation_average():
    import mlx.nn as nn

    rope = nn.RoPE(D, traditional=False, base=10000)
    q = mx.random.normal((1, 3, 5, D), key=mx.random.key(0))
    assert float(mx.abs(undo_rope(rope, rope(q, offset=17), 17) - q).max()) < 1e-5
    r = future_rotation(rope, D, 17, 4)
    want = sum(np.array(rope(mx.eye(D)[None, :, None, :], offset=17 + i))[0, :, 0, :].T for i in range(4)) / 4
    assert np.allclose(np.array(r), want, atol=1e-6)
