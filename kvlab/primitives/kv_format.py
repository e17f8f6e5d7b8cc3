"""Quantized KV caches, the low level: mlx-lm's ``QuantizedKVCache`` settings, the conversion mlx-lm's
generate applies (``maybe_quantize_kv_cache``) with kvlab errors, the KV format of a cache or
snapshot, and the exact bytes a quantized token occupies.

mlx-lm's meaning, kept here: with ``kv_bits`` set, each layer that can quantize (``to_quantized``)
is converted once its offset reaches ``quantized_kv_start``, *after* the model call that reached it.
A converted layer stays quantized: every token appended later is quantized as it is written.
Group sizes must divide the head dimension (SmolLM2: 64, so 32 or 64; kvlab's tiny: 16, so none).

Example:
    >>> cache = kv.make_cache(m)
    >>> logits, cache = kv.prefill(m, ids, cache, kv_bits=4, kv_group_size=64)
    >>> kv_format(cache), quantized_bytes_per_token(4, 64, head_dim=64, kv_heads=3, layers=30)
    ('q4g64', 7200)
"""

from __future__ import annotations


from ..errors import QuantizationError, SnapshotError

BITS = (1, 2, 3, 4, 5, 6, 8)        # what mx.quantize packs
GROUP_SIZES = (32, 64, 128)         # what mx.quantize groups by
ATTENTION = ("KVCache", "QuantizedKVCache", "ConcatenateKVCache", "ChunkedKVCache", "RotatingKVCache",
             "KeptKVCache", "QuantizedKeptKVCache")


