"""Inspector: a live ipywidgets app over an Engine (tree, memory, requests, divergence, blocks,
budget, misses by reason).

It listens with ``engine.on_result`` and reads only public objects and frames: ``engine.results``,
``engine.events``, ``engine.stats()``, ``engine.store.tree_frame()``. The budget slider replays the
recorded prompt ids without a model through a real store's own code (``kvlab.experiments.replay``): a
RadixStore (whole entries) or a PagedStore (blocks) at the slider's budget.

Example:
    >>> engine = kv.Engine(kv.load("tiny"), kv.RadixStore(budget_bytes=8 << 20))
    >>> ins = kv.Inspector(engine); ins            # displays the app; it updates as requests run
    >>> engine.run([{"role": "user", "content": "Hi"}])
    >>> ins.state()["requests"], ins.resimulate(1 << 20)["token_hit_rate"]
"""

from __future__ import annotations

import html
import math
import warnings

import plotly.graph_objects as go

from ..errors import VizError
from ..primitives.display import Html, summary_html
from ..primitives.units import fmt_bytes
from ..stores.base import Capabilities
from .blocks import block_grid
from .budget import BudgetReplay
from .curves import hit_rate_curves
from .extras import require
from .fit import FILL, FitPlots, check_width, figure_widget, full_width
from .memory import memory_over_time
from .panels import (components_of, components_text, misses_figure, reference_request, run_cause, sync,
                     table_html, table_rows)
from .prompt_diff import divergence
from .tree import prefix_tree

widgets = require("ipywidgets", "kv.Inspector")
require("anywidget", "plotly's FigureWidget")

AGAINST = ("closest earlier request", "previous request", "entry it reused")
TABS = ("tree", "memory", "requests", "divergence", "blocks", "budget", "misses")
FIGURES = ("tree", "memory", "divergence", "blocks", "budget", "misses")
BUDGET_TAB = TABS.index("budget")
MiB = 2**20


