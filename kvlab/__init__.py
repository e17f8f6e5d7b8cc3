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
                     ModelNotFoundError, NotTrimmableError, PressError, QuantizationError, RequestError,
                     SnapshotError, TemplateError, TokenIdError, TraceError)

__version__ = "0.1.0"

# name -> module; resolved on first use so `import kvlab` stays cheap and viz stays optional
_LAZY = {
    "load": "loader", "Model": "models.loading", "fingerprint": "models.loading",
    "load_vlm": "vlm", "VLModel": "vlm",
    "tokenise": "primitives.tokens", "Tokens": "primitives.tokens", "Span": "primitives.tokens",
    "split_at_boundary": "primitives.boundary", "Split": "primitives.boundary",
    "prefill": "primitives.snapshots", "snapshot": "primitives.snapshots",
    "restore": "primitives.snapshots", "trim": "primitives.snapshots", "save": "primitives.snapshot_files",
    "load_snapshot": "primitives.snapshot_files", "Snapshot": "primitives.snapshots",
    "make_cache": "primitives.snapshots", "compact": "primitives.snapshots",
    "block_hashes": "primitives.blocks",
    "diverge": "primitives.divergence", "Divergence": "primitives.divergence",
    "volatile_fields": "primitives.volatile", "VolatileField": "primitives.volatile",
    "normalise": "primitives.normalisation", "normalise_text": "primitives.normalisation",
    "Rule": "primitives.normalisation", "DEFAULT_RULES": "primitives.normalisation",
    "dominant_miss": "diagnostics.dominant", "DominantMiss": "diagnostics.dominant",
    "kv_format": "primitives.kv_format",
    "Engine": "engine", "Result": "result", "PrefixCache": "reuse", "hit_rates": "result",
    "RadixStore": "stores", "PagedStore": "stores", "SystemPromptStore": "stores",
    "MlxLmLRUStore": "stores", "make_store": "stores", "StoreEvent": "stores",
    "DiskStore": "stores", "TieredStore": "stores",
    "CacheKey": "keys", "cache_key": "keys", "Request": "request", "Workload": "request",
    "simulate": "sim.simulator", "sweep": "sim.simulator",
    "quantize": "quantization", "dequantize": "quantization", "quantization_sweep": "quantization",
    "quantized_reuse_error": "quantization",
    "Inspector": "viz.widgets",
    "press": "presses", "compress": "presses", "Compressed": "presses",
    "serve": "serving.server", "proxy": "proxying.server",
    "generate_load": "serving.loadgen", "load_test": "serving.loadgen",
}
# kv.<name> -> the submodule it names (kept short for notebooks: kv.traces.read(), kv.cost.fit())
_SUBMODULES = {
    "workloads": "workloads", "viz": "viz", "bench": "bench", "stores": "stores", "magics": "magics",
    "serving": "serving", "policies": "policies", "quantization": "quantization", "keys": "keys",
    "models": "models", "primitives": "primitives", "experiments": "experiments", "sim": "sim",
    "tokens": "primitives.tokens", "blocks": "primitives.blocks",
    "traces": "experiments.traces", "runner": "experiments.runner", "grid": "experiments.grid",
    "cost": "experiments.cost", "replay": "experiments.replay", "simulator": "sim.simulator",
    "snapshots": "primitives.snapshots", "errors": "errors", "checkpoints": "checkpoints",
    "diagnostics": "diagnostics", "proxying": "proxying", "cluster": "cluster", "presses": "presses",
}

_ERRORS = {"BlockSizeError", "BoundaryError", "BudgetError", "ImageError", "KvlabError",
           "ModelNotFoundError", "NotTrimmableError", "PressError", "QuantizationError", "RequestError",
           "SnapshotError",
           "TemplateError", "TokenIdError", "TraceError"}
__all__ = sorted(set(_LAZY) | set(_SUBMODULES) | _ERRORS | {"load_ipython_extension"})


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        module = importlib.import_module(f".{_SUBMODULES[name]}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")


def load_ipython_extension(ipython):
    """`%load_ext kvlab` registers the %kvlab / %%kvlab magics."""
    from .magics import load_ipython_extension as _load

    _load(ipython)
