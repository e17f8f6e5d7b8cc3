"""Quantized KV caches as an experiment: quantize/dequantize snapshots, the accuracy sweep
(KL divergence and top-1 agreement against the float cache, bytes per token, peak memory) and the
error that reusing a quantized prefix adds on top of quantization itself.

The sweep uses mlx-lm's own semantics (``generate(..., kv_bits=, quantized_kv_start=0)``): a prefix
is prefilled in float, the cache is converted to QuantizedKVCache, and the next tokens are run
teacher-forced through it, each token's KV quantized as it is written; their next-token
distributions are compared with the same run on the float cache.

Example:
    >>> m = kv.load()
    >>> df = kv.quantization_sweep(m, [text], bits=(2, 4, 8), lengths=(64,), eval_tokens=32)
    >>> df.select("kv_format", "kl_mean", "top1_agree", "bytes_per_token")
"""

from __future__ import annotations

import mlx.core as mx
import polars as pl

from .errors import QuantizationError
from .primitives import timing
from .primitives.kv_format import GROUP_SIZES, check_settings, kv_format, layer_format, maybe_quantize
from .primitives.kv_format import quantized_bytes_per_token
from .primitives.snapshots import LayerState, Snapshot, make_cache, prefill, restore, snapshot
from .primitives.tokens import as_tokens

# Plain English prose (written for kvlab) for sweeps, benchmarks and tests: KL on real text, not on
# random ids, is what tells a quantization apart; each is ~115 SmolLM2 tokens.
SAMPLE_TEXTS = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press adapted from wine making. "
    "Within fifty years printing shops had spread to more than two hundred cities across Europe, and "
    "the price of books fell so quickly that reading became a habit of merchants and craftsmen rather "
    "than a privilege of monks and nobles. Scholars could now compare identical copies of a text, "
    "correct errors in later editions, and build on each other's work with a speed that had never "
    "been possible when every book was copied by hand.",
    "A kitchen garden rewards a little planning in late winter. Seeds of tomatoes and peppers are "
    "started indoors on a sunny windowsill, while peas and spinach can go straight into the cold "
    "ground as soon as it can be worked. By the middle of spring the first lettuce is ready to cut, "
    "and the soil, loosened with compost, warms enough for beans and squash. Watering early in the "
    "morning keeps the leaves dry through the day, which protects the plants from mildew, and a thin "
    "layer of straw between the rows holds moisture and keeps most weeds from taking root.",
    "When the river flooded the valley every spring, the farmers along its banks learned to read the "
    "water. A pale, muddy current meant snow melting in the mountains and a slow, steady rise; a dark "
    "current carrying branches meant a storm upstream and a flood that could arrive overnight. Over "
    "generations they built their houses on low hills, stored grain in lofts above the reach of the "
    "water, and planted willows whose roots held the soil of the banks together. The river that "
    "threatened them also left behind the rich silt that made their fields the most fertile in the land.",
)

SWEEP_SCHEMA = {"text": pl.Int64, "prefix_tokens": pl.Int64, "eval_tokens": pl.Int64,
                "kv_format": pl.Utf8, "bits": pl.Int64, "group_size": pl.Int64, "kl_mean": pl.Float64,
                "kl_max": pl.Float64, "top1_agree": pl.Float64, "bytes_per_token": pl.Float64,
                "formula_bytes_per_token": pl.Int64, "bytes_ratio": pl.Float64, "peak_bytes": pl.Int64,
                "peak_extra_bytes": pl.Int64, "seconds": pl.Float64}


