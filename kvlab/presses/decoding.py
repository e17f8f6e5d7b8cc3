"""The ``decoding`` press while decoding: every ``every`` new tokens, a compressed layer is pressed
again down to ``target`` rows by the inner press's scores (kvpress's DecodingPress).

A ``Recompressor`` hangs on each KeptKVCache of a compressed prompt (``on_append``): before a new
token's keys go in, if ``every`` tokens were appended since the last compression and the layer holds
more than ``target`` rows, it scores the rows it holds (kept and appended, at their original
positions) and keeps ``target`` of them. The token that produced the last keys has already attended
to everything, so nothing is evicted before it was used. Query-aware inner presses score with the
last queries, which the cache records from kvlab's attention dispatcher (``on_attend``). It works in
any decode loop that runs the cache (kv.Engine, mlx-lm's stream_generate); it is not saved with the
cache (a restored cache is re-attached by whoever restores it: ``attach``).

Example:
    >>> p = kv.press("decoding", 0.5, press="knorm", every=64, target=256)
    >>> c = kv.compress(m, ids, p)               # the prompt at 0.5, then 256 rows every 64 tokens
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ..errors import PressError
from ..primitives.display import summary_html
from ..primitives.kept_cache import KeptKVCache, QuantizedKeptKVCache
from .base import View
from .wrappers import Decoding


class Recompressor:
    """The decode-time hook of one layer (module docstring)."""

    def __init__(self, press: Decoding, layer: int, n_layers: int, scale: float, queries: mx.array | None = None):
        self.press, self.layer, self.n_layers, self.scale = press, layer, n_layers, scale
        self.window = press.press.needs.window
        self.queries = queries[:, -self.window:] if queries is not None and self.window else None
        self.count = 0  # recompressions so far

    def __repr__(self) -> str:
        return (f"Recompressor(layer {self.layer}: {self.press.press.key} to {self.press.target} rows every "
                f"{self.press.every} tokens, {self.count} so far)")

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)

    def attend(self, queries: mx.array) -> None:
        if self.window:
            q = queries[0]
            self.queries = q if self.queries is None else mx.concatenate([self.queries, q], axis=1)[:, -self.window:]

    def __call__(self, cache) -> None:
        if cache.appended < self.press.every or cache.rows <= self.press.target:
            return
        k, v = cache.keys_and_values()
        positions = cache.positions()
        view = View(self.layer, self.n_layers, k[0].astype(mx.float32), v[0].astype(mx.float32), positions,
                    cache.offset, self.scale, self.queries)
        inner = dataclasses.replace(self.press.press, ratio=self.press.recompress_ratio(cache.rows))
        rows = inner.select(view)
        cache.keys = mx.take_along_axis(k, rows[None, :, :, None], axis=2)
        cache.values = mx.take_along_axis(v, rows[None, :, :, None], axis=2)
        cache.set_kept(mx.take_along_axis(positions, rows, axis=1), cache.offset, cache.offset)
        mx.eval(cache.keys, cache.values, cache.kept)
        self.count += 1


def attach(press, cache: list, scales: dict | None = None, queries: dict | None = None) -> list:
    """Hang a Recompressor on every compressed layer of ``cache`` when ``press`` is a decoding press
    (``scales``/``queries``: per layer, from the prompt's capture). Returns ``cache``."""
    if not isinstance(press, Decoding):
        return cache
    for i, c in enumerate(cache):
        for part in getattr(c, "caches", (c,)):
            if isinstance(part, QuantizedKeptKVCache):
                raise PressError("the decoding press re-compresses float KV; run it without kv_bits")
            if isinstance(part, KeptKVCache):
                d = int(part.keys_and_values()[0].shape[-1])
                hook = Recompressor(press, i, len(cache), (scales or {}).get(i, d ** -0.5), (queries or {}).get(i))
                part.on_append, part.on_attend = hook, hook.attend
    return cache
