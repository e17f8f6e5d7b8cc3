"""The KV of one radix edge: exact-size token slices of every attention layer, and joining a path's
slices back into one snapshot (SharedRadixStore's storage, like PagedStore's blocks but of any
length).

An edge's KV is itself a ``Snapshot`` of its own tokens: per layer a ``KVCache`` state
``(keys, values, n)`` with keys and values of shape [batch, kv_heads, n, head_dim], or a
``QuantizedKVCache`` state ``(keys, values, n, group_size, bits)`` whose keys and values are each
(packed words, scales, biases), all with the token axis at -2.

Example:
    >>> edge = cut(snap, 0, 16)                 # its own copy of tokens [0, 16)
    >>> head, tail = cut(edge, 0, 10), cut(edge, 10, 16)
    >>> join([(head, 10), (tail, 6)], ids[:16]).offset
    16
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from .. import device
from ..errors import SnapshotError
from ..primitives.snapshots import LayerState, Snapshot

def _arrays(tree) -> list:
    return [a for _, a in tree_flatten(tree) if isinstance(a, mx.array)]


def _kv(layer: LayerState):
    return tuple(layer.state[:2])  # (keys, values): arrays, or (words, scales, biases) each


def nbytes_of(snap: Snapshot, start: int, end: int) -> int:
    """Bytes tokens [start, end) of ``snap`` take once cut, as the device holds them (no copy is
    made to tell).

    Example:
        >>> nbytes_of(snap, 0, snap.offset) == snap.nbytes
        True
    """
    return device.held_bytes(a[..., start:end, :] for layer in snap.layers for a in _arrays(_kv(layer)))


def cut(snap: Snapshot, start: int, end: int) -> Snapshot:
    """Tokens [start, end) of ``snap`` as a snapshot holding its own copy of their KV.

    A copy, not a view, so an edge never keeps a whole request buffer alive (``mx.array`` copies;
    ``mx.contiguous`` returns a one-KV-head slice as the view it is), made in fresh memory on CPU:
    MLX's buffer cache would hand a small copy a freed buffer up to twice its size
    (``kvlab.device.Device.clears_cache_for_copies``: not on Metal or CUDA).

    Example:
        >>> cut(snap, 4, 9).offset
        5
    """
    n = end - start
    device.before_copies()
    layers = []
    for layer in snap.layers:
        kv = tree_map(lambda a: mx.array(a[..., start:end, :]), _kv(layer))
        layers.append(LayerState(layer.kind, (*kv, n, *layer.state[3:5]), n,
                                 device.held_bytes(_arrays(kv))))
    mx.eval([_arrays(layer.state) for layer in layers])
    ids = None if snap.token_ids is None else snap.token_ids[start:end]
    return Snapshot(tuple(layers), n, ids, snap.fingerprint)


def _quantized(layer: LayerState, group: int, bits: int):
    """A layer's (keys, values) in (group, bits) quantized form (float edges cached before
    quantization started: mlx quantizes each token's groups on their own, so quantizing an edge
    alone equals what mlx-lm's conversion of the whole cache gives)."""
    if layer.kind == "QuantizedKVCache":
        return _kv(layer)
    return tuple(mx.quantize(x, group_size=group, bits=bits) for x in _kv(layer))


def _cat(parts):
    if isinstance(parts[0], mx.array):
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-2)
    return tuple(_cat([p[j] for p in parts]) for j in range(len(parts[0])))


def join(parts: list[tuple[Snapshot, int]], ids, fingerprint: str | None = None) -> Snapshot:
    """One snapshot of the first ``take`` tokens of each edge in ``parts`` (``(edge, take)`` in
    path order). A single part is returned as views of its arrays (no copy); more are concatenated.

    Example:
        >>> join([(root_edge, 12), (leaf_edge, 3)], key.ids[:15]).offset
        15
    """
    n = sum(take for _, take in parts)
    layers = []
    for i in range(len(parts[0][0].layers)):
        edges = [(edge.layers[i], take) for edge, take in parts]
        quant = {tuple(layer.state[3:5]) for layer, _ in edges if layer.kind == "QuantizedKVCache"}
        if len(quant) > 1:
            raise SnapshotError(f"this SharedRadixStore holds layer {i} quantized with different (group "
                                f"size, bits) {sorted(quant)}: use one store per KV format")
        fmt = quant.pop() if quant else None
        if fmt:
            kvs = [_quantized(layer, *fmt) for layer, _ in edges]
        else:
            kvs = [_kv(layer) for layer, _ in edges]
        kvs = [kv if take == layer.tokens else tree_map(lambda a: a[..., :take, :], kv)
               for kv, (layer, take) in zip(kvs, edges)]
        k, v = _cat([kv[0] for kv in kvs]), _cat([kv[1] for kv in kvs])
        nbytes = sum(a.nbytes for a in _arrays((k, v)))
        if fmt:
            layers.append(LayerState("QuantizedKVCache", (k, v, n, *fmt), n, nbytes))
        else:
            layers.append(LayerState("KVCache", (k, v, n), n, nbytes))
    mx.eval([_arrays(layer.state) for layer in layers])
    return Snapshot(tuple(layers), n, tuple(int(t) for t in ids), fingerprint)
