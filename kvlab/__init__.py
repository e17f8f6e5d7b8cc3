"""kvlab: look inside prompt-prefix caches on MLX.

    import kvlab as kv
    m = kv.load()                         # embedded SmolLM2-135M-Instruct
    toks = kv.tokenise(m, [{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

from . import _blas

_blas.load_fast_blas()  # must precede the first `import mlx.core`

import importlib

from .errors import (BlockSizeError, BoundaryError, BudgetError, ImageError, KvlabError,
                     ModelNotFoundError, NotTrimmableError, QuantizationError, RequestError,
                     SnapshotError, TemplateError, TokenIdError, TraceError)

__version__ = "0.1.0"

# name -> module; resolved on first use so `import kvlab` stays cheap and viz stays optional
_LAZY = {
    "load": "models", "Model": "models", "fingerprint": "models",
    "load_vlm": "vlm", "VLModel": "vlm",
    "tokenise": "tokens", "Tokens": "tokens", "Span": "tokens",
    "split_at_boundary": "boundary", "Split": "boundary",
    "prefill": "snapshots", "snapshot": "snapshots", "restore": "snapshots", "trim": "snapshots",
    "save": "snapshots", "load_snapshot": "snapshots", "Snapshot": "snapshots",
    "block_hashes": "blocks", "make_cache": "snapshots", "compact": "snapshots",
    "diverge": "divergence", "Divergence": "divergence", "volatile_fields": "volatile",
    "normalise": "normalisation", "normalise_text": "normalisation", "Rule": "normalisation",
    "DEFAULT_RULES": "normalisation", "VolatileField": "volatile",
    "Engine": "engine", "Result": "engine",
    "RadixStore": "stores", "PagedStore": "stores", "SystemPromptStore": "stores",
    "MlxLmLRUStore": "stores", "make_store": "stores", "StoreEvent": "stores",
    "DiskStore": "stores", "TieredStore": "stores",
    "CacheKey": "keys", "cache_key": "keys", "Request": "request", "Workload": "request",
    "simulate": "simulator", "sweep": "simulator",
    "quantize": "quantization", "dequantize": "quantization", "quantization_sweep": "quantization",
    "quantized_reuse_error": "quantization", "kv_format": "quantized",
    "Inspector": "viz.widgets",
    "serve": "serving.server",
    "load_test": "serving.load",
}
_SUBMODULES = {"workloads", "traces", "viz", "bench", "runner", "grid", "stores", "magics", "keys", "tokens",
               "serving", "cost", "blocks", "policies", "replay", "quantization"}

_ERRORS = {"BlockSizeError", "BoundaryError", "BudgetError", "ImageError", "KvlabError",
           "ModelNotFoundError", "NotTrimmableError", "QuantizationError", "RequestError", "SnapshotError",
           "TemplateError", "TokenIdError", "TraceError"}
__all__ = sorted(set(_LAZY) | _SUBMODULES | _ERRORS | {"load_ipython_extension"})


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")


def load_ipython_extension(ipython):
    """`%load_ext kvlab` registers the %kvlab / %%kvlab magics."""
    from .magics import load_ipython_extension as _load

    _load(ipython)
