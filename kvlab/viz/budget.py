"""What an engine's recorded requests would reuse under another byte budget, with no model run:
their prompt ids replayed through a fresh store's own code (``kvlab.experiments.replay``). The Inspector's
budget slider and curve read this.

Example:
    >>> b = BudgetReplay(engine)
    >>> b.rates(1 << 20, "entries")["token_hit_rate"], b.curve("entries", 1 << 10).height
"""

from __future__ import annotations

import polars as pl

from ..experiments.replay import replay
from ..stores import RadixStore
from ..primitives.display import summary_html

MODES = ("entries", "blocks")
CURVE_POINTS = 24


class BudgetReplay:
    """Replays of ``engine.results``, remembered until another request arrives. ``entries``: a
    RadixStore (subsuming as the engine's own store does); ``blocks``: a PagedStore of
    ``block_size``. Budgets are real bytes, scaled by the bytes per token the store recorded."""

    def __init__(self, engine, block_size: int | None = None):
        self.engine = engine
        self.block_size = block_size or 16
        self._memo: dict = {}
        self._curves: dict = {}

    def bytes_per_token(self) -> float | None:
        """KV bytes per cached token, from the store's insert events (None before any insert)."""
        ev = self.engine.events.filter(pl.col("event").is_in(["insert", "block_stored"]))
        tokens = ev["tokens"].sum() if ev.height else 0
        return ev["bytes"].sum() / tokens if tokens else None

    def entries(self) -> list | None:
        """What each request inserted when the engine keys prompt + output: the ids up to the
        length its insert event records (else the prompt and every output id)."""
        if self.engine.keying != "prompt+output":
            return None
        ev = self.engine.events.filter((pl.col("event") == "insert")
                                       & (pl.col("detail") == "prompt+output"))
        length = dict(zip(ev["request"].to_list(), ev["tokens"].to_list()))
        return [(r.prompt_ids + r.output_ids)[: length.get(r.request_id, len(r.prompt_ids) + len(r.output_ids))]
                for r in self.engine.results]

    def rates(self, budget_bytes: float, mode: str) -> dict | None:
        """Both hit rates and the reuse per request at ``budget_bytes`` (None before any insert)."""
        bpt = self.bytes_per_token()
        results = self.engine.results
        if bpt is None or not results:
            return None
        key = (len(results), mode, int(budget_bytes), bpt)
        if key not in self._memo:
            if any(k[0] != len(results) for k in self._memo):
                self._memo.clear()
            if mode == "blocks":
                store = "paged"
            else:
                own = self.engine.store
                subsume = own.subsume if isinstance(own, RadixStore) else True
                store = lambda b: RadixStore(b, subsume=subsume)  # noqa: E731
            out = replay([r.prompt_ids for r in results], store, budget_bytes=int(budget_bytes),
                         bytes_per_token=bpt, block_size=self.block_size, entries=self.entries())
            self._memo[key] = out.rates()
        return self._memo[key]

    def curve(self, mode: str, floor_bytes: float, ceiling_bytes: float = 0) -> pl.DataFrame | None:
        """Both hit rates at CURVE_POINTS log-spaced budgets, from below the smallest prompt (or
        ``floor_bytes``) to past everything (or ``ceiling_bytes``): the whole story in one line."""
        bpt = self.bytes_per_token()
        prompts = [r.prompt_ids for r in self.engine.results]
        if bpt is None or not prompts:
            return None
        key = (len(prompts), mode, bpt, floor_bytes, ceiling_bytes)
        if key not in self._curves:
            lo = min(floor_bytes, min(len(p) for p in prompts) * bpt / 4)
            hi = max(sum(len(p) for p in prompts) * bpt * 1.5, lo * 10, ceiling_bytes)
            last = CURVE_POINTS - 1
            budgets = [lo * (hi / lo) ** (k / last) for k in range(CURVE_POINTS)]
            rows = [{"budget_mib": b / 2**20, **{k: v for k, v in self.rates(b, mode).items()
                                                 if k.endswith("rate")}} for b in budgets]
            self._curves = {key: pl.DataFrame(rows)}
        return self._curves[key]

    def __repr__(self) -> str:
        return f"BudgetReplay({len(self.engine.results)} requests, blocks of {self.block_size})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)
