"""Synthetic snapshots for the disk-tier tests: every token's KV holds its own id (times the layer
number, values negated), so any mix-up of files, blocks or keys shows in the arrays."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvlab.keys import CacheKey
from kvlab.primitives.snapshots import LayerState, Snapshot

FP = "f" * 64
OTHER_FP = "e" * 64


def snap_of(ids, *, layers: int = 2, heads: int = 2, dim: int = 4, fp: str = FP, width: int = 1) -> Snapshot:
    """A KVCache snapshot of ``ids``: keys[l][0, h, t, :] = ids[t] * (l + 1), values = -keys.
    ``width`` repeats the head dim to make files bigger."""
    n = len(ids)
    base = mx.array([float(i) for i in ids], dtype=mx.float32).reshape(1, 1, n, 1)
    out = []
    for layer in range(layers):
        k = mx.broadcast_to(base * (layer + 1), (1, heads, n, dim * width)) + 0.0
        v = -k
        mx.eval(k, v)
        out.append(LayerState("KVCache", (k, v, n), n, k.nbytes + v.nbytes))
    return Snapshot(tuple(out), n, tuple(int(i) for i in ids), fp)


def ids_in(snap: Snapshot) -> tuple[int, ...]:
    """The token ids a synthetic snapshot's KV encodes, checked across layers, heads, keys, values."""
    ids = np.array(snap.layers[0].state[0][0, 0, :, 0]).astype(np.int64)
    for layer_no, layer in enumerate(snap.layers):
        k, v = np.array(layer.state[0]), np.array(layer.state[1])
        assert (k == ids[None, None, :, None] * (layer_no + 1)).all() and (v == -k).all()
    return tuple(int(i) for i in ids)


def key_of(ids, salt=None) -> CacheKey:
    return CacheKey(tuple(int(i) for i in ids), (), salt)


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))
