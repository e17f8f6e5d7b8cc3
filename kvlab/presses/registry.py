"""Presses by name: ``kv.press(name, ratio, **options)`` and ``kv.presses.names()``.

Wrappers take their inner press as ``press=`` (a Press or a name, given the wrapper's ratio),
``composed`` takes ``presses=[...]`` and derives its ratio, ``per_layer`` takes ``ratios=[...]``.

Example:
    >>> kv.presses.names()[:3]
    ('random', 'streaming_llm', 'knorm')
    >>> kv.press("adakv", 0.5, press="expected_attention")
    >>> kv.press("nope", 0.5)
    Traceback (most recent call last):
    kvlab.errors.PressError: unknown press 'nope'; kvlab has random, streaming_llm, knorm, ...
"""

from __future__ import annotations

import dataclasses

from ..errors import PressError
from .attention_scorers import ExpectedAttention, ObservedAttention, SnapKV, TOVA
from .base import Press
from .custom import FunctionPress, from_function
from .scorers import KeyDiff, KNorm, LagKV, Random, StreamingLLM
from .wrappers import AdaKV, ChunkKV, Composed, Decoding, PerLayer, Pyramid, Wrapper

SCORERS = {cls.name: cls for cls in (Random, StreamingLLM, KNorm, SnapKV, ExpectedAttention, TOVA,
                                     ObservedAttention, KeyDiff, LagKV)}
WRAPPERS = {cls.name: cls for cls in (Pyramid, ChunkKV, AdaKV, Composed, PerLayer, Decoding)}
_custom: dict[str, FunctionPress] = {}  # registered functions (kvlab.presses.custom)


def names() -> tuple[str, ...]:
    """Every press name ``kv.press`` knows: scorers, then wrappers, then registered functions."""
    return tuple(SCORERS) + tuple(WRAPPERS) + tuple(_custom)


def press(name, ratio: float | None = None, **options) -> Press:
    """The press ``name`` removing ``ratio`` of the cache, with its options (kvpress's names:
    ``window_size``, ``kernel_size``, ``n_sink``, ...).

    Example:
        >>> kv.press("snapkv", 0.5, window_size=32)
    """
    if isinstance(name, Press):
        return name if ratio is None else dataclasses.replace(name, ratio=ratio)
    if name in _custom:
        return dataclasses.replace(_custom[name], ratio=_ratio(name, ratio), **options)
    cls = SCORERS.get(name) or WRAPPERS.get(name)
    if cls is None:
        raise PressError(f"unknown press {name!r}; kvlab has {', '.join(names())} "
                         "(or write one: kv.presses.from_function)")
    fields = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(options) - fields)
    if bad:
        raise PressError(f"{name} has no option {', '.join(bad)}; its options are "
                         f"{', '.join(sorted(fields - {'ratio', 'digest'}))}")
    if cls is Composed:
        if ratio is not None:
            raise PressError("composed derives its ratio from its presses: pass presses=[...] only")
        return cls(presses=tuple(press(p) if isinstance(p, str) else p for p in options.pop("presses", ())))
    if cls is PerLayer:
        if ratio is not None:
            raise PressError("per_layer's ratio is the mean of ratios=[...]: pass ratios only")
        return cls(press=_inner(options.pop("press", "snapkv"), 0.0), **options)
    ratio = _ratio(name, ratio)
    if issubclass(cls, Wrapper):
        options["press"] = _inner(options.get("press", "snapkv"), ratio)
    return cls(ratio, **options)


def parse(spec) -> Press:
    """A press from ``"NAME:RATIO"`` (what ``kvlab serve --press`` and ``kvlab press`` take), or a
    Press as it is.

    Example:
        >>> parse("knorm:0.5").key
        'knorm(ratio=0.5)'
    """
    if isinstance(spec, Press):
        return spec
    name, sep, ratio = str(spec).partition(":")
    try:
        value = float(ratio)
    except ValueError:
        value = None
    if not sep or value is None:
        raise PressError(f"a press is given as NAME:RATIO (e.g. knorm:0.5), got {spec!r}; names: {', '.join(names())}")
    return press(name, value)


def register(name: str, fn, *, window: int = 0) -> None:
    """Make ``kv.press(name, ratio)`` the press of ``fn(keys, values, queries)`` (``kvlab.presses.custom``)."""
    if name in SCORERS or name in WRAPPERS:
        raise PressError(f"{name!r} is one of kvlab's presses; register yours under another name")
    _custom[name] = from_function(fn, name=name, window=window)


def _inner(p, ratio: float) -> Press:
    return press(p, ratio) if isinstance(p, str) else dataclasses.replace(p, ratio=ratio)


def _ratio(name, ratio) -> float:
    if ratio is None:
        raise PressError(f"{name} needs a ratio: kv.press({name!r}, 0.5) removes half the cache")
    return ratio
