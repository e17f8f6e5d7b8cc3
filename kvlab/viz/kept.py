"""Where a press looks: each prompt token shaded by the share of (layer, KV head) pairs that kept it,
per press, and a layer x head heatmap of how much of a token range each head kept.

``kept_tokens_html`` and ``kept_heatmap`` take one ``kv.Compressed`` (data in, HTML / Figure out);
``KeptView`` is the widget over several presses (a dropdown of presses, a token-range slider that
drives the heatmap), usable in any notebook.

Example:
    >>> cs = {n: kv.compress(m, msgs, kv.press(n, 0.5)) for n in ("knorm", "snapkv", "streaming_llm")}
    >>> kv.viz.kept_view(cs, m)                        # the widget
    >>> kv.viz.kept_heatmap(cs["snapkv"], 0, 40)       # a plotly Figure
"""

from __future__ import annotations

import html

import plotly.graph_objects as go

from ..errors import VizError
from ..primitives.display import Html, summary_html
from .common import tokenizer_from, visible

GREEN = (44, 160, 44)


def _checked(compressed):
    if not hasattr(compressed, "kept_mask") or not hasattr(compressed, "token_ids"):
        raise VizError(f"expected a kv.Compressed (kv.compress(...)), got {type(compressed).__name__}")
    if not any(k is not None for k in compressed.kept):
        raise VizError("this Compressed has no compressed layer to show")
    return compressed


def _range(compressed, start: int, end: int | None) -> tuple[int, int]:
    end = compressed.tokens if end is None else end
    if not 0 <= start < end <= compressed.tokens:
        raise VizError(f"token range must satisfy 0 <= start < end <= {compressed.tokens}, got {start}..{end}")
    return start, end


def kept_tokens_html(compressed, tokenizer=None, *, limit: int = 4000) -> Html:
    """The compressed prompt's tokens, each shaded by the share of (layer, KV head) pairs that kept
    it (white: none, green: all); hover says the position and the share."""
    c = _checked(compressed)
    share = c.share().tolist()
    tok = tokenizer_from(tokenizer)
    cells = []
    for i, s in enumerate(share[:limit]):
        piece = tok.decode([c.token_ids[i]]) if tok is not None else f"<{c.token_ids[i]}>"
        r, g, b = GREEN
        cells.append(f'<span title="#{i}: kept by {s:.0%} of layers x heads" style="background:rgba({r},{g},{b},'
                     f'{0.08 + 0.85 * s:.2f});font-family:monospace">{html.escape(visible(piece)) or "∅"}</span>')
    more = f" … {len(share) - limit} more" if len(share) > limit else ""
    return Html(f'<div style="white-space:pre-wrap;line-height:1.7">{"".join(cells)}{more}</div>')


def kept_heatmap(compressed, start: int = 0, end: int | None = None) -> go.Figure:
    """[compressed layers x KV heads]: the share of tokens ``start..end`` each head kept."""
    c = _checked(compressed)
    start, end = _range(c, start, end)
    layers = [i for i, k in enumerate(c.kept) if k is not None]
    z = c.kept_mask()[:, :, start:end].mean(axis=-1).tolist()
    fig = go.Figure(go.Heatmap(z=z, x=[f"head {h}" for h in range(len(z[0]))], y=[f"layer {i}" for i in layers],
                               zmin=0, zmax=1, colorscale="Greens", colorbar=dict(title="kept"),
                               hovertemplate="%{y}, %{x}: kept %{z:.0%} of the range<extra></extra>"))
    fig.update_layout(title=f"{c.press.key}: share of tokens {start}..{end - 1} each head kept",
                      height=max(240, 22 * len(layers) + 120), margin=dict(t=40, l=70, r=10, b=40),
                      yaxis=dict(autorange="reversed"))
    return fig


class KeptView:
    """The widget: presses by name, the shaded prompt of the chosen one, and its heatmap over the
    token range the slider selects (module docstring)."""

    def __init__(self, compressed, tokenizer=None):
        import ipywidgets as w

        if not isinstance(compressed, dict):
            many = compressed if isinstance(compressed, (list, tuple)) else [compressed]
            compressed = {_checked(c).press.key: c for c in many}
        items = compressed
        if not items:
            raise VizError("KeptView needs at least one kv.Compressed")
        self.items = {str(k): _checked(v) for k, v in items.items()}
        self.tokenizer = tokenizer
        first = next(iter(self.items.values()))
        self.press = w.Dropdown(options=list(self.items), description="press")
        self.range = w.IntRangeSlider(value=(0, first.tokens), min=0, max=first.tokens, description="tokens",
                                      layout=w.Layout(width="95%"))
        self.strip = w.HTML()
        self.figure = go.FigureWidget(kept_heatmap(first))
        self.widget = w.VBox([w.HBox([self.press, self.range]), self.strip, self.figure])
        self.press.observe(lambda _: self.refresh(), names="value")
        self.range.observe(lambda _: self.refresh(), names="value")
        self.refresh()

    @property
    def current(self):
        return self.items[self.press.value]

    def refresh(self) -> None:
        c = self.current
        self.range.max = c.tokens
        start, end = self.range.value
        end = min(max(end, start + 1), c.tokens)
        self.strip.value = kept_tokens_html(c, self.tokenizer)
        fig = kept_heatmap(c, min(start, end - 1), end)
        with self.figure.batch_update():
            self.figure.data[0].z, self.figure.data[0].y = fig.data[0].z, fig.data[0].y
            self.figure.data[0].x = fig.data[0].x
            self.figure.layout.title, self.figure.layout.height = fig.layout.title, fig.layout.height

    def __repr__(self) -> str:
        return f"KeptView({len(self.items)} presses: {', '.join(self.items)})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), body=kept_tokens_html(self.current, self.tokenizer))

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def kept_view(compressed, tokenizer=None) -> KeptView:
    """``KeptView`` over one Compressed, a list of them or ``{label: Compressed}``."""
    return KeptView(compressed, tokenizer)
