"""How far cached logits may be from cold ones and still count as "the same", per dtype: the one
table tests, notebooks and the conformance grid read, so a model loaded in bfloat16 (a Mac, an
mlx-community checkpoint) is judged by a bfloat16 bound, and float32 keeps its tight one.

A restored cache holds bitwise the KV a cold prefill wrote; the logits still move by the matmul
shapes (a prefill in one piece or in two accumulates in another order), by about one rounding step
of the dtype at the logits' magnitude. ``LOGIT_TOLERANCE`` is for small models (the tiny ones, a few
layers, logits of magnitude ~10); ``DEEP_LOGIT_TOLERANCE`` for SmolLM2-135M (30 layers, logits ~20).

Example:
    >>> tolerance("float32"), tolerance("bfloat16", deep=True)
    (0.0001, 0.5)
    >>> logits_close(cold, warm, m.dtype)
    True
"""

from __future__ import annotations

from ..errors import KvlabError

# max |logit difference|, cached vs cold. float32: the values the tests always stated (measured
# ~1e-6 on tiny, ~5e-5 on SmolLM2). Half precision: a few rounding steps at the logits' magnitude
# (bf16 has 8 significant bits: a step is 2**-8 of the value, 0.0625 at 16).
LOGIT_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.125, "float16": 2e-2}
DEEP_LOGIT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.5, "float16": 6e-2}


def tolerance(dtype, *, deep: bool = False) -> float:
    """The max |logit difference| for ``dtype`` (a name, an mx dtype, or a kvlab Model: its dtype).

    Example:
        >>> tolerance(kv.load("tiny"))
        0.0001
    """
    name = _name(dtype)
    table = DEEP_LOGIT_TOLERANCE if deep else LOGIT_TOLERANCE
    if name not in table:
        raise KvlabError(f"no logit tolerance for dtype {name!r}; kvlab states one for "
                         f"{', '.join(table)}")
    return table[name]


def max_abs_diff(a, b) -> float:
    """max |a - b| over two logit arrays, compared in float32 (whatever dtype they are in)."""
    import mlx.core as mx

    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item())


def logits_close(a, b, dtype, *, deep: bool = False) -> bool:
    """True when max |a - b| is within ``tolerance(dtype, deep=deep)``.

    Example:
        >>> logits_close(cold, warm, "float32")
        True
    """
    return max_abs_diff(a, b) <= tolerance(dtype, deep=deep)


def _name(dtype) -> str:
    dtype = getattr(dtype, "dtype", dtype)  # a Model, or an array
    return str(dtype).rsplit(".", 1)[-1]
