"""Which dtype a model runs in, and why: a model keeps its stored dtype on every platform unless the
user asks for another (``kv.load(..., dtype=...)``). kvlab never casts silently; where another dtype
would run faster (half precision on Linux CPU, whose bf16/fp16 matmuls skip BLAS) the model's repr
says so.

Example:
    >>> choose("bfloat16", None)          # on Linux CPU
    ('bfloat16', 'stored; dtype="float32" runs faster on this CPU')
    >>> choose("bfloat16", "float32")
    ('float32', 'cast from stored bfloat16, as asked')
"""

from __future__ import annotations

from collections import Counter

from .. import _blas

_blas.load_fast_blas()  # before mlx.core

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from ..device import current as current_device  # noqa: E402
from ..errors import KvlabError  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32")
HALF = ("float16", "bfloat16")


def half_is_slow() -> bool:
    """True where half-precision matmuls are much slower than float32: Linux CPU, where bf16/fp16
    skip BLAS (~5 GFLOP/s against 200+ for float32 with OpenBLAS). Not on macOS, not on a GPU."""
    return current_device().half_precision_slow


def default_dtype() -> str:
    """The dtype kvlab builds the embedded SmolLM2 in (its GGUF is 4-bit, so kvlab picks):
    float32 where half precision is slow (Linux CPU), bfloat16 elsewhere (macOS, a GPU)."""
    return "float32" if half_is_slow() else "bfloat16"


def check_dtype(dtype: str | None) -> None:
    """KvlabError unless ``dtype`` is None or one kvlab runs models in."""
    if dtype is not None and dtype not in DTYPES:
        raise KvlabError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)} or None "
                         "(= the model's stored dtype)")


def choose(stored: str, asked: str | None, *, built: bool = False) -> tuple[str, str]:
    """(the dtype to run, the note the model's repr shows) for a model stored in ``stored`` when the
    user asked for ``asked`` (None: keep it). ``built``: kvlab built the folder in ``stored`` itself
    (the embedded SmolLM2), so the folder's dtype is kvlab's choice, said as such."""
    if built:
        why = "built for CPU speed" if stored == "float32" and half_is_slow() else "built for this platform"
        return stored, (why if asked is None else "built as asked")
    if asked is not None and asked != stored:
        return asked, f"cast from stored {stored}, as asked"
    if stored in HALF and half_is_slow():
        return stored, 'stored; dtype="float32" runs faster on this CPU'
    return stored, "stored"


def stored_dtype(module) -> str:
    """The dtype most of a module's floating parameters are in (quantized weights: their scales')."""
    kinds = Counter(str(p.dtype).rsplit(".", 1)[-1] for _, p in tree_flatten(module.parameters())
                    if mx.issubdtype(p.dtype, mx.floating))
    return kinds.most_common(1)[0][0] if kinds else "float32"


def cast(module, dtype: str | None) -> str:
    """Cast ``module`` to ``dtype`` (None: keep the stored dtype) and return the dtype it now runs in."""
    stored = stored_dtype(module)
    dtype = dtype or stored
    if dtype != stored:
        module.set_dtype(getattr(mx, dtype))
    return dtype


def require_stored_dtype(model, peer: str) -> None:
    """KvlabError when ``model`` (a loaded kvlab model) runs in another dtype than its folder
    stores: ``peer`` (mlx_lm.server, vllm-mlx) loads the folder in its stored dtype and has no flag
    to change it, so a comparison with it would measure two dtypes.

    Example:
        >>> require_stored_dtype(kv.load("tiny", dtype="bfloat16"), "mlx_lm.server")
        Traceback (most recent call last):
        kvlab.errors.KvlabError: tiny runs in bfloat16 but its folder stores float32, ...
    """
    stored, runs = model.stored_dtype, model.dtype
    if stored != runs:
        raise KvlabError(f"{model.name} runs in {runs} but its folder stores {stored}, "
                         f"the dtype {peer} loads (it cannot be told another): a benchmark against it "
                         f"would compare {runs} with {stored}. Drop --dtype (every server then runs "
                         f"{stored}), or convert the folder to {runs} first (mlx_lm.convert --dtype "
                         f"{runs}) and benchmark that folder")
