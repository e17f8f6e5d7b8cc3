"""What a press reads from the prompt's queries, recorded while the prompt is prefilled.

``Capture`` is an attention wrapper (``kvlab.models.attention.wrapping``): for every call on a
layer it was told to watch, after the attention itself ran (so nothing the model computes
changes), it keeps the last ``window`` queries (after RoPE), adds up the attention each key
received from every query (H2O), and adds up the pre-RoPE queries and their outer products (the
statistics expected attention models future queries with). Each accumulator is evaluated as it is
made (``mx.async_eval``: scheduled, without stalling the forward, whose CPU time it leaves as it
was): a long prompt prefilled in many steps never builds one unbounded lazy graph.

Pre-RoPE queries are the model's own queries rotated back: RoPE at position p is a rotation, so
applying the layer's own ``rope`` at position -p undoes it (checked on a probe before use).

Example:
    >>> cap = Capture({id(c): i for i, c in enumerate(cache)}, Needs(window=64))
    >>> with attention.wrapping(cap):
    ...     kv.prefill(m, ids, cache)                              # doctest: +SKIP
    >>> cap.queries[0].shape                                       # [Hq, 64, D]
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import PressError
from ..models import attention
from ..primitives.display import summary_html
from .base import Needs, QueryStats

BLOCK = 256  # queries at a time when summing attention weights (bounds the [Hq, L, S] block)


def undo_rope(rope, q: mx.array, start: int) -> mx.array:
    """``q`` [..., L, D] at positions start..start+L-1 rotated back to before RoPE: position -p
    rotates by the opposite angle, so the reversed block at offset -(start+L-1) does it."""
    n = q.shape[-2]
    return rope(q[..., ::-1, :], offset=-(start + n - 1))[..., ::-1, :]


def check_rope(rope, dim: int, layer: int) -> None:
    """Refuse a rope that kvlab cannot undo exactly (one that also scales its input)."""
    probe = mx.random.normal((1, 1, 3, dim), key=mx.random.key(7))
    back = undo_rope(rope, rope(probe, offset=11), 11)
    if float(mx.abs(back - probe).max().item()) > 1e-4:
        raise PressError(f"layer {layer}'s RoPE ({type(rope).__name__}) is not a pure rotation, so kvlab "
                         "cannot recover its pre-RoPE queries for expected_attention; use another press")


def future_rotation(rope, dim: int, start: int, n: int) -> mx.array:
    """[D, D] RoPE averaged over positions start..start+n-1 (kvpress's mean rotation matrix)."""
    basis = mx.broadcast_to(mx.eye(dim)[None, :, None, :], (1, dim, n, dim))
    turned = rope(basis, offset=start)  # [1, D(basis j), n, D]: R(p) e_j
    return mx.mean(turned, axis=2)[0].T


class Capture:
    """The attention wrapper that records what ``needs`` asks of the layers in ``layers``
    (``id(cache object) -> layer index``); ``ropes`` (layer -> the layer's rope) for statistics."""

    def __init__(self, layers: dict[int, int], needs: Needs, ropes: dict | None = None):
        self.layers, self.needs, self.ropes = layers, needs, ropes or {}
        self.seen: set[int] = set()
        self.scale: dict[int, float] = {}
        self.queries: dict[int, mx.array] = {}
        self.attention: dict[int, mx.array] = {}
        self.sums: dict[int, list] = {}

    def __repr__(self) -> str:
        return f"Capture({len(self.layers)} layers, {self.needs}, {len(self.seen)} seen)"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)

    def __call__(self, call, q, k, v, cache, scale, mask, sinks):
        out = call(q, k, v, cache, scale, mask, sinks)
        layer = self.layers.get(id(cache))
        if layer is None or isinstance(k, tuple):
            return out
        self.seen.add(layer)
        self.scale[layer] = float(scale)
        start = k.shape[2] - q.shape[2]  # a fresh full cache: rows are positions
        done = []
        if self.needs.window:
            prev = self.queries.get(layer)
            qs = q[0] if prev is None else mx.concatenate([prev, q[0]], axis=1)
            self.queries[layer] = qs[:, -self.needs.window:]
            done.append(self.queries[layer])
        if self.needs.attention:
            sums = attention_sums(q[0], k[0], float(scale), start, sinks)
            prev = self.attention.get(layer)
            if prev is not None:
                sums = sums + mx.pad(prev, [(0, 0), (0, sums.shape[1] - prev.shape[1])])
            self.attention[layer] = sums
            done.append(sums)
        if self.needs.stats:
            done += self._add_stats(layer, q[0], start)
        mx.async_eval(done)  # bounded graph, no stall in the middle of the forward
        return out

    def _add_stats(self, layer: int, q: mx.array, start: int) -> list:
        rope = self.ropes.get(layer)
        if rope is None:
            raise PressError(f"expected_attention needs layer {layer}'s RoPE to read its pre-RoPE queries, "
                             "and kvlab found no `rope` in that layer's attention; use another press")
        if layer not in self.sums:
            check_rope(rope, q.shape[-1], layer)
        skip = max(0, self.needs.stats_skip - start)
        if skip >= q.shape[1]:
            return []
        pre = undo_rope(rope, q[None], start)[0, :, skip:].astype(mx.float32)  # [Hq, L', D]
        total = self.sums.get(layer, [0, 0.0, 0.0])
        total = [total[0] + pre.shape[1], total[1] + mx.sum(pre, axis=1), total[2] + pre.swapaxes(1, 2) @ pre]
        self.sums[layer] = total
        return [total[1], total[2]]

    def stats(self, layer: int, length: int) -> QueryStats | None:
        """The query statistics of ``layer`` after a prompt of ``length`` tokens (None if unseen)."""
        n, s1, s2 = self.sums.get(layer, (0, None, None))
        if not n:
            return None
        mean = s1 / n
        cov = s2 / n - mean[:, :, None] * mean[:, None, :]
        dim = mean.shape[-1]
        return QueryStats(mean, cov, future_rotation(self.ropes[layer], dim, length, self.needs.future))

    def observed(self, layer: int, length: int) -> mx.array | None:
        """[Hq, T] attention summed over the prompt's queries / how many queries saw each key."""
        sums = self.attention.get(layer)
        if sums is None:
            return None
        return sums / mx.arange(length, 0, -1).astype(mx.float32)


def attention_sums(q: mx.array, k: mx.array, scale: float, start: int, sinks=None) -> mx.array:
    """[Hq, S] the causal softmax attention of queries ``q`` [Hq, L, D] (positions start..) over
    keys ``k`` [H, S, D], summed over the queries; ``sinks`` [Hq] join each softmax's denominator."""
    hq, n = q.shape[0], q.shape[1]
    kk = mx.repeat(k, hq // k.shape[0], axis=0).astype(mx.float32)
    total = mx.zeros((hq, k.shape[1]), mx.float32)
    for a in range(0, n, BLOCK):
        qb = q[:, a: a + BLOCK].astype(mx.float32)
        logits = (qb @ kk.swapaxes(-1, -2)) * scale
        qpos = mx.arange(start + a, start + a + qb.shape[1])[:, None]
        logits = mx.where(mx.arange(k.shape[1])[None] <= qpos, logits, -mx.inf)
        if sinks is not None:
            sink = mx.broadcast_to(sinks.astype(mx.float32)[:, None, None], (hq, qb.shape[1], 1))
            weights = attention.softmax(mx.concatenate([logits, sink], axis=-1))[..., :-1]
        else:
            weights = attention.softmax(logits)
        total = total + mx.sum(weights, axis=1)
    return total
