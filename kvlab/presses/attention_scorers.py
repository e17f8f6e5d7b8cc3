"""Scorer presses that read the prompt's queries, each kvpress's rule in MLX.

- ``snapkv``: mean attention of the last ``window_size`` queries over the earlier rows,
  average-pooled (``kernel_size``), averaged over each GQA group, the window itself kept (scored
  above every other row: kvpress 0.5.5 pads it with the maximum + 1, as tova its last row and
  expected attention its sinks);
- ``tova``: the last query's attention averaged over *all* query heads (one set for every head);
- ``observed_attention`` (H2O): attention summed over every prompt query, divided by how many
  queries could see the key, averaged over each GQA group;
- ``expected_attention``: a closed-form expected softmax under a Gaussian model of the next
  ``n_future_positions`` queries (mean and covariance of the prompt's pre-RoPE queries, rotated by
  RoPE averaged over those positions), times the value norm; ``n_sink`` first rows kept. It models
  future queries from all of the prompt's, so it is query-agnostic (kvpress: it cannot run on
  Qwen3/Gemma3's QK-norm; kvlab reads the normed queries themselves, so it can).

The queries come from kvlab's attention dispatcher during prefill (``kvlab.presses.capture``):
after RoPE, exactly what the model attended with, scaled by the layer's own ``scale``.

Example:
    >>> kv.press("snapkv", 0.5, window_size=32)
    snapkv(ratio=0.5,window_size=32,kernel_size=5): ... · query-aware
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..errors import PressError
from ..models import attention
from .base import Needs, Press, View


def window_attention(view: View, q: mx.array) -> mx.array:
    """[Hq, W, S] softmax attention of window queries ``q`` [Hq, W, D] (positions T-W..T-1) over
    every row, causal by original position (a key after a query is masked)."""
    w = q.shape[1]
    k = mx.repeat(view.keys, q.shape[0] // view.heads, axis=0)
    logits = (q.astype(mx.float32) @ k.swapaxes(-1, -2)) * view.scale
    qpos = mx.arange(view.length - w, view.length)[None, :, None]
    kpos = mx.repeat(view.positions, q.shape[0] // view.heads, axis=0)[:, None, :]
    logits = mx.where(kpos <= qpos, logits, -mx.inf)
    return attention.softmax(logits)


def group_mean(x: mx.array, heads: int) -> mx.array:
    """[H, S] the mean of [Hq, S] over each GQA group of query heads."""
    return mx.mean(x.reshape(heads, x.shape[0] // heads, x.shape[-1]), axis=1)


def avg_pool(x: mx.array, kernel: int) -> mx.array:
    """torch's ``avg_pool1d(kernel, padding=kernel // 2, stride=1)`` over the last axis (zeros
    padded and counted)."""
    pad = kernel // 2
    padded = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)])
    c = mx.cumsum(padded, axis=-1)
    c = mx.concatenate([mx.zeros(c.shape[:-1] + (1,)), c], axis=-1)
    n = x.shape[-1] + 2 * pad - kernel + 1
    return (c[..., kernel: kernel + n] - c[..., :n]) / kernel


@dataclass(frozen=True, repr=False)
class SnapKV(Press, name="snapkv", query_aware=True,
             rule="mean attention of the last queries over earlier rows, pooled, averaged per GQA group; the window kept"):
    """kvpress SnapKVPress (module docstring)."""

    window_size: int = 64
    kernel_size: int = 5

    @property
    def needs(self) -> Needs:
        return Needs(window=self.window_size)

    def score(self, view: View) -> mx.array:
        w = self.window_size
        if view.rows <= w:
            raise PressError(f"snapkv: the compressed part has {view.rows} rows, not more than its window of "
                             f"{w} queries; compress a longer prompt or pass window_size= smaller")
        q = view.need("queries", self)[:, -w:]
        att = window_attention(view, q)[..., : view.rows - w]
        scores = avg_pool(mx.mean(att, axis=1), self.kernel_size)
        scores = group_mean(scores, view.heads)
        top = mx.max(scores) + 1  # kvpress 0.5.5: above every score, so no row ties with the window
        return mx.concatenate([scores, mx.broadcast_to(top, (view.heads, w))], axis=-1)


@dataclass(frozen=True, repr=False)
class TOVA(Press, name="tova", query_aware=True,
           rule="the last query's attention averaged over all heads (one set for every head); the last row kept"):
    """kvpress TOVAPress (module docstring): the last query's attention, mean over all heads."""

    @property
    def needs(self) -> Needs:
        return Needs(window=1)

    def score(self, view: View) -> mx.array:
        q = view.need("queries", self)[:, -1:]
        att = window_attention(view, q)[:, 0, : view.rows - 1]
        scores = mx.broadcast_to(mx.mean(att, axis=0), (view.heads, view.rows - 1))
        return mx.concatenate([scores, mx.broadcast_to(mx.max(scores) + 1, (view.heads, 1))], axis=-1)


@dataclass(frozen=True, repr=False)
class ObservedAttention(Press, name="observed_attention", query_aware=True,
                        rule="attention each row received from every prompt query (H2O), per GQA group"):
    """kvpress ObservedAttentionPress (H2O; module docstring)."""

    @property
    def needs(self) -> Needs:
        return Needs(attention=True)

    def score(self, view: View) -> mx.array:
        return group_mean(view.need("attention", self), view.heads)


@dataclass(frozen=True, repr=False)
class ExpectedAttention(Press, name="expected_attention",
                        rule="expected softmax under a Gaussian model of future queries, times the value norm; sinks kept"):
    """kvpress ExpectedAttentionPress (module docstring)."""

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    @property
    def needs(self) -> Needs:
        return Needs(stats=True, stats_skip=self.n_sink, future=self.n_future_positions)

    def score(self, view: View) -> mx.array:
        if view.rows <= self.n_sink:
            raise PressError(f"expected_attention needs more rows than n_sink={self.n_sink}, got {view.rows}")
        stats = view.need("stats", self)
        r = stats.rotation
        mu = stats.mean @ r.T                                     # [Hq, D]
        k = mx.repeat(view.keys[:, self.n_sink:], mu.shape[0] // view.heads, axis=0)  # [Hq, S', D]
        scores = mx.sum(k * mu[:, None, :], axis=-1) * view.scale
        if self.use_covariance:
            cov = r @ stats.cov @ r.T                             # [Hq, D, D]
            scores = scores + mx.sum((k @ cov) * k, axis=-1) * view.scale ** 2 / 2
        scores = group_mean(attention.softmax(scores), view.heads)
        if self.use_vnorm:
            scores = (scores + self.epsilon) * mx.linalg.norm(view.values[:, self.n_sink:], axis=-1)
        sink = mx.broadcast_to(mx.max(scores) + 1, (view.heads, self.n_sink))
        return mx.concatenate([sink, scores], axis=-1)
