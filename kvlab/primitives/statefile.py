"""Cache state trees in safetensors files: a JSON skeleton to rebuild a nested state tree from its
flat arrays, and the digest ``kv.save`` writes and ``kv.load_snapshot`` checks.

The digest covers every array (name, dtype, shape, bytes) and, from snapshot format 2 on, the
metadata that says how to read them (layer classes, offsets, quantization bits and group sizes,
token ids, fingerprint): a file whose metadata was edited to call quantized KV float (or the
reverse) fails the check instead of loading wrong.

Example:
    >>> structure(((1, 2), None, 3))
    [['leaf', 'leaf'], None, 'leaf']
    >>> rebuild([['leaf', 'leaf'], None, 'leaf'], {"0.0": 1, "0.1": 2, "2": 3}, "")
    ((1, 2), None, 3)
"""

from __future__ import annotations

import mlx.core as mx
import xxhash


def digest(arrays: dict, meta_text: str = "") -> str:
    """xxh3-128 over the arrays (sorted by name) and then ``meta_text``."""
    h = xxhash.xxh3_128()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(name.encode())
        h.update(str((a.dtype, a.shape)).encode())
        if a.size:
            h.update(memoryview(mx.contiguous(a.view(mx.uint8))))
    if meta_text:
        h.update(meta_text.encode())
    return h.hexdigest()


def structure(tree):
    """A JSON skeleton of a state tree (tuples/lists/None/leaves) to rebuild it on load."""
    if isinstance(tree, (tuple, list)):
        return [structure(t) for t in tree]
    return None if tree is None else "leaf"


def rebuild(skeleton, flat: dict, prefix: str):
    """The state tree of ``skeleton`` with its leaves taken from ``flat`` (keys "0", "0.1", ...)."""
    if isinstance(skeleton, list):
        return tuple(rebuild(s, flat, f"{prefix}.{j}" if prefix else str(j)) for j, s in enumerate(skeleton))
    return None if skeleton is None else flat[prefix]