def quantize(x, bits: int = 4, group_size: int = 64):
    """A quantized copy of a snapshot (a new Snapshot) or of a live cache list (a new list; the
    layers you passed are not touched), as mlx-lm's ``KVCache.to_quantized`` makes it.

    Example:
        >>> q = kv.quantize(snap, bits=4, group_size=64)
        >>> kv.kv_format(q), q.nbytes < snap.nbytes
        ('q4g64', True)
    """
    check_settings(bits, group_size)
    if isinstance(x, Snapshot):
        found = kv_format(x)
        if found.startswith("q") and found != f"q{bits}g{group_size}":
            raise QuantizationError(f"the snapshot is already quantized ({found}); kv.dequantize it first "
                                    "(re-quantizing quantized KV compounds the error)")
        q = snapshot(maybe_quantize(restore(x), bits, group_size, 0))
        return Snapshot(q.layers, q.offset, x.token_ids, x.fingerprint)
    return maybe_quantize(list(x), bits, group_size, 0)


def dequantize(snap: Snapshot) -> Snapshot:
    """A float snapshot (KVCache layers, the scales' dtype) of a quantized one: the KV values the
    quantized cache stands for, e.g. to continue in float after restoring a compact prefix.

    Example:
        >>> kv.kv_format(kv.dequantize(kv.quantize(snap)))
        'float32'
    """
    layers = []
    for layer in snap.layers:
        if layer.kind != "QuantizedKVCache" or layer.state[0] is None:
            layers.append(layer)
            continue
        kq, vq, offset, group, bits = layer.state
        k, v = (mx.dequantize(*a, group_size=group, bits=bits) for a in (kq, vq))
        layers.append(LayerState("KVCache", (k, v, offset), offset, k.nbytes + v.nbytes))
    mx.eval([layer.state[:2] for layer in layers if layer.kind == "KVCache" and layer.tokens])
    return Snapshot(tuple(layers), snap.offset, snap.token_ids, snap.fingerprint)


def attention_shapes(model) -> list[tuple[int, int, int, int]]:
    """(kv_heads, key head_dim, value head_dim, bytes per value) of each attention layer, read off
    one token's cache (what the model really writes, whatever its config calls it).

    Example:
        >>> attention_shapes(kv.load())[0]
        (3, 64, 64, 4)
    """
    _, cache = prefill(model, [0], make_cache(model))
    return [(c.keys.shape[1], c.keys.shape[-1], c.values.shape[-1], c.keys.dtype.size)
            for c in cache if layer_format(type(c).__name__, c.state) is not None]


def valid_group_sizes(shapes) -> tuple[int, ...]:
    """The group sizes mlx supports that divide every attention head dimension."""
    return tuple(g for g in GROUP_SIZES if all(k % g == 0 and v % g == 0 for _, k, v, _ in shapes))


def formula_bytes_per_token(shapes, bits: int | None, group_size: int | None) -> int:
    """Bytes one token takes over all attention layers: float (heads * dims * value size) or
    quantized (``kvlab.primitives.kv_format.quantized_bytes_per_token``)."""
    if bits is None:
        return sum(h * (k + v) * size for h, k, v, size in shapes)
    return sum(quantized_bytes_per_token(bits, group_size, head_dim=k, v_head_dim=v, kv_heads=h,
                                         scale_bytes=size) for h, k, v, size in shapes)


def _attention_bytes(snap: Snapshot) -> int:
    return sum(layer.nbytes for layer in snap.layers if layer_format(layer.kind, layer.state) is not None)


def _compare(ref, other) -> tuple[float, float, float]:
    """(mean KL(ref || other), max KL, top-1 agreement) over positions of [positions, vocab] logits."""
    lp, lq = (x - mx.logsumexp(x, axis=-1, keepdims=True) for x in (ref, other))
    kl = mx.sum(mx.exp(lp) * (lp - lq), axis=-1)
    agree = mx.mean((mx.argmax(ref, axis=-1) == mx.argmax(other, axis=-1)).astype(mx.float32))
    return float(mx.mean(kl).item()), float(mx.max(kl).item()), float(agree.item())


