"""What the magics return: each output has a one-line repr, a multi-line text/plain (papermill,
consoles) and a text/html (Jupyter)."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from ..primitives.display import Html, summary_html, table_html


class _View:
    """Base of the magic outputs: one-line repr, multi-line text for papermill, HTML for Jupyter."""

    def text(self) -> str:
        raise NotImplementedError

    def short(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.short()

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(self.text())


@dataclass(eq=False, repr=False)
class Loaded(_View):
    """What ``%kvlab load`` made: ``.model`` and ``.engine``."""

    model: Any
    engine: Any

    def short(self) -> str:
        return f"Loaded({self.model!r})"

    def text(self) -> str:
        return f"kvlab: loaded {self.model!r}\nkvlab: engine {self.engine!r}"

    def _repr_html_(self) -> str:
        return summary_html("kvlab", "loaded", _code(self.engine), body=self.model._repr_html_())


def _code(obj) -> Html:
    """``repr(obj)`` as code, for a summary line."""
    return Html(f"<code>{html.escape(repr(obj))}</code>")


def _table_text(frame, rows: int = 40) -> str:
    import polars as pl

    with pl.Config(tbl_rows=rows, tbl_cols=16, fmt_str_lengths=64, tbl_hide_dataframe_shape=True,
                   tbl_width_chars=200,
                   tbl_formatting="ASCII_MARKDOWN", tbl_hide_column_data_types=True):
        return str(frame)


def _stats_line(stats: dict) -> str:
    return (f"{stats['requests']} requests · token hit rate {stats['token_hit_rate']:.1%} "
            f"({stats['reused_tokens']}/{stats['prompt_tokens']} tokens) · request hit rate "
            f"{stats['request_hit_rate']:.1%} · {stats['entries']} entries, {stats['bytes'] / 2**20:.2f} MiB")


def reasons_text(reasons: dict | None) -> str:
    """Missed tokens by reason, the non-zero ones: ``"first_seen 40, partial_block 1"``."""
    return ", ".join(f"{k} {v}" for k, v in (reasons or {}).items() if v) or "none"


def _reasons_line(stats: dict) -> str:
    return f"missed tokens by reason: {reasons_text(stats.get('miss_reasons'))}"


@dataclass(eq=False, repr=False)
class RunView(_View):
    """``%kvlab run``: one row per request (``.frame``), the engine's stats afterwards and
    ``.dominant_miss`` (``kvlab.diagnostics.DominantMiss``: where most missed tokens diverged, the
    volatile field there and the rule that fixes it; None when no place holds most of them)."""

    workload: str
    frame: Any
    stats: dict
    engine: Any
    dominant_miss: Any = None

    def _why(self) -> list[str]:
        return [] if self.dominant_miss is None else [f"why: {self.dominant_miss.sentence()}"]

    def short(self) -> str:
        return f"RunView({self.workload}: {self.frame.height} requests)"

    def text(self) -> str:
        return (f"kvlab run {self.workload} on {self.engine!r}\n{_table_text(self.frame)}\n"
                + "\n".join([_stats_line(self.stats), _reasons_line(self.stats), *self._why()]))

    def _repr_html_(self) -> str:
        rows = [(r["name"], f"{r['reused_tokens']}/{r['prompt_tokens']}", Html(
            f"<div style='width:200px;height:8px;background:#eee'><div style='width:"
            f"{int(200 * r['reuse_ratio'])}px;height:8px;background:#2a7'></div></div>"),
            r["match"], f"{r['ttft_ms']:.1f} ms", r.get("missed", ""))
            for r in self.frame.iter_rows(named=True)]
        table = table_html(("request", "reused", "", "match", "TTFT", "missed (why)"), rows)
        lines = "".join(f"<div>{html.escape(line)}</div>"
                        for line in (_stats_line(self.stats), _reasons_line(self.stats)))
        why = "" if self.dominant_miss is None else self.dominant_miss._repr_html_()
        return summary_html("kvlab run", self.workload, _code(self.engine), body=table + lines + why)


@dataclass(eq=False, repr=False)
class StatsView(_View):
    """``%kvlab stats``: both hit-rate definitions, named, and the event counts."""

    stats: dict
    events: Any
    engine: Any

    def short(self) -> str:
        return f"StatsView({self.stats['requests']} requests)"

    def _counts(self):
        import polars as pl

        if self.events.height == 0:
            return pl.DataFrame({"event": [], "count": [], "tokens": []})
        return (self.events.group_by("event").agg(pl.len().alias("count"), pl.col("tokens").sum())
                .sort("event"))

    def _plain(self) -> dict:
        return {k: v for k, v in self.stats.items() if k != "miss_reasons"}

    def _reasons(self) -> list[tuple[str, int]]:
        return [(k, v) for k, v in (self.stats.get("miss_reasons") or {}).items() if v]

    def text(self) -> str:
        lines = [f"kvlab stats: {self.engine!r}"]
        lines += [f"{k:>18}: {v:.4f}" if isinstance(v, float) else f"{k:>18}: {v}"
                  for k, v in self._plain().items()]
        lines.append("missed tokens by reason:" + ("" if self._reasons() else " none"))
        lines += [f"{k:>18}: {v}" for k, v in self._reasons()]
        lines.append("events:")
        lines.append(_table_text(self._counts()))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        plain = table_html(None, [(k, f"{v:.4f}" if isinstance(v, float) else v)
                                  for k, v in self._plain().items()], row_headers=True)
        why = table_html(None, self._reasons() or [("none",)], row_headers=True, css_class="kv-miss-reasons")
        counts = self._counts()
        return summary_html("kvlab stats", _code(self.engine),
                            body=f"{plain}<b>missed tokens by reason</b>{why}<b>events</b>"
                                 f"{table_html(counts.columns, counts.rows())}")


@dataclass(eq=False, repr=False)
class TreeView(_View):
    """``%kvlab tree``: the store's prefix tree (or its entries when it has no tree)."""

    store: Any
    lines: list
    frame: Any

    def short(self) -> str:
        return f"TreeView({self.store!r})"

    ROWS = 20

    def _note(self) -> str:
        if self.frame is None:
            return "" if self.lines else f"({type(self.store).__name__} keeps no tree: {self.store.entries} entries)"
        more = self.frame.height - self.ROWS
        return f"… {more} more rows" if more > 0 else ""

    def text(self) -> str:
        if self.lines:
            body = "\n".join(self.lines)
        elif self.frame is not None:
            body = _table_text(self.frame.head(self.ROWS))
        else:
            body = ""
        return "\n".join(x for x in (repr(self.store), body, self._note()) if x)

    def _repr_html_(self) -> str:
        tree = (f"<pre style='line-height:1.3'>{html.escape(chr(10).join(self.lines))}</pre>"
                if self.lines else "")
        table = (table_html(self.frame.columns, self.frame.head(self.ROWS).rows(), total=self.frame.height)
                 if self.frame is not None and self.frame.height else "")
        return summary_html(repr(self.store), note=self._note() if self.frame is None else "",
                            body=tree + table)


@dataclass(eq=False, repr=False)
class ChatView(_View):
    """``%%kvlab chat``: one Result per user turn, with what each reused."""

    messages: list
    results: list

    def short(self) -> str:
        return f"ChatView({len(self.messages)} messages, {len(self.results)} requests)"

    @property
    def frame(self):
        import polars as pl

        return pl.DataFrame([{"turn": i + 1, "prompt_tokens": r.prompt_tokens, "reused_tokens": r.reused_tokens,
                              "match": r.match, "ttft_ms": round(r.ttft_s * 1e3, 2),
                              "reply": r.text[:60]} for i, r in enumerate(self.results)])

    def text(self) -> str:
        last = self.results[-1]
        return (f"kvlab chat: {len(self.messages)} messages, {len(self.results)} requests\n"
                f"{_table_text(self.frame)}\nreply: {last.text!r}")

    def _repr_html_(self) -> str:
        return summary_html("kvlab chat", f"{len(self.messages)} messages", f"{len(self.results)} requests",
                            body="".join(r._repr_html_() for r in self.results))

