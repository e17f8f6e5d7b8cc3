"""Presses built on other presses, each kvpress's wrapper in MLX.

- ``pyramid`` (PyramidKV): ``press``'s scores (SnapKV by default), a budget per layer shaped like
  a pyramid (more rows low, fewer high; the same total as ``ratio``);
- ``chunkkv`` (ChunkKV): ``press``'s scores summed over heads and averaged per chunk of
  ``chunk_length`` rows; whole chunks kept, the same chunks for every head;
- ``adakv`` (AdaKV): head-wise budgets: the layer's lowest scores across *all* heads are pruned
  (``alpha_safeguard`` of each head's budget protected). As kvpress's, it masks the pruned rows
  per head and frees no memory; with ``compact=True`` the layer keeps only as many rows as its
  largest head needs (memory freed down to that head's budget; the other heads mask the rest,
  which changes the attention kernel's summation order: equal to the oracle to float rounding,
  about 1e-7 relative, not bit for bit);
- ``composed``: presses one after another, each on what the previous kept (``ratio`` is derived:
  the overall fraction removed);
- ``per_layer``: ``press`` with a ratio per layer (``ratios``; ``ratio`` is their mean);
  (pyramid and per_layer leave layers of different lengths: fine for the models whose attention
  mask is mlx-lm's "causal"; one that builds a single array mask from its first layer's cache for
  every layer (deepseek_v3, gemma2, phi3small) gets shapes MLX refuses: an error, never a wrong
  answer)
- ``decoding``: ``press`` at its ratio on the prompt, then, while decoding, the layer compressed
  again to ``target`` rows every ``every`` new tokens (kvpress's DecodingPress with prefill
  compression; ``kvlab.presses.decoding``).

Example:
    >>> kv.press("chunkkv", 0.5, press="knorm", chunk_length=16)
    >>> kv.press("composed", presses=[kv.press("streaming_llm", 0.2), kv.press("knorm", 0.5)])
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import mlx.core as mx

from ..errors import PressError
from .attention_scorers import SnapKV
from .base import Needs, Press, View, n_kept, top_rows


@dataclass(frozen=True, repr=False)
class Wrapper(Press):
    """A press around ``press``; its needs and query-awareness are the inner press's."""

    press: Press = field(default_factory=SnapKV)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.press, Press):
            raise PressError(f"{self.name} wraps a press (kv.press(...)), got {type(self.press).__name__}")

    @property
    def needs(self) -> Needs:
        return self.press.needs

    @property
    def query_aware(self) -> bool:  # type: ignore[override]
        return self.press.query_aware

    def inner(self, ratio: float) -> Press:
        return replace(self.press, ratio=ratio)


@dataclass(frozen=True, repr=False)
class Pyramid(Wrapper, name="pyramid",
              rule="a budget per layer shaped like a pyramid (more rows in low layers), rows by the inner press"):
    """kvpress PyramidKVPress, with any scorer (SnapKV by default)."""

    window_size: int = 64
    beta: int = 20

    def budget(self, view: View) -> int:
        if self.beta < 1:
            raise PressError(f"pyramid: beta must be >= 1, got {self.beta}")
        q, w = view.rows, self.window_size
        top = w + q * (1 - self.ratio)
        low = (top - w) / self.beta
        high = (top - w) * 2 - low
        if high >= q - w:
            high = q - w
            low = (top - w) * 2 - high
        if not (q >= high >= low >= w):  # too short for a pyramid: SnapKV's budget
            return round(q * (1 - self.ratio))
        steps = (high - low) / (view.n_layers - 1)
        return round(high - view.layer * steps)

    def select(self, view: View) -> mx.array:
        if self.ratio == 0:
            return super().select(view)
        return top_rows(self.inner(self.ratio).score(view), self.budget(view))


@dataclass(frozen=True, repr=False)
class ChunkKV(Wrapper, name="chunkkv",
              rule="whole chunks of rows, chunks ranked by the inner press's mean score (the same for every head)"):
    """kvpress ChunkKVPress."""

    chunk_length: int = 20

    def select(self, view: View) -> mx.array:
        if self.ratio == 0:
            return super().select(view)
        inner = self.inner(self.ratio)
        scores = mx.sum(inner.score(view), axis=0)  # summed over heads
        s, c = view.rows, self.chunk_length
        full, rest = s // c, s % c
        if full == 0:
            return inner.select(view)
        chunk_scores = mx.mean(scores[: full * c].reshape(full, c), axis=-1)
        if rest:
            chunk_scores = mx.concatenate([chunk_scores, mx.mean(scores[-rest:])[None]])
        keep = max(1, int((full + (rest > 0)) * (1 - self.ratio)))
        chunks = sorted(mx.argsort(-chunk_scores)[:keep].tolist())
        rows = [r for ch in chunks for r in range(ch * c, min(ch * c + c, s))]
        return mx.broadcast_to(mx.array(rows, dtype=mx.int32), (view.heads, len(rows)))


