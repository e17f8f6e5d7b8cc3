"""Scorer presses that read keys and values only (query-agnostic), each kvpress's rule in MLX.

Each scores every row of every KV head; the press keeps the top ``n_kept`` per head
(``kvlab.presses.base``). The docstring of each names kvpress's class it matches.

Example:
    >>> kv.press("streaming_llm", 0.5).select(view)     # 4 sinks + the most recent rows
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..errors import PressError
from .base import Press, View


@dataclass(frozen=True, repr=False)
class Random(Press, name="random", rule="keeps random rows (a baseline)"):
    """kvpress RandomPress: uniform random scores (a baseline); ``seed`` and the layer pick them."""

    seed: int = 0

    def score(self, view: View) -> mx.array:
        return mx.random.uniform(shape=(view.heads, view.rows), key=mx.random.key(self.seed * 100_003 + view.layer))


@dataclass(frozen=True, repr=False)
class StreamingLLM(Press, name="streaming_llm",
                   rule="keeps the first rows (attention sinks) and the most recent ones"):
    """kvpress StreamingLLMPress: the first ``n_sink`` rows (attention sinks) and the most recent."""

    n_sink: int = 4

    def score(self, view: View) -> mx.array:
        s = view.rows
        if s <= self.n_sink:
            raise PressError(f"streaming_llm needs more rows than n_sink={self.n_sink}, got {s}")
        pruned = s - int(s * (1 - self.ratio))
        idx = mx.arange(s)
        keep = (idx < self.n_sink) | (idx >= self.n_sink + pruned)
        return mx.broadcast_to(keep.astype(mx.float32), (view.heads, s))


@dataclass(frozen=True, repr=False)
class KNorm(Press, name="knorm", rule="keeps the rows with the lowest key norms"):
    """kvpress KnormPress: keeps the *lowest* key norms (mlx-lm #963 kept the highest: inverted)."""

    def score(self, view: View) -> mx.array:
        return -mx.linalg.norm(view.keys, axis=-1)


@dataclass(frozen=True, repr=False)
class KeyDiff(Press, name="keydiff", rule="keeps the keys least like the average key (cosine)"):
    """kvpress KeyDiffPress: keeps the keys least similar (cosine) to the mean normalised key."""

    def score(self, view: View) -> mx.array:
        k = view.keys
        unit = k / mx.maximum(mx.linalg.norm(k, axis=-1, keepdims=True), 1e-12)
        anchor = mx.mean(unit, axis=1, keepdims=True)
        cos = mx.sum(k * anchor, axis=-1) / mx.maximum(
            mx.linalg.norm(k, axis=-1) * mx.linalg.norm(anchor, axis=-1), 1e-8)
        return -cos


@dataclass(frozen=True, repr=False)
class LagKV(Press, name="lagkv",
            rule="keeps rows whose keys and values stray most from the next partition's range"):
    """kvpress LagKVPress: rows scored within each partition of ``lag_size`` by how far their keys
    and values stray from the next partition's range (min-max normalised, std over channels);
    sinks and the last partitions kept."""

    n_sink: int = 4
    lag_size: int = 128
    cross_scoring: bool = False

    def score(self, view: View) -> mx.array:
        h, s = view.heads, view.rows
        if s < self.n_sink + 2 * self.lag_size:  # too short to partition: keep the sinks and the latest
            ramp = mx.arange(max(s - self.n_sink, 0), dtype=mx.float32) / max(s - self.n_sink, 1)
            score = mx.concatenate([mx.ones((self.n_sink,)), ramp])[:s]
            return mx.broadcast_to(score, (h, s))
        end = self.n_sink + ((s - self.n_sink) // self.lag_size) * self.lag_size
        tail = self.lag_size + s - end
        parts = (end - self.n_sink) // self.lag_size
        ks = _lag_score(view.keys[:, self.n_sink:end].reshape(h, parts, self.lag_size, -1), self.lag_size)
        vs = _lag_score(view.values[:, self.n_sink:end].reshape(h, parts, self.lag_size, -1), self.lag_size)
        score = (ks + vs) / 2
        if not self.cross_scoring:  # rank within each partition
            score = mx.argsort(mx.argsort(score, axis=-1), axis=-1).astype(mx.float32) / self.lag_size
        return mx.concatenate([mx.ones((h, self.n_sink)), score.reshape(h, -1), mx.ones((h, tail))], axis=-1)


def _lag_score(x: mx.array, lag: int) -> mx.array:
    """[H, P-1, lag] each row's spread relative to the next partition's min/max (kvpress's
    ``_get_states_score``: torch's std is the unbiased one)."""
    ref, v = x[:, 1:], x[:, :-1]
    lo, hi = mx.min(ref, axis=-2, keepdims=True), mx.max(ref, axis=-2, keepdims=True)
    z = (v - lo) / (hi - lo)
    return mx.softmax(mx.std(z, axis=-1, ddof=1), axis=-1)
