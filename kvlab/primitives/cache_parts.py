"""A snapshot's layers as the parts a block store keeps apart, and back.

A paged store keeps full-attention KV in token blocks, a sliding window's KV in blocks it releases
once they fall out of every window it may restore, and a recurrent state whole, at the one
position it was taken. A CacheList layer (Falcon-H1: recurrent state + KV) is several parts;
every other layer is one. ``parts_of`` splits a snapshot; ``assemble`` puts parts back into
the layer states ``kvlab.primitives.snapshots.restore`` takes.

A RotatingKVCache state is a ring (``keys``, ``values``, ``offset``, ``keep``, ``max_size``,
``_idx``) whose order depends on how it was filled: ``window_kv`` puts it in temporal order and
says which position its first token is; ``rotating_state`` builds the state of a window that
holds exactly the given tokens, which continues as the cold cache would (mlx-lm drops all but the
last ``max_size - 1`` of them before the next multi-token step, and the mask hides the rest).

A ChunkedKVCache (Llama 4, chunk C) is held the same way, as a window of C (``WINDOWED``): mlx-lm
keeps only its last C tokens before each step (``maybe_trim_front``) and masks by absolute
position, so ``chunked_state`` of the last min(p, C) tokens before p, ``start_position`` at the
first of them, is the cache a cold prefill of p tokens continues from.

Example:
    >>> parts = parts_of(snap)                                   # doctest: +SKIP
    >>> [p.kind for p in parts]
    ['window', 'full', 'window', 'full']
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import cache as mlx_cache

from .. import device
from .display import summary_html
from .layout import FULL_CLASSES, KEPT_CLASSES
from .snapshots import LayerState


WINDOWED = ("window", "chunked")  # kinds held as the last W tokens before a position


def kind_of(cls: str) -> str:
    """The layer kind (``kvlab.primitives.layout.KINDS``) of an mlx-lm cache class name."""
    if cls in FULL_CLASSES:
        return "full"
    if cls == "RotatingKVCache":
        return "window"
    if cls == "ChunkedKVCache":
        return "chunked"
    if cls in KEPT_CLASSES:
        return "compressed"
    klass = getattr(mlx_cache, cls, None)
    if isinstance(klass, type) and issubclass(klass, mlx_cache.ArraysCache):
        return "recurrent"
    return "unknown"


@dataclass(frozen=True)
class Part:
    """One cache of a layer: ``layer`` index, ``sub`` (its index in a CacheList, else None),
    mlx-lm class, kind and state (a view into the snapshot)."""

    layer: int
    sub: int | None
    cls: str
    kind: str
    state: Any

    @property
    def label(self) -> str:
        where = f"layer {self.layer}" + ("" if self.sub is None else f" part {self.sub}")
        return f"{where} ({self.cls})"

    def __repr__(self) -> str:
        return f"Part({self.label}, {self.kind})"

    def _repr_html_(self) -> str:
        return summary_html("Part", self.label, self.kind)


def parts_of(snap) -> tuple[Part, ...]:
    """Every part of every layer of ``snap``, in layer order (CacheList parts in their order)."""
    out = []
    for i, layer in enumerate(snap.layers):
        if layer.kind == "CacheList":
            out += [Part(i, j, cls, kind_of(cls), state) for j, (state, cls) in enumerate(layer.state)]
        else:
            out.append(Part(i, None, layer.kind, kind_of(layer.kind), layer.state))
    return tuple(out)


def arrays_of(tree) -> list[mx.array]:
    return [a for _, a in tree_flatten(tree) if isinstance(a, mx.array)]


def nbytes_of(tree) -> int:
    """Bytes the device holds for the arrays of ``tree``, each its own buffer: ``array.nbytes``
    rounded up to the allocator's size (``kvlab.device.held_bytes``; the plain sum on CPU)."""
    return device.held_bytes(arrays_of(tree))


def copy_of(tree):
    """Fresh exact-size arrays (never views that keep a request's buffer alive), evaluated."""
    out = tree_map(lambda a: mx.array(a) if isinstance(a, mx.array) else a, tree)
    mx.eval(arrays_of(out))
    return out