def check_settings(bits, group_size, head_dims=()) -> None:
    """Raise QuantizationError unless mlx can quantize KV of ``head_dims`` with these settings.

    Example:
        >>> check_settings(4, 64, head_dims=(64,))
    """
    if isinstance(bits, bool) or bits not in BITS:
        raise QuantizationError(f"kv_bits must be one of {BITS} (what mx.quantize packs), got {bits!r}")
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise QuantizationError(f"kv_group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    bad = sorted({d for d in head_dims if d % group_size})
    if bad:
        valid = [g for g in GROUP_SIZES if all(d % g == 0 for d in head_dims)]
        raise QuantizationError(
            f"kv_group_size {group_size} does not divide the head dimension {bad[0]}: mlx quantizes "
            f"each token's head vector in groups of that size. "
            + (f"Use kv_group_size in {tuple(valid)}." if valid else
               "No group size mlx supports divides it, so this model's KV cannot be quantized."))


def head_dims_of(model) -> tuple[int, ...]:
    """The attention head dimension a kvlab model's config declares (empty when it says nothing),
    to check a group size before the first request rather than during it."""
    config = getattr(model, "config", None) or {}
    for cfg in (config, config.get("text_config") or {}):
        dim = cfg.get("head_dim") or (cfg.get("hidden_size", 0) // cfg.get("num_attention_heads", 0)
                                      if cfg.get("num_attention_heads") else None)
        if dim:
            return (int(dim),)
    return ()


def check_start(start) -> int:
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise QuantizationError(f"quantized_kv_start must be an int >= 0 (tokens), got {start!r}")
    return start


def maybe_quantize(cache: list, kv_bits=None, kv_group_size: int = 64, quantized_kv_start: int = 0) -> list:
    """mlx-lm's ``maybe_quantize_kv_cache``, in place on the cache list, with kvlab errors: each layer
    with ``to_quantized`` whose offset reached ``quantized_kv_start`` becomes a QuantizedKVCache.
    ``kv_bits=None`` does nothing.

    Example:
        >>> maybe_quantize(cache, 4, 64, 0)[0]
        <mlx_lm.models.cache.QuantizedKVCache object at ...>
    """
    if kv_bits is None:
        return cache
    for i, c in enumerate(cache):
        if not hasattr(c, "to_quantized") or c.offset < quantized_kv_start:
            continue
        if c.keys is not None:
            check_settings(kv_bits, kv_group_size, (c.keys.shape[-1], c.values.shape[-1]))
        try:
            cache[i] = c.to_quantized(group_size=kv_group_size, bits=kv_bits)
        except NotImplementedError as e:
            raise QuantizationError(f"layer {i} is a {type(c).__name__}, which mlx-lm cannot quantize "
                                    f"({e}); run this model without kv_bits") from e
    return cache


def layer_format(kind: str, state) -> str | None:
    """The KV format of one layer given its mlx-lm class name and state: "q4g64" for a
    QuantizedKVCache (bits 4, group size 64), the float dtype ("float32") for attention KV,
    None for layers without token KV (SSM/conv state) or without any tokens yet."""
    if kind in ("QuantizedKVCache", "QuantizedKeptKVCache"):  # the kept cache keeps the same fields first
        return f"q{state[4]}g{state[3]}"
    if kind in ATTENTION and state and state[0] is not None:
        return str(state[0].dtype).removeprefix("mlx.core.")
    return None


def kv_format(x) -> str:
    """One name for the KV format of a cache list or a snapshot, so a float and a quantized
    snapshot of the same model are never taken for each other: "q4g64" (4-bit, group size 64),
    "float32"/"bfloat16"/"float16", or "none" (no attention tokens yet).

    Example:
        >>> kv_format(kv.snapshot(cache))
        'float32'
    """
    if hasattr(x, "layers"):
        found = {layer_format(layer.kind, layer.state) for layer in x.layers}
    else:
        found = {layer_format(type(c).__name__, c.state) for c in x}
    found.discard(None)
    if len(found) > 1:
        raise SnapshotError(f"the cache mixes KV formats {sorted(found)} across layers; kvlab and mlx-lm "
                            "quantize every attention layer at once, so this was assembled by hand")
    return found.pop() if found else "none"


def parse_format(fmt: str) -> tuple[int, int] | None:
    """(bits, group size) of a quantized format name, None for a float one.

    Example:
        >>> parse_format("q4g64"), parse_format("float32")
        ((4, 64), None)
    """
    if not fmt.startswith("q"):
        return None
    bits, group = fmt[1:].split("g")
    return int(bits), int(group)


def check_reusable(snap, kv_bits, kv_group_size: int = 64, quantized_kv_start: int = 0) -> None:
    """Raise SnapshotError unless ``snap`` is KV this engine setting could itself have cached:
    quantized with exactly (kv_bits, kv_group_size), or float below quantized_kv_start (float
    only when kv_bits is None). Reusing KV of another format would silently change the logits."""
    fmt = kv_format(snap)
    q = parse_format(fmt)
    want = "float KV" if kv_bits is None else f"q{kv_bits}g{kv_group_size}"
    fix = "give each KV format its own store (or file)"
    if q is not None and q != (kv_bits, kv_group_size):
        raise SnapshotError(f"the cached KV is quantized ({fmt}: {q[0]}-bit, group size {q[1]}) but this "
                            f"engine runs {want}; {fix}")
    if q is None and kv_bits is not None and fmt != "none" and snap.offset >= quantized_kv_start:
        raise SnapshotError(f"the cached KV is {fmt} for {snap.offset} tokens, but this engine quantizes "
                            f"its KV ({want}) from token {quantized_kv_start} on; {fix}")


def quantized_bytes_per_token(bits: int, group_size: int, *, head_dim: int, kv_heads: int,
                              layers: int = 1, scale_bytes: int = 4, v_head_dim: int | None = None) -> int:
    """Bytes one token's keys and values take in QuantizedKVCache layers: per layer and head, the
    packed uint32 words (head_dim * bits / 32 of them, 4 bytes each) plus one scale and one bias
    (``scale_bytes`` each, the model's dtype) per group of ``group_size`` values.

    Example:
        >>> quantized_bytes_per_token(4, 64, head_dim=64, kv_heads=3)   # one layer, float32 scales
        240
    """
    def side(dim):
        packed = dim * bits // 32 * 4
        return packed + 2 * (dim // group_size) * scale_bytes
    return layers * kv_heads * (side(head_dim) + side(v_head_dim or head_dim))