class Inspector:
    """Live view of an Engine. Tabs: the store's prefix tree, memory over time, the requests, a
    selected request's divergence from an earlier one, the block grid, the hit rate the
    recorded requests would get under another budget (the slider above the tabs), and why each
    request's missed tokens missed (``kv.viz.miss_reasons``; a server on mlx-lm's own
    LRUPromptCache records no reasons, and the tab says so).

    ``block_size``: replay through a PagedStore with blocks of this size (default: the store's
    ``block_size`` if it has one, else through a RadixStore: whole entries). ``budget_mb``: the slider's
    start in MiB (default: the store's budget). ``width``: None (default) makes every tab's figure
    fill the output area's width, also after a resize and in tabs opened later; an int pins it to
    that many pixels. Heights follow the data (``kvlab.viz.fit.fit_height``).

    Example:
        >>> ins = kv.Inspector(engine)
        >>> engine.run(messages); ins.state()["tree"]["tokens"]
    """

    def __init__(self, engine, *, block_size: int | None = None, budget_mb: float | None = None,
                 tokenizer=None, width: int | None = None):
        if not hasattr(engine, "on_result") or not hasattr(engine, "results"):
            raise VizError(f"Inspector needs a kv.Engine, got {type(engine).__name__}")
        self.engine = engine
        self.store = engine.store
        self._caps = engine.store.capabilities if engine.store is not None else Capabilities()
        model = getattr(engine, "model", None)
        self.tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        self.block_size = block_size or self._caps.block_size
        self.last_error: str | None = None
        self.replays = BudgetReplay(engine, self.block_size)
        store_budget = self._caps.budget_bytes
        start = budget_mb if budget_mb is not None else (store_budget or 64 * MiB) / MiB
        if not start or start <= 0:
            raise VizError(f"budget_mb must be a positive number of MiB (2**20 bytes), got {budget_mb!r}")

        W = widgets
        self.width = check_width(width)
        # each FigureWidget is made with its first figure (see _show); the boxes hold their place
        self.figs: dict[str, go.FigureWidget] = {}
        self._cols = col = {name: full_width() for name in FIGURES}
        self.table = W.HTML(table_html([]), layout=W.Layout(width=FILL))
        self._rows: list[list] = []
        self.header = W.HTML()
        self.error = W.HTML()
        self.budget = W.FloatLogSlider(
            value=start, base=10, min=min(-3, math.floor(math.log10(start))),
            max=max(0, math.ceil(math.log10(start)) + 1), step=0.05, description="budget MiB",
            continuous_update=False, readout=False, layout=W.Layout(width="360px"))
        self.budget_text = W.Label()  # the slider's readout in bytes ("6.0 GiB", not "6.03e+3")
        modes = [("whole entries, LRU (RadixStore)", "entries"),
                 (f"{self.block_size or 16}-token blocks, LRU (PagedStore)", "blocks")]
        self.mode = W.Dropdown(options=modes, value="blocks" if self.block_size else "entries",
                               description="replay", layout=W.Layout(width="340px"))
        self.sim_label = W.HTML()
        self.color = W.ToggleButtons(options=["hits", "recency"], value="hits",
                                     description="colour", style={"button_width": "80px"})
        self.request = W.Dropdown(options=[], description="request", layout=W.Layout(width="300px"))
        self.against = W.Dropdown(options=list(AGAINST), value=AGAINST[0], description="against",
                                  layout=W.Layout(width="300px"))
        self.reuse = W.HTML()
        self.tabs = W.Tab(children=[
            W.VBox([self.color, col["tree"]]),
            col["memory"],
            self.table,
            W.VBox([W.HBox([self.request, self.against]), self.reuse, col["divergence"]]),
            col["blocks"],
            col["budget"],
            col["misses"],
        ], layout=W.Layout(width=FILL))
        for i, title in enumerate(TABS):
            self.tabs.set_title(i, title)
        self.widget = W.VBox([self.header, W.HBox([self.budget, self.budget_text, self.mode]), self.sim_label,
                              self.error, self.tabs, FitPlots("kvlab-inspector")], layout=W.Layout(width=FILL))
        self.widget.add_class("kvlab-inspector")

        self._quiet = False
        self.color.observe(lambda _: self._guard(self._draw_tree), names="value")
        self.request.observe(lambda _: self._quiet or self._guard(self._draw_divergence), names="value")
        self.against.observe(lambda _: self._guard(self._draw_divergence), names="value")
        self.budget.observe(lambda _: self._guard(self._draw_budget), names="value")
        self.mode.observe(lambda _: self._guard(self._draw_budget), names="value")
        self.tabs.observe(lambda _: self._guard(self._draw_curve), names="selected_index")
        engine.on_result(self._on_result)
        self.refresh()
        for name in FIGURES:  # the budget curve is drawn when its tab opens
            if name not in self.figs:
                self._show(name, go.Figure(layout=dict(title="opens with its tab", height=200)))

    # -- updating ---------------------------------------------------------------------------------
    def _on_result(self, engine, result) -> None:
        self._guard(self.refresh)

    def _guard(self, fn) -> None:
        # a drawing bug must not abort the engine's request: show it in the app instead
        try:
            fn()
            self.last_error = None
            self.error.value = ""
        except Exception as e:  # noqa: BLE001
            self.last_error = f"{type(e).__name__}: {e}"
            self.error.value = (f"<span style='color:#b00'>Inspector could not draw: "
                                f"{html.escape(self.last_error)}</span>")
            warnings.warn(f"kv.Inspector could not draw: {self.last_error}", stacklevel=2)

    def refresh(self) -> None:
        """Redraw everything from the engine's current results, events and store."""
        results = self.engine.results
        s = self.engine.stats()
        self.header.value = self._header(s, *components_text(components_of(self.store, self._caps)))
        options = [(f"#{r.request_id} {r.match} {r.reused_tokens}/{r.prompt_tokens}", r.request_id)
                   for r in results]
        follow = self.request.value is None or (len(self.request.options) > 0
                                                and self.request.value == self.request.options[-1][1])
        keep = self.request.value
        self._quiet = True  # setting options fires the observer; draw once, below
        try:
            self.request.options = options
            if options:
                self.request.value = options[-1][1] if follow or keep is None else keep
        finally:
            self._quiet = False
        self._draw_tree()
        self._rows = table_rows(results)
        self.table.value = table_html(self._rows, run_cause(results, self.tokenizer))
        self._show("blocks", block_grid(results, self.block_size or 16))
        self._show("misses", misses_figure(results))
        self._draw_divergence()
        self._draw_budget()

    def _show(self, name: str, fig: go.Figure) -> None:
        if name in self.figs:
            sync(self.figs[name], fig, self.width)
        else:
            self.figs[name] = figure_widget(fig, self.width)
            self._cols[name].children = (self.figs[name],)

    def _draw_tree(self) -> None:
        if self.store is None or not {"tree", "blocks"} & set(self._caps.views):
            fig = go.Figure()
            fig.update_layout(title="this engine has no store with a tree to show", height=200)
        else:
            fig = prefix_tree(self.store, self.tokenizer, self.color.value)
        self._show("tree", fig)

    def _budget_bytes(self) -> int:
        return int(self.budget.value * MiB)

    def _draw_budget(self) -> None:
        budget = self._budget_bytes()
        self.budget_text.value = fmt_bytes(budget)
        self._show("memory", memory_over_time(self.engine.events, budget))
        live = self.engine.stats()
        sim = self.resimulate(budget)
        mode = self.mode.label
        store_budget = self._caps.budget_bytes
        live_at = f" (store budget {fmt_bytes(store_budget)})" if store_budget else ""
        if sim is None:
            self.sim_label.value = ("<i>budget replay: no entry has been stored yet, "
                                    "so the bytes per token are unknown</i>")
        else:
            self.sim_label.value = (
                f"replayed {len(self.engine.results)} requests at <b>{fmt_bytes(budget)}</b> "
                f"({html.escape(mode)}): token hit <b class='kv-sim'>{sim['token_hit_rate']:.1%}</b>, "
                f"request hit {sim['request_hit_rate']:.1%} · live{live_at}: token hit "
                f"<b>{live['token_hit_rate']:.1%}</b>, request hit {live['request_hit_rate']:.1%}")
        self._draw_curve()

    def _draw_curve(self) -> None:
        # 24 replays per redraw: only while the budget tab is open (it redraws when opened)
        if self.tabs.selected_index != BUDGET_TAB:
            return
        budget = self._budget_bytes()
        sim = self.resimulate(budget)
        curve = self.replays.curve(self.mode.value, 10 ** self.budget.min * MiB,
                                   self._caps.budget_bytes or 0)
        if sim is None or curve is None:
            self._show("budget", go.Figure(layout=dict(title="budget replay: no data yet", height=200)))
            return
        fig = hit_rate_curves({self.mode.label: curve}, "both", x="budget_mib",
                               title="re-simulated hit rate against budget")
        fig.add_trace(go.Scatter(x=[budget / MiB], y=[sim["token_hit_rate"]], mode="markers",
                                 name="slider", marker=dict(size=12, color="#d62728", symbol="circle")))
        store_budget = self._caps.budget_bytes
        if store_budget:
            fig.add_trace(go.Scatter(x=[store_budget / MiB], y=[self.engine.stats()["token_hit_rate"]],
                                     mode="markers", name="live",
                                     marker=dict(size=12, color="#222", symbol="star")))
        fig.update_layout(xaxis_type="log")
        self._show("budget", fig)

    def _draw_divergence(self) -> None:
        results = {r.request_id: r for r in self.engine.results}
        rid = self.request.value
        if rid is None or rid not in results:
            self.reuse.value = "<i>no requests yet</i>"
            self._show("divergence", go.Figure(layout=dict(title="no request selected", height=200)))
            self._div = None
            return
        r = results[rid]
        other, why = reference_request(self.engine, self._caps, rid, self.against.value)
        self._div = other.request_id if other is not None else None
        if other is None:
            self.reuse.value = r._repr_html_() + f"<div><i>{html.escape(why)}</i></div>"
            fig = divergence(r, (), self.tokenizer)
            fig.update_layout(title=why)
        else:
            fig = divergence(other, r, self.tokenizer)
            meta = fig.layout.meta
            where = (f"first difference at token {meta['token_index']}" if meta["token_index"] is not None
                     else "no difference within the shorter prompt")
            self.reuse.value = (r._repr_html_() + f"<div>against <b>#{other.request_id}</b> ({why}): "
                                f"{meta['common']} tokens shared, {where}; row a = #{other.request_id}, "
                                f"row b = #{rid}</div>")
        self._show("divergence", fig)

    # -- replay -----------------------------------------------------------------------------------
    def bytes_per_token(self) -> float | None:
        """KV bytes per cached token, from the store's insert events (None before any insert)."""
        return self.replays.bytes_per_token()

    def resimulate(self, budget_bytes: float, mode: str | None = None) -> dict | None:
        """Both hit rates the recorded requests would get under ``budget_bytes``, no model run:
        their prompt ids replayed through a fresh store's own code (``kvlab.experiments.replay``).

        ``mode``: "entries" (a RadixStore, subsuming as this engine's store does) or "blocks" (a
        PagedStore of ``block_size``); default: the app's replay control. None until an entry
        has been stored."""
        return self.replays.rates(budget_bytes, mode or self.mode.value)

    # -- looking ----------------------------------------------------------------------------------
    def state(self) -> dict:
        """What the figures and controls show now, as plain values (for tests and logs)."""
        figs = self.figs
        tree = figs["tree"].data[0] if figs["tree"].data and figs["tree"].data[0].type == "icicle" else None
        mem = next((t for t in figs["memory"].data if t.name == "total"), None)
        sim = self.resimulate(self._budget_bytes())
        div = figs["divergence"].layout.meta or {}
        return {
            "requests": len(self.engine.results),
            "live": {k: v for k, v in self.engine.stats().items()},
            "tree": {"nodes": len(tree.ids) if tree is not None else 0,
                     "tokens": int(sum(tree.values)) if tree is not None else 0,
                     "color": self.color.value},
            "memory": {"points": len(mem.y) if mem is not None else 0,
                       "bytes": int(mem.y[-1]) if mem is not None and len(mem.y) else 0,
                       "budget_bytes": self._budget_bytes()},
            "table_rows": len(self._rows),
            "blocks": (figs["blocks"].layout.meta or {}).get("counts"),
            "misses": {t.name: [int(v) for v in t.y] for t in figs["misses"].data},
            "selected": self.request.value,
            "against": self._div if hasattr(self, "_div") else None,
            "divergence": {"token_index": div.get("token_index"), "common": div.get("common")},
            "budget_mib": self.budget.value,
            "replay": self.mode.value,
            "simulated": sim,
            "error": self.last_error,
            "components": components_of(self.store, self._caps),
        }

    def __repr__(self) -> str:
        s = self.engine.stats()
        return (f"Inspector({s['requests']} requests, token hit {s['token_hit_rate']:.1%}, "
                f"budget {fmt_bytes(self._budget_bytes())})")

    @staticmethod
    def _header(s: dict, *more) -> str:
        return summary_html("kvlab Inspector", f"{s['requests']} requests",
                            Html(f"token hit <b>{s['token_hit_rate']:.1%}</b>"),
                            Html(f"request hit <b>{s['request_hit_rate']:.1%}</b>"),
                            f"{s['entries']} entries", fmt_bytes(s["bytes"]), f"{s['evictions']} evictions",
                            *more)

    def _repr_html_(self) -> str:
        budget = self._budget_bytes()
        sim = self.resimulate(budget)
        replay = f"replay at {fmt_bytes(budget)}: token hit {sim['token_hit_rate']:.1%}" if sim else None
        parts = components_text(components_of(self.store, self._caps))
        return self._header(self.engine.stats(), replay, *parts)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
