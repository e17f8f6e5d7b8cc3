"""kvlab's attention for Linux CPU: ``mx.fast.scaled_dot_product_attention``'s result, several times
sooner (``kvlab bench --only attention``).

On Linux CPU MLX computes attention from its own ops, and its ``exp`` is scalar: a 2,048-token
prefill of SmolLM2 spends most of its time in softmax. ``attention(...)`` has MLX's signature and
semantics; it hands float32 queries, keys and values to NumPy without a copy (MLX's buffer
protocol), runs ``attention_kernel.attend`` (numba, both cores) and gives the output back to MLX
(one copy of [B, heads, L, D]). Whatever it does not cover goes to MLX's own kernel, unchanged:

- queries, keys or values not float32 (bfloat16 / float16: MLX's result rounds the scores and
  probabilities to the half type; kvlab runs float32 on Linux CPU, ``kvlab.models.dtypes``),
- a mask that is neither None, ``"causal"`` nor an array of at most 4 dimensions, or a causal
  mask with more queries than keys,
- a call inside ``mx.compile`` / ``mx.vmap`` (arrays cannot be read while tracing).

Choosing it is ``kvlab.device``'s decision; ``kvlab.models.attention`` installs it.

Example:
    >>> q = mx.random.normal((1, 9, 300, 64)); k = v = mx.random.normal((1, 3, 300, 64))
    >>> out = attention(q, k, v, scale=0.125, mask="causal")
    >>> bool(mx.allclose(out, mlx_attention(q, k, v, scale=0.125, mask="causal"), atol=1e-5))
    True
"""

from __future__ import annotations

import contextlib

import numba
import numpy as np

from .. import _blas

_blas.load_fast_blas()  # before mlx.core

import mlx.core as mx  # noqa: E402

from ..primitives import timing  # noqa: E402
from . import attention_kernel as kernel  # noqa: E402

# keys a block of query rows scores at once: rows x keys x 4 bytes stays within a core's L2
TILE_FLOATS = 1 << 16
# up to this many query rows per KV head, keys are scored as stored; above it, transposed once
# (a row against transposed keys is ~5x faster, the transpose costs about 5 rows' worth)
KEYS_AS_STORED_ROWS = 8
# below this many score-times-dim products a call runs on the calling thread alone: a parallel
# region waits for its slowest thread, and on a loaded machine that is a whole scheduler slice
# (4-16 ms measured here for a decode step that takes 1 ms alone)
PARALLEL_WORK = 1 << 24
# the same for a softmax: values per call (an exp is about as much work as a 64-long dot product)
PARALLEL_SOFTMAX = PARALLEL_WORK >> 6
_PLACEHOLDER = {np.dtype(np.bool_): np.ones((1, 1, 1, 1), np.bool_),
                np.dtype(np.float32): np.zeros((1, 1, 1, 1), np.float32)}


def mlx_attention(queries, keys, values, *, scale, mask=None, sinks=None):
    """MLX's own fused attention (what every kvlab kernel is compared with)."""
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def mlx_softmax(x):
    """MLX's own softmax over the last axis (float32 accumulation)."""
    return mx.softmax(x, axis=-1, precise=True)


def softmax(x):
    """``mx.softmax(x, axis=-1, precise=True)`` of a float32 array with the kernel's exp, on both
    cores: attention weights a press reads (``kvlab.presses``) cost what the kernel's do, not
    MLX's scalar exp. Anything else (half precision, a scalar, a call while tracing) is MLX's.

    Example:
        >>> x = mx.random.normal((9, 64, 1024))
        >>> bool(mx.allclose(softmax(x), mlx_softmax(x), rtol=1e-5, atol=1e-7))
        True
    """
    if x.dtype != mx.float32 or x.ndim == 0 or x.size == 0:
        return mlx_softmax(x)
    try:
        rows = np.array(x, dtype=np.float32, copy=True, order="C")
    except ValueError:  # inside mx.compile / vmap: nothing can be read here
        return mlx_softmax(x)
    flat = rows.reshape(-1, rows.shape[-1])
    with _threads(parallel=flat.size >= PARALLEL_SOFTMAX):
        kernel.softmax_rows(flat, np.empty(flat.shape, np.int32))
    return mx.array(rows)


def warm() -> float:
    """Compile the kernel now (numba caches it on disk beside this module; ``kvlab prepare`` calls
    this so a first prefill, test or notebook does not wait for it). Returns the seconds taken.

    Example:
        >>> warm() < 60                                   # doctest: +SKIP
        True
    """
    t = timing.timed()
    q = mx.zeros((1, 2, 3, 4))
    attention(q, q[:, :1], q[:, :1], scale=1.0, mask="causal")
    return t.done()