def structure_of(parts: tuple[Part, ...]) -> tuple[Part, ...]:
    """``parts`` without their arrays (a store keeps the model's structure; arrays would keep a
    request's buffers alive)."""
    return tuple(replace(p, state=tree_map(lambda a: None if isinstance(a, mx.array) else a, p.state))
                 for p in parts)


def fresh_of(tree):
    """New containers and array objects over the same data: mlx-lm writes into a restored
    CacheList part's list, which must not be the one a store keeps."""
    return tree_map(lambda a: a[...] if isinstance(a, mx.array) else a, tree)


def full_kv(state, start: int, end: int) -> tuple:
    """Copies of tokens [start, end) of a full-KV state: (keys, values), quantized layers'
    (packed words, scales, biases) each, plus their (group_size, bits)."""
    kv = tree_map(lambda a: mx.array(a[..., start:end, :]), tuple(state[:2]))
    return tuple(kv) + tuple(state[3:5])


def window_kv(state) -> tuple[mx.array | None, mx.array | None, int]:
    """(keys, values, position of the first) of what a RotatingKVCache state holds, in temporal
    order (mlx-lm's ``_temporal_order``). Only windows without kept sink tokens (keep=0). A
    ChunkedKVCache state (5 fields) holds tokens [start_position, offset) of a longer buffer."""
    if len(state) == 5:
        keys, values, offset, _, start = state
        if keys is None:
            return None, None, int(offset)
        n = int(offset) - int(start)
        return keys[..., :n, :], values[..., :n, :], int(start)
    keys, values, offset, keep, _, idx = state
    if keys is None:
        return None, None, int(offset)

    def order(v):
        if idx == v.shape[2]:
            return v
        if idx < offset:  # a wrapped ring: the oldest token sits at idx
            return mx.concatenate([v[..., :keep, :], v[..., idx:, :], v[..., keep:idx, :]], axis=2)
        return v[..., :idx, :]

    k, v = order(keys), order(values)
    return k, v, int(offset) - k.shape[2]


def rotating_state(keys: mx.array, values: mx.array, offset: int, max_size: int) -> tuple:
    """The state of a RotatingKVCache at ``offset`` holding exactly ``keys``/``values`` (the last
    tokens before ``offset``, in temporal order)."""
    return (keys, values, int(offset), 0, int(max_size), int(keys.shape[2]))


def chunked_state(keys: mx.array, values: mx.array, offset: int, chunk: int) -> tuple:
    """The state of a ChunkedKVCache at ``offset`` holding exactly ``keys``/``values`` (the last
    tokens before ``offset``, in order)."""
    return (keys, values, int(offset), int(chunk), int(offset) - int(keys.shape[2]))


def windowed_state(part: Part, keys: mx.array, values: mx.array, offset: int) -> tuple:
    """The state of ``part`` (a ``WINDOWED`` kind) at ``offset`` holding exactly these tokens."""
    if part.kind == "chunked":
        return chunked_state(keys, values, offset, window_size(part))
    return rotating_state(keys, values, offset, window_size(part))


def window_size(part: Part) -> int:
    """W of a ``WINDOWED`` part: a sliding window's ``max_size``, a chunked cache's chunk size."""
    return int(part.state[3] if part.kind == "chunked" else part.state[4])


def assemble(template: tuple[Part, ...], states: dict[int, Any], offset: int) -> tuple[LayerState, ...]:
    """Layer states from one new state per part (``states[i]`` for ``template[i]``), grouped back
    into CacheLists where the template has them."""
    layers: dict[int, list] = {}
    for i, part in enumerate(template):
        if part.kind == "full":  # blocks cached below quantized_kv_start join quantized ones
            quantized = len(states[i]) == 5
            if quantized != (part.cls == "QuantizedKVCache"):
                part = replace(part, cls="QuantizedKVCache" if quantized else "KVCache")
        layers.setdefault(part.layer, []).append((part, states[i]))
    out = []
    for _, group in sorted(layers.items()):
        if group[0][0].sub is not None:
            state = tuple((s, p.cls) for p, s in group)
            out.append(LayerState("CacheList", state, 0, nbytes_of([s for _, s in group])))
            continue
        part, state = group[0]
        tokens = offset if part.kind in ("full", "chunked") else state[0].shape[2] if part.kind == "window" else 0
        out.append(LayerState(part.cls, state, tokens, nbytes_of(state)))
    return tuple(out)