def _timed_eval(model, ids, cache, **quant):
    mx.eval([c.state for c in cache])  # the conversion is not part of the measured run
    mx.reset_peak_memory()
    active, t = mx.get_active_memory(), timing.timed()
    logits, cache = prefill(model, ids, cache, all_logits=True, **quant)
    secs, peak = t.done(logits, [layer.state for layer in cache]), int(mx.get_peak_memory())
    return logits, cache, secs, (peak, peak - active)


def quantization_sweep(model, texts, bits=(2, 3, 4, 6, 8), group_sizes=None, lengths=(64,),
                       eval_tokens: int = 32) -> pl.DataFrame:
    """Accuracy and size of quantized KV caches against the float cache, one row per text, prefix
    length and KV format (a float row each, KL 0). For each text and each ``lengths`` value P,
    the first P tokens are prefilled in float, then the cache is quantized and the next
    ``eval_tokens`` tokens run teacher-forced: KL(float || quantized) of their next-token
    distributions (mean and max over positions, nats), top-1 agreement, stored bytes per token
    (measured from the snapshot, and the formula from bits, group size and head dims), peak
    memory of that run (``mx.get_peak_memory`` after ``mx.reset_peak_memory``: ``peak_bytes`` with
    the weights, ``peak_extra_bytes`` above what was allocated when it started) and its seconds.

    ``group_sizes=None`` takes every mlx group size (32, 64, 128) that divides the model's head
    dimension; one that does not divide it raises QuantizationError before any work.

    Example:
        >>> df = kv.quantization_sweep(kv.load(), [text], bits=(4, 8), group_sizes=(64,))
        >>> df.group_by("kv_format").agg(pl.col("kl_mean").mean())
    """
    texts = [texts] if isinstance(texts, str) else list(texts)
    bits = (bits,) if isinstance(bits, int) else tuple(bits)
    lengths = (lengths,) if isinstance(lengths, int) else tuple(lengths)
    if not texts or not bits or not lengths or eval_tokens < 1:
        raise QuantizationError("quantization_sweep needs texts, bits and lengths, and eval_tokens >= 1")
    shapes = attention_shapes(model)
    if not shapes:
        raise QuantizationError(f"{getattr(model, 'name', 'this model')} has no attention KV to quantize")
    dims = tuple(d for _, k, v, _ in shapes for d in (k, v))
    if group_sizes is None:
        group_sizes = valid_group_sizes(shapes)
        if not group_sizes:
            check_settings(bits[0], GROUP_SIZES[0], dims)  # raises, naming the head dimension
    group_sizes = (group_sizes,) if isinstance(group_sizes, int) else tuple(group_sizes)
    for b in bits:
        for g in group_sizes:
            check_settings(b, g, dims)
    ids_all = [as_tokens(t, model, name=f"text {i}").ids for i, t in enumerate(texts)]
    for i, ids in enumerate(ids_all):
        if len(ids) < max(lengths) + eval_tokens:
            raise QuantizationError(f"text {i} has {len(ids)} tokens; lengths up to {max(lengths)} with "
                                    f"eval_tokens={eval_tokens} need {max(lengths) + eval_tokens}: pass "
                                    "longer texts, shorter lengths or fewer eval_tokens")
    float_bytes = formula_bytes_per_token(shapes, None, None)
    rows = []
    for i, ids in enumerate(ids_all):
        for p in lengths:
            _, cache = prefill(model, ids[:p])
            base = snapshot(cache)
            window = ids[p : p + eval_tokens]
            ref, fcache, secs, peak = _timed_eval(model, window, restore(base))
            n = p + eval_tokens
            rows.append((i, p, eval_tokens, kv_format(base), None, None, 0.0, 0.0, 1.0,
                         _attention_bytes(snapshot(fcache)) / n, float_bytes, 1.0, *peak, secs))
            for b in bits:
                for g in group_sizes:
                    qcache = maybe_quantize(restore(base), b, g, 0)
                    logits, qc, secs, peak = _timed_eval(model, window, qcache, kv_bits=b, kv_group_size=g)
                    kl_mean, kl_max, agree = _compare(ref, logits)
                    stored = _attention_bytes(snapshot(qc)) / n
                    rows.append((i, p, eval_tokens, f"q{b}g{g}", b, g, kl_mean, kl_max, agree, stored,
                                 formula_bytes_per_token(shapes, b, g), stored / float_bytes, *peak, secs))
    return pl.DataFrame(rows, schema=SWEEP_SCHEMA, orient="row")