def block_rows(keys: int) -> int:
    """Query rows per task for ``keys`` visible keys: their scores fill about TILE_FLOATS floats.

    Example:
        >>> block_rows(2048), block_rows(100_000)
        (32, 4)
    """
    return int(min(64, max(4, TILE_FLOATS // max(keys, 1))))


def covers(queries, keys, values, mask=None, sinks=None) -> bool:
    """Does ``attention`` compute this call itself (rather than hand it to MLX)?

    Example:
        >>> covers(mx.zeros((1, 2, 4, 8), mx.bfloat16), mx.zeros((1, 2, 4, 8)), mx.zeros((1, 2, 4, 8)))
        False
    """
    arrays = (queries, keys, values) + ((sinks,) if sinks is not None else ())
    if any(a.dtype != mx.float32 or a.ndim != (1 if a is sinks else 4) or a.size == 0 for a in arrays):
        return False  # half precision, or an empty or odd shape: MLX's (and its errors)
    if queries.shape[1] % keys.shape[1] or keys.shape[:3] != values.shape[:3] or queries.shape[3] != keys.shape[3]:
        return False
    if isinstance(mask, str):
        return mask == "causal" and queries.shape[2] <= keys.shape[2]
    if mask is None:
        return True
    if not isinstance(mask, mx.array) or mask.ndim > 4 or not (
            mask.dtype == mx.bool_ or mx.issubdtype(mask.dtype, mx.floating)):
        return False
    scores = queries.shape[:3] + keys.shape[2:3]
    try:
        return mx.broadcast_shapes(mask.shape, scores) == scores
    except ValueError:  # MLX raises its own error for it
        return False


def _host(a, dtype=np.float32):
    """A C-contiguous NumPy view of ``a`` (a copy only when MLX's layout is strided)."""
    return np.ascontiguousarray(np.asarray(a), dtype=dtype)


def _rows(a):
    """[B, H, S, D] keys or values as a C-contiguous [B, H, >= S, D] NumPy view, without a copy
    when ``a`` is the first S rows of a cache's preallocated [B, H, capacity, D] buffer (mlx-lm's
    KVCache hands attention ``keys[..., :offset, :]``): the view is widened to the capacity,
    whose rows past S the kernel never reads. Anything else is copied."""
    x = np.asarray(a)
    B, H, S, D = x.shape
    batch, head, row, col = x.strides
    if col == x.itemsize and row == D * col and head % row == 0 and head >= S * row and (B == 1 or batch == H * head):
        return np.lib.stride_tricks.as_strided(x, (B, H, head // row, D), (H * head, head, row, col))
    return np.ascontiguousarray(x)


def _mask_arg(mask):
    """(mode, bool mask, additive mask): the array mask as 4-D, a broadcast dimension kept at 1."""
    none, zeros = _PLACEHOLDER[np.dtype(np.bool_)], _PLACEHOLDER[np.dtype(np.float32)]
    if mask is None:
        return kernel.MODE_NONE, none, zeros
    if isinstance(mask, str):
        return kernel.MODE_CAUSAL, none, zeros
    full = (1,) * (4 - mask.ndim) + mask.shape
    if mask.dtype == mx.bool_:
        return kernel.MODE_BOOL, _host(mask, np.bool_).reshape(full), zeros
    return kernel.MODE_ADD, none, _host(mask.astype(mx.float32)).reshape(full)


def attention(queries, keys, values, *, scale, mask=None, sinks=None):
    """``mx.fast.scaled_dot_product_attention`` computed by kvlab's CPU kernel where it covers the
    call (``covers``), else by MLX. Same arguments, same result within float32 rounding."""
    if not covers(queries, keys, values, mask, sinks):
        return mlx_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    try:
        q = _host(queries)
        k, v = _rows(keys), _rows(values)
        mode, bmask, amask = _mask_arg(mask)
        sink = np.zeros(0, np.float32) if sinks is None else _host(sinks)
    except ValueError:  # inside mx.compile / vmap: nothing can be read here
        return mlx_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    B, Hq, L, _ = q.shape
    S = keys.shape[2]
    if L * Hq // k.shape[1] <= KEYS_AS_STORED_ROWS:
        kt = np.empty((B, k.shape[1], 0, 0), np.float32)
    else:
        kt = np.ascontiguousarray(np.swapaxes(k[:, :, :S], 2, 3))
    out = np.empty(q.shape, np.float32)
    with _threads(parallel=B * Hq * L * (S - L // 2) * q.shape[3] >= PARALLEL_WORK):
        kernel.attend(q, k, kt, v, out, S, np.float32(scale), mode, S - L, bmask, amask, sink, block_rows(S))
    return mx.array(out)


@contextlib.contextmanager
def _threads(parallel: bool):
    """numba's threads for this block: all of them, or this thread alone (this thread's setting only)."""
    threads = numba.get_num_threads()
    if not parallel:
        numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(threads)
