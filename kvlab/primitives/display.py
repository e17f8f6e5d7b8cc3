"""How kvlab objects show themselves in a notebook: a summary line and a table, both escaped, so
every ``_repr_html_`` is one call and they all look alike.

Text is escaped; wrap a piece that is already HTML (a coloured word, a nested table) in ``Html``.

Example:
    >>> summary_html("Trace", "3 requests", "1,024 tokens")
    '<div><b>Trace</b> 3 requests · 1,024 tokens</div>'
    >>> table_html(["name", "tokens"], [["a<b", 16]])
    '<table><tr><th>name</th><th>tokens</th></tr><tr><td>a&lt;b</td><td>16</td></tr></table>'
"""

from __future__ import annotations

import html
from typing import Iterable, Sequence


class Html(str):
    """Text that is already HTML: the helpers put it in as it is instead of escaping it.

    Example:
        >>> summary_html("Split", Html("<span style='color:#2a7'>clean</span>"))
        "<div><b>Split</b> <span style='color:#2a7'>clean</span></div>"
    """


def _cell(value) -> str:
    if isinstance(value, Html):
        return value
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.6g}"
    return html.escape(str(value))


def summary_html(title: str, *facts, note: str = "", body: str = "", code: bool = False) -> Html:
    """One line: ``title`` in bold, then the non-empty ``facts`` joined by `` · ``; ``note`` in
    italics on a line of its own; ``body`` (HTML, e.g. a ``table_html``) below. With ``code`` the
    line is ``title`` and the facts in a ``<code>`` (for objects whose repr says it all).

    Example:
        >>> summary_html("RadixStore", "2 entries", note="policy lru")
        '<div><b>RadixStore</b> 2 entries<br><i>policy lru</i></div>'
        >>> summary_html("LRU(3 units)", code=True)
        '<code>LRU(3 units)</code>'
    """
    shown = [_cell(f) for f in facts if f is not None and f != ""]
    if code:
        return Html(f"<code>{' '.join([_cell(title), *shown])}</code>")
    line = f"<b>{_cell(title)}</b>" + (" " + " · ".join(shown) if shown else "")
    why = f"<br><i>{_cell(note)}</i>" if note else ""
    return Html(f"<div>{line}{why}{body}</div>")


def table_html(columns: Sequence | None, rows: Iterable[Sequence], *, limit: int | None = 50,
               total: int | None = None, caption: str = "", row_headers: bool = False,
               css_class: str = "") -> Html:
    """A table: a header row of ``columns`` (none when ``columns`` is None), then ``rows``, at most
    ``limit`` of them and a last row that says how many more there are (``total``: how many rows
    there are in all, when ``rows`` holds only the first ones, e.g. ``frame.head(50).rows()``).
    ``row_headers`` makes each row's first cell a left-aligned header (a table of name/value
    pairs). Cells are escaped unless ``Html``; floats show 6 significant digits, None a dash.

    Example:
        >>> table_html(None, [("layers", 2)], row_headers=True)
        "<table><tr><th style='text-align:left'>layers</th><td>2</td></tr></table>"
        >>> table_html(["n"], [[1], [2]], limit=1)
        '<table><tr><th>n</th></tr><tr><td>1</td></tr><tr><td colspan=1>… 1 more</td></tr></table>'
    """
    rows = list(rows)
    shown = rows if limit is None else rows[:limit]
    total = len(rows) if total is None else total
    width = len(columns) if columns is not None else max((len(r) for r in rows), default=1)
    out = ["<table" + (f" class='{html.escape(css_class)}'" if css_class else "") + ">"]
    if caption:
        out.append(f"<caption>{_cell(caption)}</caption>")
    if columns is not None:
        out.append("<tr>" + "".join(f"<th>{_cell(c)}</th>" for c in columns) + "</tr>")
    for row in shown:
        cells = [_cell(v) for v in row]
        head = f"<th style='text-align:left'>{cells.pop(0)}</th>" if row_headers and cells else ""
        out.append(f"<tr>{head}" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    if total > len(shown):
        out.append(f"<tr><td colspan={width}>… {total - len(shown):,} more</td></tr>")
    return Html("".join(out) + "</table>")
