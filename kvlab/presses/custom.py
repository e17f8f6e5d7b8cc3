"""A press of your own: one small function of a layer's keys, values and the window's queries.

``fn(keys, values, queries) -> scores``: ``keys``/``values`` [H, S, D] (after RoPE, float32),
``queries`` [Hq, W, D] the last ``window`` queries of the compressed part (None when
``window=0``); ``scores`` [H, S], higher kept. kvlab keeps the top ``max(1, int(S * (1 - ratio)))``
rows of each head, as for its own scorers, and every guarantee holds for it too (the exact oracle,
reuse, save/load). A press that reads queries is query-aware: its compressed context is not reused.

Example (a notebook cell):
    >>> import mlx.core as mx
    >>> def value_norm(keys, values, queries):
    ...     return mx.linalg.norm(values, axis=-1)          # keep the rows with the largest values
    >>> p = kv.presses.from_function(value_norm, 0.5)
    >>> c = kv.compress(m, msgs, p)
    >>> kv.presses.register("vnorm", value_norm)            # now kv.press("vnorm", 0.5) too
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import xxhash

from ..errors import PressError
from .base import Needs, Press, View


def code_digest(fn: Callable) -> str:
    """A digest of ``fn``'s code and constants: the same name with other code is another press."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return xxhash.xxh3_64_hexdigest(repr(fn).encode())
    return xxhash.xxh3_64_hexdigest(code.co_code + repr((code.co_consts, code.co_names)).encode())


@dataclass(frozen=True, repr=False)
class FunctionPress(Press, rule="a scorer written as a function of keys, values and the window's queries"):
    """A scorer press from ``fn(keys, values, queries) -> [H, S]`` (module docstring)."""

    fn: Callable | None = field(default=None, compare=False)
    label: str = "custom"
    window: int = 0
    digest: str = ""

    def __post_init__(self):
        if not callable(self.fn):
            raise PressError(f"a press function must be callable: fn(keys, values, queries) -> scores, got {self.fn!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise PressError(f"window must be an int >= 0 (queries to read), got {self.window!r}")
        object.__setattr__(self, "digest", self.digest or code_digest(self.fn))
        super().__post_init__()

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.label

    @property
    def query_aware(self) -> bool:  # type: ignore[override]
        return self.window > 0

    @property
    def key(self) -> str:
        return f"{self.label}(ratio={self.ratio},window={self.window},fn={self.digest})"

    @property
    def needs(self) -> Needs:
        return Needs(window=self.window)

    def score(self, view: View) -> mx.array:
        queries = view.need("queries", self)[:, -self.window:] if self.window else None
        scores = self.fn(view.keys, view.values, queries)
        if not isinstance(scores, mx.array) or tuple(scores.shape) != (view.heads, view.rows):
            got = tuple(scores.shape) if isinstance(scores, mx.array) else type(scores).__name__
            raise PressError(f"press {self.label!r}: fn must return scores of shape [heads, rows] = "
                             f"{(view.heads, view.rows)} (one per KV head and row), got {got}")
        return scores


def from_function(fn: Callable, ratio: float = 0.0, *, name: str | None = None, window: int = 0) -> FunctionPress:
    """A press from ``fn(keys, values, queries) -> scores`` (module docstring)."""
    return FunctionPress(ratio, fn=fn, label=name or getattr(fn, "__name__", "custom"), window=window)
