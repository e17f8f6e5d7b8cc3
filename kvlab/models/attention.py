"""The one place kvlab reaches into the attention of mlx-lm's and mlx-vlm's models.

Their model modules call ``scaled_dot_product_attention(queries, keys, values, cache=, scale=,
mask=, sinks=)`` imported by name from ``mlx_lm.models.base`` (or ``mlx_vlm.models.base``).
``install()`` rebinds that name, in every model module loaded so far, to a dispatcher that

0. lets a cache with an ``attention_mask(mask, queries)`` method (kvlab's compressed caches,
   ``kvlab.primitives.kept_cache``) hide rows first: a head that keeps fewer rows than its layer
   holds masks the others, in every thread, whoever runs the model;
1. runs the wrappers entered with ``wrapping(...)`` in the calling thread, outermost first: each is
   ``wrapper(call, queries, keys, values, cache, scale, mask, sinks)`` and continues the chain with
   ``call(queries, keys, values, cache, scale, mask, sinks)`` (a press reads the window's queries
   here; an oracle adds a mask);
2. then the library's own function for quantized caches (it dequantizes or runs quantized matmuls),
   else the kernel chosen with ``set_kernel`` (``mx.fast.scaled_dot_product_attention``'s signature);
   until ``set_kernel`` is called, the one ``kvlab.device`` chose (``Device.attention``): kvlab's
   CPU kernel (``kvlab.models.cpu_attention``) on Linux CPU, MLX's own elsewhere.

kvlab's loaders call ``install()`` after each model is built, so a model's modules are always
covered. Wrappers live in a ``ContextVar``: entering one in a notebook does not reach the server's
generation thread, and the reverse.

Example:
    >>> seen = []
    >>> def spy(call, q, k, v, cache, scale, mask, sinks):
    ...     seen.append(q.shape)
    ...     return call(q, k, v, cache, scale, mask, sinks)
    >>> with wrapping(spy):
    ...     logits = model.net(ids[None])             # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import contextvars
import sys

from .. import device
from ..errors import KvlabError
from . import cpu_attention

NAME = "scaled_dot_product_attention"
MODULE_PREFIXES = ("mlx_lm.models.", "mlx_vlm.models.")
MLX_KERNEL = device.MLX_ATTENTION
KERNELS = {device.KVLAB_ATTENTION: cpu_attention.attention, MLX_KERNEL: None}

_wrappers: contextvars.ContextVar[tuple] = contextvars.ContextVar("kvlab_attention_wrappers", default=())
# fn None: mx.fast.scaled_dot_product_attention; name None: not chosen yet (the device's choice)
_kernel = {"name": None, "fn": None}
_dispatchers: dict[int, object] = {}  # id(library function) -> its dispatcher


def _quantized(cache) -> bool:
    return cache is not None and (hasattr(cache, "bits") or hasattr(cache, "dequantize"))


def _dispatcher(original):
    """The function that stands in for ``original`` (a library's scaled_dot_product_attention)."""

    def innermost(queries, keys, values, cache, scale, mask, sinks):
        fn = _active()["fn"]
        if fn is None or _quantized(cache):
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        return fn(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask=None, sinks=None):
        hide = getattr(cache, "attention_mask", None)
        if hide is not None:  # a compressed cache hides the rows a head does not use
            mask = hide(mask, queries)
        call = innermost
        for wrapper in reversed(_wrappers.get()):
            call = _link(wrapper, call)
        return call(queries, keys, values, cache, scale, mask, sinks)

    scaled_dot_product_attention.kvlab_original = original
    scaled_dot_product_attention.__doc__ = original.__doc__
    return scaled_dot_product_attention


def _link(wrapper, call):
    return lambda q, k, v, cache, scale, mask, sinks: wrapper(call, q, k, v, cache, scale, mask, sinks)


def install() -> int:
    """Rebind the attention name in every loaded mlx-lm / mlx-vlm model module (idempotent).
    Returns how many modules were rebound by this call."""
    rebound = 0
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(MODULE_PREFIXES):
            continue
        fn = getattr(module, NAME, None)
        if fn is None or not callable(fn) or hasattr(fn, "kvlab_original"):
            continue
        if getattr(fn, "__module__", "") not in ("mlx_lm.models.base", "mlx_vlm.models.base"):
            continue  # a model's own attention of another name's making: left alone
        if id(fn) not in _dispatchers:
            _dispatchers[id(fn)] = _dispatcher(fn)
        setattr(module, NAME, _dispatchers[id(fn)])
        rebound += 1
    return rebound


def uninstall() -> int:
    """Give every model module its library's own function back (how a test compares with the
    library untouched); ``install()`` reverses it. Returns how many modules were restored."""
    restored = 0
    for name, module in list(sys.modules.items()):
        fn = getattr(module, NAME, None) if module is not None and name.startswith(MODULE_PREFIXES) else None
        if hasattr(fn, "kvlab_original"):
            setattr(module, NAME, fn.kvlab_original)
            restored += 1
    return restored


@contextlib.contextmanager
def wrapping(*wrappers):
    """Run attention through ``wrappers`` (outermost first) inside this block, in this thread."""
    for w in wrappers:
        if not callable(w):
            raise KvlabError(f"an attention wrapper must be callable, got {type(w).__name__}")
    token = _wrappers.set(_wrappers.get() + tuple(wrappers))
    try:
        yield
    finally:
        _wrappers.reset(token)


def set_kernel(fn, name: str) -> None:
    """Use ``fn`` (``mx.fast.scaled_dot_product_attention``'s signature) for unquantized caches
    in every thread; ``fn=None`` goes back to MLX's own. ``name`` is what ``kernel_name()`` says."""
    if fn is not None and not callable(fn):
        raise KvlabError(f"an attention kernel must be callable, got {type(fn).__name__}")
    _kernel.update(fn=fn, name=MLX_KERNEL if fn is None else str(name))


def use(name: str) -> None:
    """Use the kernel of this name (``kvlab-cpu`` or ``mlx``) in every thread; ``use(None)`` goes
    back to the device's choice (``kvlab.device.current().attention``)."""
    if name is None:
        _kernel.update(fn=None, name=None)
        return
    if name not in KERNELS:
        raise KvlabError(f"unknown attention kernel {name!r}; choose one of {', '.join(KERNELS)}")
    set_kernel(KERNELS[name], name)


@contextlib.contextmanager
def using(name: str):
    """Run attention with the kernel ``name`` inside this block (every thread), then restore the
    one before: how a test or benchmark compares kernels side by side.

    Example:
        >>> with using("mlx"):
        ...     kernel_name()
        'mlx'
    """
    before = dict(_kernel)
    use(name)
    try:
        yield
    finally:
        _kernel.update(before)


def _active() -> dict:
    if _kernel["name"] is None:
        name = device.current().attention
        _kernel.update(fn=KERNELS[name], name=name)
    return _kernel


def softmax(x):
    """Softmax over the last axis (float32 accumulation) with the exp of the kernel in use: kvlab's
    CPU kernel's where it is chosen, MLX's elsewhere. For attention weights computed outside a
    model's attention (a press's scores), so they cost what the model's attention costs."""
    if _active()["fn"] is cpu_attention.attention:
        return cpu_attention.softmax(x)
    return cpu_attention.mlx_softmax(x)


def kernel_name() -> str:
    """The attention kernel in use: ``mlx`` (MLX's fused one), ``kvlab-cpu`` or the name given to
    ``set_kernel``."""
    return _active()["name"]


mlx_attention = cpu_attention.mlx_attention  # MLX's own fused attention: the reference for every kernel
