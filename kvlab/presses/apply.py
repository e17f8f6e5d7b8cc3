"""A press applied to a prefilled cache: each full-attention layer becomes a KeptKVCache.

Which layers: every KVCache (and every KVCache part of a CacheList). Sliding windows, recurrent
states and chunked attention are left as they are (``left`` says which and what they are); a
model with no full-attention layer is refused rather than compressed to nothing.

Example:
    >>> kept, compressed = apply_press(press, cache, capture, net=m.net, length=len(ids))
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from ..errors import PressError
from ..primitives.kept_cache import KeptKVCache
from ..primitives.layout import layer_kind
from .base import Press, View, ascending
from .capture import Capture


def full_layers(cache) -> list[tuple[int, int | None, object]]:
    """``(layer, part or None, cache object)`` of every full-attention KV cache a press compresses."""
    out = []
    for i, c in enumerate(cache):
        if type(c) is mlx_cache.KVCache:
            out.append((i, None, c))
        elif type(c) is mlx_cache.CacheList:
            out += [(i, j, p) for j, p in enumerate(c.caches) if type(p) is mlx_cache.KVCache]
    return out


def left_layers(cache) -> tuple[tuple[int, str], ...]:
    """``(layer, what it is)`` of every layer a press leaves as it is."""
    full = {i for i, _, _ in full_layers(cache)}
    return tuple((i, layer_kind(c).label) for i, c in enumerate(cache) if i not in full)


def check_compressible(model, cache) -> list:
    """The layers to compress, or PressError for a model that has none."""
    found = full_layers(cache)
    if not found:
        kinds = "; ".join(f"layer {i}: {label}" for i, label in left_layers(cache)) or "no layers"
        raise PressError(f"{getattr(model, 'name', 'this model')} has no full-attention layer ({kinds}): a "
                         "press compresses full-attention KV only, so it would compress nothing")
    return found


def ropes_of(net, layers) -> dict[int, object]:
    """layer -> the ``rope`` of that decoder layer's attention (``Capture`` checks it is a pure
    rotation before using it)."""
    decoder = getattr(net, "layers", None) or []
    out = {}
    for i, _, c in layers:
        if i >= len(decoder):
            continue
        for _, mod in decoder[i].named_modules():
            rope = getattr(mod, "rope", None)
            if callable(rope):
                out[i] = rope
                break
    return out


def view_of(layer: int, c, n_layers: int, capture: Capture | None) -> View:
    t = int(c.offset)
    k, v = c.keys[0, :, :t, :], c.values[0, :, :t, :]
    heads = k.shape[0]
    positions = mx.broadcast_to(mx.arange(t, dtype=mx.int32), (heads, t))
    if capture is None:
        return View(layer, n_layers, k.astype(mx.float32), v.astype(mx.float32), positions, t,
                    float(k.shape[-1]) ** -0.5)
    return View(layer, n_layers, k.astype(mx.float32), v.astype(mx.float32), positions, t,
                capture.scale.get(layer, float(k.shape[-1]) ** -0.5), capture.queries.get(layer),
                capture.observed(layer, t), capture.stats(layer, t))


def kept_cache(c, rows: mx.array) -> KeptKVCache:
    """The rows [H, n] of a KVCache (-1: a row that head does not use) as a KeptKVCache."""
    t = int(c.offset)
    safe = mx.maximum(rows, 0)[None, :, :, None]
    keys = mx.take_along_axis(c.keys[..., :t, :], safe, axis=2)
    values = mx.take_along_axis(c.values[..., :t, :], safe, axis=2)
    return KeptKVCache(keys, values, rows, t)


def apply_press(press: Press, cache: list, capture: Capture | None, layers) -> tuple[list, tuple[int, ...]]:
    """Compress ``layers`` (``full_layers(cache)``) of ``cache`` in place; returns (kept positions
    per layer, None where left, and the compressed layer indices)."""
    kept: list = [None] * len(cache)
    for i, part, c in layers:
        view = view_of(i, c, len(cache), capture)
        rows = press.select(view)
        if rows.ndim != 2 or rows.shape[0] != view.heads:
            raise PressError(f"{press.name} selected rows of shape {tuple(rows.shape)} on layer {i}; a "
                             f"press keeps rows per KV head: [{view.heads}, n]")
        new = kept_cache(c, rows.astype(mx.int32))
        mx.eval(new.keys, new.values, new.kept)
        if part is None:
            cache[i] = new
        else:  # mlx-lm's CacheList keeps its parts in a tuple
            parts = list(cache[i].caches)
            parts[part] = new
            cache[i].caches = type(cache[i].caches)(parts)
        if kept[i] is None:
            kept[i] = ascending(new.kept)
    return kept, tuple(sorted({i for i, _, _ in layers}))
