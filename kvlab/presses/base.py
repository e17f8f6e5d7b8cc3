"""What every press is: a frozen dataclass with a ratio, a rule, and a ``select`` of rows per KV head.

kvpress's semantics, so results compare: ``ratio`` is the fraction of rows removed, and a scorer
press keeps the top ``n_kept = max(1, int(S * (1 - ratio)))`` rows of each KV head by its score
(S rows in, usually the T prompt tokens). What a press may look at for one layer is a ``View``:
the layer's keys and values after RoPE (as the cache holds them), each row's original position,
and, if the press asks for them (``Needs``), the last queries of the compressed part (the
observation window), the attention every prompt query paid to every key (H2O), or the statistics
of the pre-RoPE queries (expected attention).

``select(view)`` returns row indices [heads, n] in ascending order; -1 pads a head that keeps
fewer rows than another (head-wise budgets). ``query_aware`` says whether the kept set depends on
the last queries of the compressed part: where the question sits then changes what is kept, and
kvlab does not reuse such a compressed context across requests.

Example:
    >>> p = kv.press("knorm", 0.5)
    >>> p
    knorm(ratio=0.5): keeps the rows with the lowest key norms · query-agnostic
    >>> p.key
    'knorm(ratio=0.5)'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx

from ..errors import PressError
from ..primitives.display import summary_html


@dataclass(frozen=True)
class Needs:
    """What a press reads besides keys and values: the last ``window`` queries (after RoPE), the
    observed attention sums (``attention``), pre-RoPE query statistics (``stats``, skipping the
    first ``stats_skip`` positions, with the rotation averaged over ``future`` next positions)."""

    window: int = 0
    attention: bool = False
    stats: bool = False
    stats_skip: int = 0
    future: int = 0

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)

    def __or__(self, other: "Needs") -> "Needs":
        return Needs(max(self.window, other.window), self.attention or other.attention,
                     self.stats or other.stats, max(self.stats_skip, other.stats_skip),
                     max(self.future, other.future))

    @property
    def queries(self) -> bool:
        return bool(self.window or self.attention or self.stats)


@dataclass(frozen=True)
class QueryStats:
    """Pre-RoPE query statistics of one layer: ``mean`` [Hq, D], ``cov`` [Hq, D, D] (over the
    prompt's queries past the first few) and ``rotation`` [D, D], RoPE averaged over the next
    ``future`` positions (kvpress's expected attention)."""

    mean: mx.array
    cov: mx.array
    rotation: mx.array

    def __repr__(self) -> str:
        return f"QueryStats({self.mean.shape[0]} query heads, dim {self.mean.shape[1]})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


@dataclass(frozen=True, eq=False)
class View:
    """One layer as a press sees it. ``keys``/``values`` [H, S, D] float32 (after RoPE),
    ``positions`` [H, S] the original position of each row, ``length`` the tokens the layer has
    seen (T), ``queries`` [Hq, W, D] the last W queries after RoPE (positions T-W .. T-1),
    ``attention`` [Hq, S] the attention summed over every prompt query and divided by how many
    queries saw the key (H2O), ``stats`` the pre-RoPE query statistics, ``scale`` the layer's
    attention scale."""

    layer: int
    n_layers: int
    keys: mx.array
    values: mx.array
    positions: mx.array
    length: int
    scale: float
    queries: mx.array | None = None
    attention: mx.array | None = None
    stats: QueryStats | None = None

    def __repr__(self) -> str:
        has = [w for w in ("queries", "attention", "stats") if getattr(self, w) is not None]
        return (f"View(layer {self.layer} of {self.n_layers}: {self.heads} KV heads x {self.rows} rows of "
                f"{self.length} tokens" + (f", {', '.join(has)}" if has else "") + ")")

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)

    @property
    def heads(self) -> int:
        return int(self.keys.shape[0])

    @property
    def rows(self) -> int:
        return int(self.keys.shape[1])

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        q = self.queries if self.queries is not None else self.attention
        return 1 if q is None else int(q.shape[0]) // self.heads

    def take(self, rows: mx.array) -> "View":
        """This view holding only ``rows`` [H, n] of each head (what a press kept: the next press
        of a composition sees these)."""
        att = self.attention
        if att is not None:
            att = mx.take_along_axis(att, mx.repeat(rows, att.shape[0] // self.heads, axis=0), axis=1)
        return dataclasses.replace(
            self, keys=mx.take_along_axis(self.keys, rows[..., None], axis=1),
            values=mx.take_along_axis(self.values, rows[..., None], axis=1),
            positions=mx.take_along_axis(self.positions, rows, axis=1), attention=att)

    def need(self, what: str, press: "Press"):
        value = getattr(self, what)
        if value is None:
            raise PressError(f"{press.name} needs the window's {what} on layer {self.layer}, and kvlab did "
                             "not capture them (the layer's attention did not run through kvlab's "
                             "attention dispatcher); use a query-agnostic press (knorm, streaming_llm, "
                             "keydiff, lagkv, random)")
        return value


def n_kept(rows: int, ratio: float) -> int:
    """kvpress's ScorerPress budget: ``max(1, int(rows * (1 - ratio)))``.

    Example:
        >>> n_kept(600, 0.5), n_kept(7, 0.9)
        (300, 1)
    """
    return max(1, int(rows * (1 - ratio)))


def top_rows(scores: mx.array, n: int) -> mx.array:
    """[H, n] the rows of the ``n`` highest scores of each head, ascending (ties: MLX's sort order)."""
    n = min(int(n), scores.shape[-1])
    return mx.sort(mx.argsort(-scores.astype(mx.float32), axis=-1)[:, :n], axis=-1)


def ascending(positions: mx.array) -> mx.array:
    """[H, n'] each head's kept positions ascending, -1 (unused rows) moved to the end and the
    columns no head uses dropped: what ``Compressed.kept`` reports whatever the row layout."""
    big = positions.shape[1] + int(mx.max(positions).item()) + 1
    order = mx.sort(mx.where(positions >= 0, positions, big), axis=-1)
    width = int(mx.max(mx.sum(positions >= 0, axis=-1)).item())
    return mx.where(order[:, :width] < big, order[:, :width], -1).astype(mx.int32)


def check_ratio(ratio, name: str) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
        raise PressError(f"{name}: ratio is the fraction of the cache removed and must be in [0, 1) "
                         f"(0 keeps everything, 0.75 keeps a quarter), got {ratio!r}")
    return float(ratio)


def settings(obj) -> str:
    """``field=value`` of every field, nested presses by their keys: the press's identity."""
    parts = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, Press):
            v = v.key
        elif isinstance(v, tuple) and v and isinstance(v[0], Press):
            v = "[" + ",".join(p.key for p in v) + "]"
        parts.append(f"{f.name}={v}")
    return ",".join(parts)


@dataclass(frozen=True)
class Press:
    """A press: ``ratio`` (fraction removed) and how it picks rows (module docstring)."""

    ratio: float = 0.0

    name: ClassVar[str] = "press"
    rule: ClassVar[str] = ""
    query_aware: ClassVar[bool] = False

    def __init_subclass__(cls, *, name: str | None = None, rule: str | None = None,
                          query_aware: bool | None = None, **kw):
        """A press of the catalogue states what it is in its header:
        ``class KNorm(Press, name="knorm", rule="keeps the rows with the lowest key norms")``."""
        super().__init_subclass__(**kw)
        for attr, value in (("name", name), ("rule", rule), ("query_aware", query_aware)):
            if value is not None:
                setattr(cls, attr, value)

    def __post_init__(self):
        check_ratio(self.ratio, self.name)

    @property
    def needs(self) -> Needs:
        return Needs()

    @property
    def key(self) -> str:
        """Everything that decides what this press keeps, as text (a cache key's press part)."""
        return f"{self.name}({settings(self)})"

    @property
    def masks_in_place(self) -> bool:
        """Whether the compressed cache keeps every row where it was and masks the pruned ones
        (adakv, as kvpress's) instead of holding the kept rows only."""
        return False

    @property
    def reusable(self) -> bool:
        """Whether a compressed context can serve another request: not when it depends on the
        last queries (where the question sits)."""
        return not self.query_aware

    def budget(self, view: View) -> int:
        return n_kept(view.rows, self.ratio)

    def score(self, view: View) -> mx.array:
        """[H, S] higher is kept (scorer presses)."""
        raise PressError(f"{self.name} is not a scorer press: it selects rows itself")

    def select(self, view: View) -> mx.array:
        """[H, n] rows to keep, ascending; a scorer keeps its top ``budget`` per head."""
        if self.ratio == 0:
            return mx.broadcast_to(mx.arange(view.rows, dtype=mx.int32), (view.heads, view.rows))
        return top_rows(self.score(view), self.budget(view))

    def __repr__(self) -> str:
        aware = "query-aware" if self.query_aware else "query-agnostic"
        return f"{self.key}: {self.rule} · {aware}"

    def _repr_html_(self) -> str:
        return summary_html(self.name, f"ratio {self.ratio:g}", self.rule,
                            "query-aware" if self.query_aware else "query-agnostic", note=self.key)