@dataclass(frozen=True, repr=False)
class AdaKV(Wrapper, name="adakv",
            rule="the lowest scores across all heads of a layer pruned (head-wise budgets), a share per head "
                 "protected; pruned rows masked, no memory freed (compact=True: freed down to the largest head)"):
    """kvpress AdaKVPress: head-wise budgets (module docstring: what it frees)."""

    alpha_safeguard: float = 0.20
    compact: bool = False

    @property
    def masks_in_place(self) -> bool:  # type: ignore[override]
        return not self.compact

    def select(self, view: View) -> mx.array:
        if self.ratio == 0:
            return super().select(view)
        scores = self.inner(self.ratio).score(view).astype(mx.float32)
        h, s = scores.shape
        kept = n_kept(s, self.ratio)
        safe = max(1, int(kept * self.alpha_safeguard)) if self.alpha_safeguard > 0 else 0  # kvpress 0.5.5
        if safe:
            protect = mx.argsort(-scores, axis=-1)[:, :safe]
            scores = mx.put_along_axis(scores, protect, mx.array(mx.finfo(mx.float32).max), axis=-1)
        pruned = h * (s - kept)
        order = mx.argsort(scores.reshape(-1))[:pruned]
        mask = mx.ones((h * s,), mx.bool_)
        mask[order] = False
        mask = mask.reshape(h, s)
        if not self.compact:  # every row stays where it is; the pruned ones are masked
            return mx.where(mask, mx.arange(s)[None], -1).astype(mx.int32)
        counts = mx.sum(mask, axis=-1)
        width = int(mx.max(counts).item())
        # per head: its kept rows ascending, then -1 up to the widest head
        rank = mx.where(mask, mx.arange(s)[None], s + mx.arange(s)[None])
        rows = mx.sort(rank, axis=-1)[:, :width]
        return mx.where(rows < s, rows, -1).astype(mx.int32)


@dataclass(frozen=True, repr=False)
class Composed(Press, name="composed", rule="presses applied in turn, each on the rows the previous kept"):
    """kvpress ComposedPress: ``presses`` applied one after another."""

    presses: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "presses", tuple(self.presses))
        if not self.presses or not all(isinstance(p, Press) for p in self.presses):
            raise PressError("composed takes presses=[kv.press(...), ...] (at least one)")
        if any(isinstance(p, (AdaKV, Decoding)) for p in self.presses):
            raise PressError("composed cannot hold adakv or decoding (as kvpress's ComposedPress)")
        derived = 1 - math.prod(1 - p.ratio for p in self.presses)
        object.__setattr__(self, "ratio", derived)
        super().__post_init__()

    def select(self, view: View) -> mx.array:
        rows = mx.broadcast_to(mx.arange(view.rows, dtype=mx.int32), (view.heads, view.rows))
        for p in self.presses:
            picked = p.select(view)
            rows, view = mx.take_along_axis(rows, picked, axis=1), view.take(picked)
        return rows

    @property
    def needs(self) -> Needs:
        out = Needs()
        for p in self.presses:
            out = out | p.needs
        return out

    @property
    def query_aware(self) -> bool:  # type: ignore[override]
        return any(p.query_aware for p in self.presses)


@dataclass(frozen=True, repr=False)
class PerLayer(Wrapper, name="per_layer", rule="the inner press with a ratio per layer"):
    """kvpress PerLayerCompressionPress: ``press`` with ``ratios[layer]``."""

    ratios: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "ratios", tuple(float(r) for r in self.ratios))
        if not self.ratios:
            raise PressError("per_layer takes ratios=[one per layer]")
        object.__setattr__(self, "ratio", sum(self.ratios) / len(self.ratios))
        super().__post_init__()
        for r in self.ratios:
            replace(self.press, ratio=r)  # each checked as a ratio

    def select(self, view: View) -> mx.array:
        return self.for_layer(view.layer, view.n_layers).select(view)

    def for_layer(self, layer: int, n_layers: int) -> Press:
        if len(self.ratios) != n_layers:
            raise PressError(f"per_layer has {len(self.ratios)} ratios but the model has {n_layers} layers")
        return self.inner(self.ratios[layer])


@dataclass(frozen=True, repr=False)
class Decoding(Wrapper, name="decoding",
               rule="the inner press on the prompt, then again every N decoded tokens down to a target"):
    """``press`` on the prompt, then every ``every`` decoded tokens the layer is compressed again
    to ``target`` rows by ``press``'s scores (``kvlab.presses.decoding``)."""

    every: int = 512
    target: int = 2048

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "ratio", self.press.ratio)
        if self.every < 1 or self.target < 1:
            raise PressError(f"decoding: every and target must be >= 1, got {self.every}, {self.target}")
        if self.press.needs.attention or self.press.needs.stats:
            raise PressError(f"decoding re-scores with the last queries only; {self.press.name} needs the "
                             "whole prompt's queries: use knorm, streaming_llm, snapkv, tova, keydiff, ...")

    def select(self, view: View) -> mx.array:
        return self.press.select(view)

    def recompress_ratio(self, rows: int) -> float:
        """The ratio that leaves exactly ``target`` of ``rows`` (kvpress's search), 0 when it fits."""
        if rows <= self.target:
            return 0.0
        lo, hi, r = 0.0, 1.0, 1.0 - self.target / rows
        for _ in range(60):
            kept = n_kept(rows, r)
            if kept == self.target:
                break
            lo, r, hi = (r, (r + hi) / 2, hi) if kept > self.target else (lo, (lo + r) / 2, r)
        return min(r, 1 - 1e-9)
