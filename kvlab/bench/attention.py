"""One attention layer at 2,048 tokens (SmolLM2's heads: 9 query, 3 KV, dim 64, causal, float32), each
step from MLX's fused kernel to kvlab's CPU kernel measured side by side in one process: what causal
block skipping, a vectorised softmax and flash-order tiles each bring.

The two middle steps are written here only to be measured (MLX ops; MLX ops with NumPy's exp); the
last is ``kvlab.models.cpu_attention`` as models use it.
"""

from __future__ import annotations

import numpy as np

from ..primitives import timing
from .settings import Settings
from .table import Table, median_range, spread

NEEDS_MODEL = False
HEADS, KV_HEADS, DIM = 9, 3, 64
BLOCK = 256  # query rows per block in the two middle steps (the issue measured 256-512)


def _blocks(q, k, v, scale, softmax):
    """Causal attention a block of queries at a time against only the keys the block can see:
    scores and the weighted sum by MLX's matmuls, ``softmax(scores, first_key_of_block)`` between."""
    import mlx.core as mx

    B, H, L, D = q.shape
    rep = H // k.shape[1]
    q = (q * scale).reshape(B, k.shape[1], rep * L, D) if rep > 1 else q * scale
    outs = []
    for start in range(0, L, BLOCK):
        end = min(L, start + BLOCK)
        qb = q.reshape(B, k.shape[1], rep, L, D)[:, :, :, start:end].reshape(B, k.shape[1], -1, D)
        s = softmax(qb @ k[:, :, :end].swapaxes(-1, -2), start, end - start)
        outs.append((s @ v[:, :, :end]).reshape(B, k.shape[1], rep, end - start, D))
    return mx.concatenate(outs, axis=3).reshape(B, H, L, D)


def _mlx_softmax(s, start, rows):
    import mlx.core as mx

    keys = s.shape[-1]
    seen = mx.arange(start, start + rows)[:, None] >= mx.arange(keys)[None]
    s = mx.where(mx.tile(seen, (s.shape[-2] // rows, 1)), s, mx.finfo(s.dtype).min)
    return mx.softmax(s, axis=-1, precise=True)


def _numpy_softmax(s, start, rows):
    import mlx.core as mx

    x = np.asarray(s)  # no copy: MLX's buffer
    keys = x.shape[-1]
    hidden = np.tile(np.arange(start, start + rows)[:, None] < np.arange(keys)[None], (x.shape[-2] // rows, 1))
    x = np.where(hidden, -np.inf, x)
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x *= 1 / x.sum(axis=-1, keepdims=True)
    return mx.array(x)  # one copy back


def steps():
    """(name, fn(q, k, v, scale)) for each step, MLX's fused kernel first."""
    from ..models.cpu_attention import attention, mlx_attention

    return (("MLX fused kernel (mx.fast.scaled_dot_product_attention)",
             lambda q, k, v, scale: mlx_attention(q, k, v, scale=scale, mask="causal")),
            (f"+ causal block skipping ({BLOCK}-row query blocks, MLX ops)",
             lambda q, k, v, scale: _blocks(q, k, v, scale, _mlx_softmax)),
            ("+ vectorised softmax (NumPy's exp between MLX's matmuls)",
             lambda q, k, v, scale: _blocks(q, k, v, scale, _numpy_softmax)),
            ("+ flash-order tiles, both cores (kvlab-cpu: one numba kernel)",
             lambda q, k, v, scale: attention(q, k, v, scale=scale, mask="causal")))


def bench_layer(repeats: int, n: int = 2048) -> Table:
    """Seconds for one causal attention layer of ``n`` tokens, per step, interleaved over repeats.

    Example:
        >>> bench_layer(2, n=300).values["steps"][-1]["max_abs_diff"] < 1e-5
        True
    """
    import mlx.core as mx

    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal((1, h, n, DIM)).astype(np.float32)) for h in (HEADS, KV_HEADS, KV_HEADS))
    mx.eval(q, k, v)
    scale = DIM ** -0.5
    runs = steps()
    ref = runs[0][1](q, k, v, scale)
    mx.eval(ref)
    diffs = [float(mx.abs(fn(q, k, v, scale) - ref).max()) for _, fn in runs]
    times = [[] for _ in runs]
    for _ in range(max(repeats, 3)):
        for i, (_, fn) in enumerate(runs):  # interleaved: every step sees the same load
            t = timing.timed()
            mx.eval(fn(q, k, v, scale))
            times[i].append(t.done())
    stats = [spread(xs) for xs in times]
    rows, values = [], []
    for i, ((name, _), s) in enumerate(zip(runs, stats)):
        prev = stats[max(i - 1, 0)]["median"]
        rows.append((name, median_range(s, 1e3), f"{stats[0]['median'] / s['median']:.1f}x",
                     f"{prev / s['median']:.2f}x", f"{diffs[i]:.1e}"))
        values.append({"name": name, "seconds": s, "max_abs_diff": diffs[i]})
    return Table(f"one attention layer at {n:,} tokens ({HEADS} query heads, {KV_HEADS} KV heads, dim {DIM}, "
                 "causal, float32)", f"kvlab bench --only attention --repeats {repeats}",
                 ("step", "ms median (min-max)", "vs MLX", "vs the step before", "max abs diff vs MLX"),
                 tuple(rows), "Same arrays, same process, interleaved over the repeats; each step adds one idea "
                 "to the one above it. The diff column is the largest absolute difference from MLX's output.",
                 values={"n": n, "steps": values})


def table(s: Settings) -> Table:
    return bench_layer(s.repeats)
