"""Inspector: a live ipywidgets app over an Engine (tree, memory, requests, divergence, blocks, budget).

It listens with ``engine.on_result`` and reads only public objects and frames: ``engine.results``,
``engine.events``, ``engine.stats()``, ``engine.store.tree_frame()``. The budget slider replays the
recorded prompt ids without a model: whole entries under LRU (what RadixStore does) or, for block
stores, ``kv.simulate``'s block LRU.

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
import polars as pl

from . import VizError, require
from .figures import (block_grid, divergence, fmt_bytes, hit_ratio_curves, memory_over_time,
                      prefix_tree)

widgets = require("ipywidgets", "kv.Inspector")
require("anywidget", "plotly's FigureWidget")

AGAINST = ("closest earlier request", "previous request", "entry it reused")
TABS = ("tree", "memory", "requests", "divergence", "blocks", "budget")
BUDGET_TAB = TABS.index("budget")
MiB = 2**20


# ------------------------------------------------------------------------------- replay (no model)

def _lcp(a: tuple, b: tuple) -> int:
    n = min(len(a), len(b))
    for lo in range(0, n, 1024):  # C-level tuple compares, then one scan of the chunk that differs
        hi = min(lo + 1024, n)
        if a[lo:hi] != b[lo:hi]:
            return next(i for i in range(lo, hi) if a[i] != b[i])
    return n


class EntryReplay:
    """RadixStore's policy over recorded requests, without a model: whole entries (one per
    request) cost ``bytes_per_token * len``, a request reuses its longest common prefix with any
    resident entry (at most n - 1 tokens), a new entry drops the entries it extends (subsume), then
    the least recently used entries go until the total fits the budget. An entry larger than the
    budget is not kept (RadixStore raises BudgetError for it)."""

    def __init__(self, prompts, entries=None, *, subsume: bool = True):
        self.prompts = [tuple(p) for p in prompts]
        self.entries = [tuple(e) for e in (entries if entries is not None else self.prompts)]
        self.subsume = subsume
        self._memo: dict = {}

    def _common(self, kind: str, i: int, j: int) -> int:
        key = (kind, i, j)
        if key not in self._memo:
            other = self.prompts[j] if kind == "p" else self.entries[j]
            self._memo[key] = _lcp(self.entries[i], other)
        return self._memo[key]

    def run(self, budget_bytes: float, bytes_per_token: float) -> list[int]:
        """Reused tokens per request under ``budget_bytes``."""
        resident: dict[int, int] = {}  # request index -> last use tick
        total, tick, reused = 0.0, 0, []
        for j, prompt in enumerate(self.prompts):
            limit = len(prompt) - 1
            best, best_i = 0, None
            for i, last in resident.items():
                r = min(self._common("p", i, j), limit)
                if r > best or (best_i is not None and r == best and r > 0 and last > resident[best_i]):
                    best, best_i = r, i
            if best_i is not None and best > 0:
                tick += 1
                resident[best_i] = tick
            reused.append(best)
            entry = self.entries[j]
            # the engine does not re-insert a prompt whose exact entry it just reused
            exact = entry == prompt and best == limit and any(self.entries[i] == prompt for i in resident)
            size = bytes_per_token * len(entry)
            if exact or size > budget_bytes:
                continue
            for i in [i for i in resident if self._common("e", i, j) == len(self.entries[i])
                      and (self.subsume or len(self.entries[i]) == len(entry))]:
                total -= bytes_per_token * len(self.entries[i])
                del resident[i]
            tick += 1
            resident[j] = tick
            total += size
            while total > budget_bytes and len(resident) > 1:
                victim = min((i for i in resident if i != j), key=resident.get)
                total -= bytes_per_token * len(self.entries[victim])
                del resident[victim]
        return reused


def _rates(prompts, reused) -> dict:
    tokens = sum(len(p) for p in prompts)
    return {"token_hit_rate": sum(reused) / tokens if tokens else 0.0,
            "request_hit_rate": sum(r > 0 for r in reused) / len(reused) if reused else 0.0,
            "reused_tokens": list(reused), "prompt_tokens": tokens}


# ------------------------------------------------------------------------------------ FigureWidget

def _sync(fw: go.FigureWidget, fig: go.Figure, width: int | None = None) -> None:
    """Make ``fw`` show ``fig``: restyle traces in place when the structure is unchanged, and
    relayout with only the layout's own keys (assigning ``fw.layout`` would resend the template
    and leave the old annotations/shapes in the browser)."""
    new = fig.layout.to_plotly_json()
    new.pop("template", None)
    if width:
        new["width"] = width
    old = fw.layout.to_plotly_json()
    with fw.batch_update():
        same = len(fw.data) == len(fig.data) and all(a.type == b.type for a, b in zip(fw.data, fig.data))
        if same:
            for a, b in zip(fw.data, fig.data):
                props = b.to_plotly_json()
                props.pop("type", None)
                a.update(props, overwrite=True)
        else:
            fw.data = ()
            fw.add_traces(list(fig.data))
        for key in old.keys() - new.keys() - {"template"}:
            fw.layout[key] = None
        fw.layout.update(new, overwrite=True)


TABLE_COLUMNS = ("#", "match", "reused / prompt", "reuse", "TTFT ms", "prefill ms", "evictions", "why")


def _table_rows(results) -> list[list]:
    return [[r.request_id, r.match, f"{r.reused_tokens} / {r.prompt_tokens}", f"{r.reuse_ratio:.0%}",
             round(r.ttft_s * 1e3, 1), round(r.prefill_s * 1e3, 1), r.evictions, r.why or ""]
            for r in results]


def _table_html(rows: list[list]) -> str:
    """The requests as an HTML table (a plotly Table drawn in a hidden tab loses its text)."""
    cell = "padding:2px 8px;border-bottom:1px solid #e5e5e5;text-align:left"
    head = "".join(f"<th style='{cell};background:#f2f2f2'>{html.escape(c)}</th>" for c in TABLE_COLUMNS)
    body = "".join("<tr>" + "".join(f"<td style='{cell}'>{html.escape(str(v))}</td>" for v in row)
                   + "</tr>" for row in rows)
    return (f"<div style='max-height:360px;overflow:auto'><b>{len(rows)} requests</b>"
            f"<table class='kv-requests' style='border-collapse:collapse;font-size:12px'>"
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")


# --------------------------------------------------------------------------------------- Inspector

class Inspector:
    """Live view of an Engine. Tabs: the store's prefix tree, memory over time, the requests, a
    selected request's divergence from an earlier one, the block grid, and the hit rate the
    recorded requests would get under another budget (the slider above the tabs).

    ``block_size``: replay in blocks of this size with ``kv.simulate`` (default: the store's
    ``block_size`` if it has one, else whole entries like RadixStore). ``budget_mb``: the slider's
    start in MiB (default: the store's budget). ``width``: figure width in pixels (None: plotly's
    default; figures drawn in hidden tabs cannot measure their container).

    Example:
        >>> ins = kv.Inspector(engine)
        >>> engine.run(messages); ins.state()["tree"]["tokens"]
    """

    def __init__(self, engine, *, block_size: int | None = None, budget_mb: float | None = None,
                 tokenizer=None, width: int | None = 900):
        if not hasattr(engine, "on_result") or not hasattr(engine, "results"):
            raise VizError(f"Inspector needs a kv.Engine, got {type(engine).__name__}")
        self.engine = engine
        self.store = engine.store
        model = getattr(engine, "model", None)
        self.tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        self.block_size = block_size or getattr(self.store, "block_size", None)
        self.last_error: str | None = None
        self._replay: EntryReplay | None = None
        self._replay_n = -1
        self._curve_key = None
        store_budget = getattr(self.store, "budget_bytes", None)
        start = budget_mb if budget_mb is not None else (store_budget or 64 * MiB) / MiB
        if not start or start <= 0:
            raise VizError(f"budget_mb must be a positive number of MiB (2**20 bytes), got {budget_mb!r}")

        W = widgets
        self.width = width
        self.figs = {name: go.FigureWidget() for name in ("tree", "memory", "divergence", "blocks",
                                                           "budget")}
        self.table = W.HTML(_table_html([]))
        self._rows: list[list] = []
        self.header = W.HTML()
        self.error = W.HTML()
        self.budget = W.FloatLogSlider(
            value=start, base=10, min=min(-3, math.floor(math.log10(start))),
            max=max(0, math.ceil(math.log10(start)) + 1), step=0.05, description="budget MiB",
            continuous_update=False, readout_format=".3g", layout=W.Layout(width="420px"))
        modes = [("whole entries, LRU (RadixStore)", "entries")]
        modes.append((f"{self.block_size or 16}-token blocks, LRU (kv.simulate)", "blocks"))
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
            W.VBox([self.color, self.figs["tree"]]),
            self.figs["memory"],
            self.table,
            W.VBox([W.HBox([self.request, self.against]), self.reuse, self.figs["divergence"]]),
            self.figs["blocks"],
            self.figs["budget"],
        ])
        for i, title in enumerate(TABS):
            self.tabs.set_title(i, title)
        self.widget = W.VBox([self.header, W.HBox([self.budget, self.mode]), self.sim_label,
                              self.error, self.tabs])
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
        self.header.value = (
            f"<b>kvlab Inspector</b> · {s['requests']} requests · token hit "
            f"<b>{s['token_hit_rate']:.1%}</b> · request hit <b>{s['request_hit_rate']:.1%}</b> · "
            f"{s['entries']} entries · {fmt_bytes(s['bytes'])} · {s['evictions']} evictions")
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
        self._rows = _table_rows(results)
        self.table.value = _table_html(self._rows)
        self._show("blocks", block_grid(results, self.block_size or 16))
        self._draw_divergence()
        self._draw_budget()

    def _show(self, name: str, fig: go.Figure) -> None:
        _sync(self.figs[name], fig, self.width)

    def _draw_tree(self) -> None:
        if self.store is None or not any(hasattr(self.store, m) for m in ("tree_frame", "blocks_frame")):
            fig = go.Figure()
            fig.update_layout(title="this engine has no store with a tree to show", height=200)
        else:
            fig = prefix_tree(self.store, self.tokenizer, self.color.value)
        self._show("tree", fig)

    def _budget_bytes(self) -> int:
        return int(self.budget.value * MiB)

    def _draw_budget(self) -> None:
        budget = self._budget_bytes()
        self._show("memory", memory_over_time(self.engine.events, budget))
        live = self.engine.stats()
        sim = self.resimulate(budget)
        mode = self.mode.label
        store_budget = getattr(self.store, "budget_bytes", None)
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
        bpt = self.bytes_per_token()
        prompts = [r.prompt_ids for r in self.engine.results]
        if sim is None or not prompts:
            self._show("budget", go.Figure(layout=dict(title="budget replay: no data yet",
                                                             height=200)))
            return
        key = (len(prompts), self.mode.value, bpt)
        if key != self._curve_key:
            # from the slider's floor to past everything (and the store's budget): the whole story
            lo = min(10 ** self.budget.min * MiB, min(len(p) for p in prompts) * bpt / 4)
            hi = max(sum(len(p) for p in prompts) * bpt * 1.5, lo * 10,
                     getattr(self.store, "budget_bytes", 0) or 0)
            budgets = [lo * (hi / lo) ** (k / 23) for k in range(24)]
            rows = [{"budget_mib": b / MiB, **{k: v for k, v in self.resimulate(b).items()
                                             if k.endswith("rate")}} for b in budgets]
            self._curve = pl.DataFrame(rows).rename({"token_hit_rate": "token_hit_ratio",
                                                     "request_hit_rate": "request_hit_ratio"})
            self._curve_key = key
        fig = hit_ratio_curves({self.mode.label: self._curve}, "both", x="budget_mib",
                               title="re-simulated hit rate against budget")
        fig.add_trace(go.Scatter(x=[budget / MiB], y=[sim["token_hit_rate"]], mode="markers",
                                 name="slider", marker=dict(size=12, color="#d62728", symbol="circle")))
        store_budget = getattr(self.store, "budget_bytes", None)
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
        other, why = self._against(rid, self.against.value)
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

    def _against(self, rid: int, how: str):
        earlier = [r for r in self.engine.results if r.request_id < rid]
        if not earlier:
            return None, f"request #{rid} is the first: nothing was cached before it"
        if how == "previous request":
            return earlier[-1], "the previous request"
        if how == "entry it reused":
            ev = self.engine.events
            hit = ev.filter((pl.col("request") == rid) & (pl.col("event") == "hit"))
            entry = hit["entry"][0] if hit.height else None
            if entry is None:
                return None, f"request #{rid} reused no entry"
            if hasattr(self.store, "blocks_frame"):
                # a paged hit names its last block's id; its events are keyed by the block's hash
                blocks = self.store.blocks_frame().filter(pl.col("block") == int(entry))
                entry = blocks["hash"][0] if blocks.height else entry
            ins = ev.filter((pl.col("event").is_in(["insert", "block_stored"])) & (pl.col("entry") == entry))
            src = ins["request"][0] if ins.height else None
            match = next((r for r in earlier if r.request_id == src), None)
            if match is None:
                return None, f"the entry that request #{rid} reused is not from a recorded request"
            return match, f"request #{src} stored the entry it reused"
        target = next(r for r in self.engine.results if r.request_id == rid).prompt_ids
        best = max(reversed(earlier), key=lambda r: _lcp(tuple(r.prompt_ids), tuple(target)))
        return best, "the earlier request sharing the longest prefix"

    # -- replay -----------------------------------------------------------------------------------
    def bytes_per_token(self) -> float | None:
        """KV bytes per cached token, from the store's insert events (None before any insert)."""
        ev = self.engine.events.filter(pl.col("event").is_in(["insert", "block_stored"]))
        tokens = ev["tokens"].sum() if ev.height else 0
        return ev["bytes"].sum() / tokens if tokens else None

    def resimulate(self, budget_bytes: float, mode: str | None = None) -> dict | None:
        """Both hit rates the recorded requests would get under ``budget_bytes``, no model run.

        ``mode``: "entries" (RadixStore's whole-entry LRU) or "blocks" (kv.simulate's block LRU);
        default: the app's replay control. None until an entry has been stored."""
        mode = mode or self.mode.value
        bpt = self.bytes_per_token()
        results = self.engine.results
        if bpt is None or not results:
            return None
        prompts = [tuple(r.prompt_ids) for r in results]
        if mode == "blocks":
            bs = self.block_size or 16
            cap = int(budget_bytes // bpt)
            if cap < bs:
                return _rates(prompts, [0] * len(prompts))
            from ..simulator import simulate

            out = simulate(list(prompts), "lru", capacity_tokens=cap, block_size=bs, engine="python")
            return _rates(prompts, out.requests["hit_tokens"].to_list())
        if self._replay is None or self._replay_n != len(results):
            entries = prompts
            if getattr(self.engine, "keying", "prompt") == "prompt+output":
                entries = [tuple(r.prompt_ids) + tuple(r.output_ids[:-1]) for r in results]
            self._replay = EntryReplay(prompts, entries, subsume=getattr(self.store, "subsume", True))
            self._replay_n = len(results)
        return _rates(prompts, self._replay.run(budget_bytes, bpt))

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
            "selected": self.request.value,
            "against": self._div if hasattr(self, "_div") else None,
            "divergence": {"token_index": div.get("token_index"), "common": div.get("common")},
            "budget_mib": self.budget.value,
            "replay": self.mode.value,
            "simulated": sim,
            "error": self.last_error,
        }

    def __repr__(self) -> str:
        s = self.engine.stats()
        return (f"Inspector({s['requests']} requests, token hit {s['token_hit_rate']:.1%}, "
                f"budget {fmt_bytes(self._budget_bytes())})")

    def _repr_html_(self) -> str:
        sim = self.resimulate(self._budget_bytes())
        extra = (f" · replay at {fmt_bytes(self._budget_bytes())}: token hit {sim['token_hit_rate']:.1%}"
                 if sim else "")
        return f"<div>{self.header.value}{extra}</div>"

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