REUSE_SCHEMA = {"case": pl.Utf8, "prefix_tokens": pl.Int64, "suffix_tokens": pl.Int64,
                "stored_kv": pl.Utf8, "max_abs_vs_float": pl.Float64, "kl_vs_float": pl.Float64,
                "top1_as_float": pl.Boolean, "max_abs_vs_quantized_cold": pl.Float64,
                "kl_vs_quantized_cold": pl.Float64}


def quantized_reuse_error(model, text, prefix_tokens: int, *, bits: int = 4,
                          group_size: int = 64) -> pl.DataFrame:
    """What reusing a cached prefix adds to the logit error of KV quantization, at the prompt's
    last position (the first generated token's logits). Rows:

    - ``float cold`` / ``float reuse``: the float baseline, and float reuse (~0: reuse alone is exact);
    - ``quantized cold``: the prompt prefilled with kv_bits as mlx-lm does (the prefix and suffix
      computed against float KV, then quantized): quantization itself;
    - ``quantized reuse``: the quantized prefix snapshot restored and the suffix prefilled on it (what
      ``kv.Engine(kv_bits=...)`` does on a hit: the suffix attends to quantized KV);
    - ``quantized prefix, float suffix``: the quantized prefix dequantized and the suffix run in float
      (a store keeping compact KV, computing in float).

    ``max_abs_vs_quantized_cold`` of the reuse rows is the error reuse adds on top of quantization.

    Example:
        >>> kv.quantized_reuse_error(kv.load(), text, 64, bits=4)
    """
    ids = as_tokens(text, model, name="text").ids
    if not 0 < prefix_tokens < len(ids) - 1:
        raise QuantizationError(f"prefix_tokens must be in 1..{len(ids) - 2} for a text of {len(ids)} "
                                f"tokens (a suffix of at least 2 tokens), got {prefix_tokens}")
    quant = {"kv_bits": bits, "kv_group_size": group_size, "quantized_kv_start": 0}
    check_settings(bits, group_size, tuple(d for _, k, v, _ in attention_shapes(model) for d in (k, v)))
    head, tail = ids[:prefix_tokens], ids[prefix_tokens:]
    float_cold, _ = prefill(model, ids)
    q_cold, _ = prefill(model, ids, **quant)
    _, fcache = prefill(model, head)
    _, qcache = prefill(model, head, **quant)
    fsnap, qsnap = snapshot(fcache), snapshot(qcache)
    cases = [("float cold", kv_format(fsnap), float_cold),
             ("float reuse", kv_format(fsnap), prefill(model, tail, restore(fsnap))[0]),
             ("quantized cold", kv_format(qsnap), q_cold),
             ("quantized reuse", kv_format(qsnap), prefill(model, tail, restore(qsnap), **quant)[0]),
             ("quantized prefix, float suffix", kv_format(qsnap),
              prefill(model, tail, restore(dequantize(qsnap)))[0])]
    rows = []
    for case, stored, logits in cases:
        kl_f, _, agree = _compare(float_cold[None], logits[None])
        kl_q, _, _ = _compare(q_cold[None], logits[None])
        rows.append((case, prefix_tokens, len(tail), stored, float(mx.abs(logits - float_cold).max().item()),
                     kl_f, agree == 1.0, float(mx.abs(logits - q_cold).max().item()), kl_q))
    return pl.DataFrame(rows, schema=REUSE_SCHEMA, orient="row")
