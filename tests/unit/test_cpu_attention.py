"""kvlab.models.cpu_attention against MLX's own attention, on arrays (no model).

TOL = 1e-5 absolute on outputs of magnitude ~1 (values drawn from N(0, 1)): both compute in
float32; the differences are the order of the additions in the two products and the softmax sum,
and kvlab's exp against MLX's (both ~1 ulp); measured <= 1e-6. A wrong mask, head or offset moves
outputs by 1e-2 or more.

Each test names the broken kernels (mutants) it catches; each was run against the kernel.
"""

import kvlab  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx
import numpy as np
import pytest

from kvlab.models import attention_kernel, cpu_attention
from kvlab.models.cpu_attention import attention, covers, mlx_attention

TOL = 1e-5
RNG = np.random.default_rng(0)


def _arr(*shape, dtype=mx.float32):
    return mx.array(RNG.standard_normal(shape).astype(np.float32)).astype(dtype)


def _qkv(B, Hq, Hk, L, S, D, dtype=mx.float32):
    return _arr(B, Hq, L, D, dtype=dtype), _arr(B, Hk, S, D, dtype=dtype), _arr(B, Hk, S, D, dtype=dtype)


def _diff(q, k, v, mask=None, sinks=None, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    assert covers(q, k, v, mask, sinks)  # the kernel computes it, not the fallback
    got = np.asarray(attention(q, k, v, scale=scale, mask=mask, sinks=sinks))
    want = np.asarray(mlx_attention(q, k, v, scale=scale, mask=mask, sinks=sinks))
    assert np.array_equal(np.isnan(got), np.isnan(want))
    return float(np.nanmax(np.abs(got - want))) if not np.isnan(want).all() else 0.0


def _causal(L, S, window=None):
    rows, cols = np.arange(S - L, S)[:, None], np.arange(S)[None]
    keep = rows >= cols
    if window is not None:
        keep &= rows < cols + window
    return mx.array(keep)


# Mutants: a causal diagonal off by one (a row not seeing itself, or seeing the next key); the
# causal offset taken as 0 when a cached prefix makes S > L (the decode step and the second chunk);
# GQA heads mapped h % Hk instead of h // rep; block skipping that drops the last partial block.
@pytest.mark.parametrize("B,Hq,Hk,L,S,D", [
    (1, 9, 3, 37, 37, 64),     # SmolLM2's heads, odd length, one block
    (1, 9, 3, 300, 300, 64),   # several query blocks, a partial last one
    (1, 4, 2, 131, 300, 16),   # a cached prefix of 169 keys, tiny head dim (odd D tail: none)
    (2, 6, 1, 1, 77, 24),      # a one-token decode step, batch 2, multi-query
    (1, 3, 3, 5, 5, 10),       # no GQA, a head dim not a multiple of 4
])
def test_causal_and_no_mask_match_mlx(B, Hq, Hk, L, S, D):
    q, k, v = _qkv(B, Hq, Hk, L, S, D)
    assert _diff(q, k, v, "causal") <= TOL
    assert _diff(q, k, v, None) <= TOL


# Mutants: a boolean mask's hidden scores set to -inf rather than float32's lowest (a row hiding
# every key then gives NaN where MLX averages every value); a mask of shape [L, S] or [H, 1, S]
# read as if it were [B, H, L, S] (its broadcast dimensions ignored); a per-head mask read at head
# 0 for every head; the visible range of a windowed row taken from the first row of the block.
@pytest.mark.parametrize("shape", ["LS", "1LS", "BHLS", "H1S", "11S"])
def test_boolean_masks_of_every_broadcast_shape_match_mlx(shape):
    B, Hq, Hk, L, S, D = 2, 4, 2, 29, 45, 16
    q, k, v = _qkv(B, Hq, Hk, L, S, D)
    full = np.broadcast_to(np.asarray(_causal(L, S, window=8)), (B, Hq, L, S)).copy()
    full[1, 2] = RNG.random((L, S)) > 0.4  # another head, another pattern
    full[0, :, 3] = False  # a row that sees nothing
    picks = {"LS": full[0, 0], "1LS": full[0, :1], "BHLS": full, "H1S": full[0, :, :1], "11S": full[0, :1, :1]}
    mask = mx.array(np.ascontiguousarray(picks[shape]))
    assert _diff(q, k, v, mask) <= TOL


# Mutants: an additive mask applied as a boolean one (its finite biases dropped); -inf entries
# not given probability 0; a row of -inf not NaN as MLX's softmax makes it; a float16 mask not
# converted before it is read.
def test_additive_masks_match_mlx():
    B, Hq, Hk, L, S, D = 1, 4, 2, 29, 45, 16
    q, k, v = _qkv(B, Hq, Hk, L, S, D)
    assert _diff(q, k, v, _arr(L, S)) <= TOL
    assert _diff(q, k, v, _arr(Hq, L, S).astype(mx.float16)) <= TOL
    window = mx.where(_causal(L, S, window=8), 0.0, -mx.inf)
    assert _diff(q, k, v, window) <= TOL
    dead = np.zeros((L, S), np.float32)
    dead[4] = -np.inf
    assert _diff(q, k, v, mx.array(dead)) <= TOL  # row 4 is NaN in both (checked in _diff)


# Mutants: sinks ignored; a sink added to the numerator as if it were a key with a value; the
# sink of head 0 used for every head. A sink far above the scores takes every probability (0 out,
# not NaN). Leaving the sink out of the row's max survives: softmax does not depend on the shift,
# and where the sink overflows exp both give 0.
@pytest.mark.parametrize("mask", [None, "causal", "window"])
def test_attention_sinks_match_mlx(mask):
    B, Hq, Hk, L, S, D = 1, 8, 2, 40, 64, 32
    q, k, v = _qkv(B, Hq, Hk, L, S, D)
    m = _causal(L, S, window=16) if mask == "window" else mask
    assert _diff(q, k, v, m, sinks=_arr(Hq) * 3) <= TOL
    assert _diff(q, k, v, m, sinks=_arr(Hq) + 200) <= TOL


# Mutant: kvlab's kernel run on half-precision inputs in float32 (MLX rounds the scores and the
# probabilities to bfloat16 there: results differ by ~1e-2): those calls are MLX's, bit for bit,
# as are masks MLX refuses and calls traced by mx.compile (whose arrays cannot be read).
def test_what_the_kernel_does_not_cover_is_mlx_itself():
    for dtype in (mx.bfloat16, mx.float16):
        q, k, v = _qkv(1, 4, 2, 9, 9, 16, dtype=dtype)
        assert not covers(q, k, v, "causal")
        assert mx.array_equal(attention(q, k, v, scale=0.25, mask="causal"),
                              mlx_attention(q, k, v, scale=0.25, mask="causal"))
    q, k, v = _qkv(1, 4, 2, 9, 5, 16)
    assert not covers(q, k, v, "causal")  # more queries than keys
    assert not covers(q, k, v, mx.ones((2, 4, 9, 5), mx.bool_))  # does not broadcast to B=1
    compiled = mx.compile(lambda a, b, c: attention(a, b, c, scale=0.25, mask=None))
    assert mx.allclose(compiled(q, k, v), mlx_attention(q, k, v, scale=0.25), atol=TOL)


# Mutants: the exp polynomial with a coefficient changed, Cody-Waite's reduction in place of MLX's
# (a more accurate exp, but no longer MLX's: probabilities differ in the last bits), values below
# -88 not exactly 0.
def test_the_vectorised_exp_is_mlx_exp_to_the_bit():
    x = np.concatenate([np.linspace(-100, 0, 400_001), -RNG.exponential(10, 100_000), [-1e30, -np.inf]])
    x = x.astype(np.float32)
    got = x.copy()
    total = attention_kernel.exp_in_place(got)
    want = np.asarray(mx.exp(mx.array(x)))
    assert np.array_equal(got, want)
    assert np.all(got[x < -88] == 0)
    assert abs(total - want.astype(np.float64).sum()) <= 1e-5 * want.sum()


# Mutant caught: a few-row call (a decode step) scoring its keys with the additions in another
# order than a block against the transposed keys (one dot product per key: 1e-6 apart, within
# TOL of MLX, but not the same bits). A row's output then depends on how the prompt was split,
# so a prompt prefilled in two pieces or run a step at a time would drift from a single pass
# (cached against cold). Two mutants run here survive because LLVM's reassociation already sums
# each row's keys one after another: grouping eight keys from the block's own first key instead
# of fixed positions, and a lone row's four products added pairwise; the fixed positions stay as
# a second guard.
@pytest.mark.parametrize("window", [None, 37])
def test_a_row_gets_the_same_bits_whatever_block_it_is_in(window):
    S, Hq, Hk, D = 203, 6, 2, 24
    q, k, v = _qkv(1, Hq, Hk, S, S, D)
    keep = np.asarray(_causal(S, S, window=window))

    def run(a, b):
        mask = "causal" if window is None else mx.array(keep[a:b, :b])
        return np.asarray(attention(q[:, :, a:b], k[:, :, :b], v[:, :, :b], scale=0.3, mask=mask))

    whole = run(0, S)
    for cut in (1, 2, 63, 151, 202):
        assert np.array_equal(np.concatenate([run(0, cut), run(cut, S)], axis=2), whole)
    assert np.array_equal(np.concatenate([run(i, i + 1) for i in range(0, S, 7)], axis=2), whole[:, :, ::7])


def test_block_rows_keep_a_block_of_scores_in_cache():
    assert [cpu_attention.block_rows(s) for s in (1, 1024, 2048, 4096, 1 << 20)] == [64, 64, 32, 16, 4]


def test_softmax_matches_mlx_on_masked_large_and_dead_rows():
    """cpu_attention.softmax (a press's attention weights) against mx.softmax: logits up to +-200
    (an exp without the row's maximum subtracted overflows), rows with -inf entries (masked keys:
    0 exactly), a row of -inf only (NaN, as MLX), odd widths. Mutants caught: the maximum not
    subtracted (inf/NaN rows), the sum's reciprocal left out (rows not summing to 1), a row's
    scratch shared with another row's (rows mixed under prange)."""
    x = RNG.standard_normal((3, 7, 333)).astype(np.float32) * 60
    x[0, :, 200:] = -np.inf
    x[1, 2, :] = -np.inf
    x[2, :, ::5] += 140
    got = np.asarray(cpu_attention.softmax(mx.array(x)))
    want = np.asarray(cpu_attention.mlx_softmax(mx.array(x)))
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got[1, 2]).all()
    assert (got[0, :, 200:] == 0).all()
    assert float(np.nanmax(np.abs(got - want))) <= 1e-6
    live = np.delete(got.reshape(-1, 333), 7 + 2, axis=0)
    np.testing.assert_allclose(live.sum(-1), 1.0, atol=1e-5)


def test_softmax_leaves_what_it_does_not_cover_to_mlx():
    """Half precision is MLX's own result, bit for bit (kvlab computes float32 only)."""
    x = mx.array(RNG.standard_normal((4, 50)).astype(np.float32)).astype(mx.bfloat16)
    assert mx.array_equal(cpu_attention.softmax(x), cpu_attention.mlx_softmax(x)).item()
