"""Plot widgets that fill their column: the Inspector's FigureWidgets take the width of the output
area they are drawn in (tabs hidden when drawn included) and a height that follows their data.

plotly 7's FigureWidget (an anywidget) measures its container once, when it is first drawn (700 px
inside a hidden tab, which measures 0), and never again: its view has no resize handling. Three
things make it fill: ``autosize`` with no layout width (``layout_size``), plotly.js's ``responsive``
config (it re-measures on a window resize) in a full-width column (``figure_widget``,
``full_width``), and
``FitPlots``, a hidden anywidget that watches each figure's width and fires that re-measure when a
tab opens or the notebook's column changes width without the window changing (a sidebar, a split).

Example:
    >>> fw = figure_widget(kv.viz.prefix_tree(engine.store)); column = full_width(fw)
    >>> layout_size(kv.viz.prefix_tree(engine.store), None)["autosize"]
    True
"""

from __future__ import annotations

import html

import plotly.graph_objects as go

from ..errors import VizError
from .extras import require

widgets = require("ipywidgets", "kv.Inspector")
anywidget = require("anywidget", "plotly's FigureWidget")
traitlets = require("traitlets", "kv.Inspector")

FILL = "100%"
# heights in pixels: an icicle level, a block-grid row, and the bounds every fitted height keeps
LEVEL_PX, ROW_PX = 80, 22
MIN_HEIGHT, MAX_HEIGHT = 220, 900
CONFIG = {"responsive": True, "displaylogo": False}


def fit_height(fig: go.Figure) -> int | None:
    """A height for ``fig`` from its data, bounded by MIN_HEIGHT and MAX_HEIGHT: an icicle gets
    LEVEL_PX per level of its tree, a heatmap ROW_PX per row (plus its title and axis margins);
    anything else keeps its own height (None: plotly's default).

    Example:
        >>> fit_height(go.Figure(go.Heatmap(z=[[0]] * 40, y=list(range(40)))))
        900
    """
    trace = fig.data[0] if fig.data else None
    if trace is not None and trace.type == "icicle" and trace.ids:
        parent = dict(zip(trace.ids, trace.parents))
        levels = max(_depth(i, parent) for i in trace.ids)
        return _bounded(60 + LEVEL_PX * levels)
    if trace is not None and trace.type == "heatmap" and trace.z is not None:
        rows = len(set(trace.y)) if trace.y is not None else len(trace.z)
        return _bounded(80 + ROW_PX * rows)
    return fig.layout.height


def _depth(node, parent: dict) -> int:
    depth, seen = 1, {node}
    while parent.get(node) not in (None, "") and parent[node] not in seen:
        node = parent[node]
        seen.add(node)
        depth += 1
    return depth


def _bounded(px: int) -> int:
    return int(min(MAX_HEIGHT, max(MIN_HEIGHT, px)))


def check_width(width) -> int | None:
    """``width`` as the Inspector takes it: None (fill the column) or a positive int of pixels."""
    if width is None:
        return None
    if isinstance(width, bool) or not isinstance(width, int) or width <= 0:
        raise VizError(f"width must be None (fill the output area) or a positive number of pixels, "
                       f"got {width!r}")
    return width


def layout_size(fig: go.Figure, width: int | None) -> dict:
    """The layout keys that size ``fig`` in a widget: the data's height, and autosize (plotly.js
    measures the container) or, when ``width`` pins one, that many pixels.

    Example:
        >>> layout_size(go.Figure(), 640)
        {'width': 640}
    """
    # a pinned width goes without autosize: plotly.js would drop the width on a relayout with it
    size = {"autosize": True} if check_width(width) is None else {"width": width}
    height = fit_height(fig)
    if height is not None:
        size["height"] = height
    return size


def figure_widget(fig: go.Figure | None = None, width: int | None = None) -> go.FigureWidget:
    """A FigureWidget whose first state is ``fig`` sized by ``layout_size``, with plotly.js's
    responsive config. The first state travels with the widget itself; edits made before the
    browser has loaded plotly's widget code can be lost (anywidget drops them), so a figure that
    starts empty and is filled right away may show nothing."""
    fig = go.Figure() if fig is None else fig
    layout = fig.layout.to_plotly_json()
    layout.pop("width", None)
    layout.update(layout_size(fig, width))
    fw = go.FigureWidget(data=fig.data, layout=layout)
    fw._config = dict(CONFIG)  # the widget's plotly.js config: a synced trait with no public setter
    fw.add_class("kvlab-plot")
    return fw


def full_width(*children) -> widgets.VBox:
    """A box as wide as its column, for a FigureWidget (it has no ipywidgets Layout of its own:
    plotly's layout takes that name)."""
    return widgets.VBox(list(children), layout=widgets.Layout(width=FILL))


# Runs in the browser. A figure whose width changed (a hidden tab opened: 0 -> the column's width;
# the window or the column resized) gets plotly.js's own re-measure: its responsive handler,
# which listens to window resize events. Deferred a frame so no layout happens inside the observer.
FIT_ESM = """
function render({ model, el }) {
  const seen = new WeakMap();  // figure -> its last width (-1: not measured yet)
  let root = null, queued = false, scanning = false, stopped = false;
  const refit = () => { queued = false; if (!stopped) window.dispatchEvent(new Event("resize")); };
  const ro = new ResizeObserver((entries) => {
    let changed = false;
    for (const e of entries) {
      const w = Math.round(e.contentRect.width), before = seen.get(e.target);
      // the first measure is the width plotly drew at: only a change after it needs a refit
      if (w > 0 && before !== -1 && before !== w) changed = true;
      seen.set(e.target, w);
    }
    if (changed && !queued) { queued = true; requestAnimationFrame(refit); }
  });
  const scan = () => {
    scanning = false;
    if (stopped || !root) return;
    root.querySelectorAll(".js-plotly-plot").forEach((p) => {
      if (!seen.has(p)) { seen.set(p, -1); ro.observe(p); }
    });
  };
  const mo = new MutationObserver(() => {
    if (!scanning) { scanning = true; requestAnimationFrame(scan); }
  });
  const attach = () => {
    if (stopped) return;
    root = el.closest("." + model.get("scope"));
    if (!root) { requestAnimationFrame(attach); return; }  // not in the page yet
    mo.observe(root, { childList: true, subtree: true });
    scan();
  };
  attach();
  return () => { stopped = true; ro.disconnect(); mo.disconnect(); };
}
export default { render };
"""


class FitPlots(anywidget.AnyWidget):
    """Keeps the plotly figures inside the element with CSS class ``scope`` (an ancestor of this
    widget) at their column's width: it re-measures a figure whenever its width changes. It draws
    nothing; put it in the same box as the figures.

    Example:
        >>> box = widgets.VBox([FitPlots(scope="my-app"), column]); box.add_class("my-app")
    """

    _esm = FIT_ESM
    scope = traitlets.Unicode("kvlab-inspector").tag(sync=True)

    def __init__(self, scope: str = "kvlab-inspector", **kwargs):
        if not scope or any(c.isspace() for c in scope):
            raise VizError(f"scope must be one CSS class name (no spaces), got {scope!r}")
        super().__init__(scope=scope, layout=widgets.Layout(width="0px", height="0px"), **kwargs)

    def __repr__(self) -> str:
        return f"FitPlots(scope={self.scope!r})"

    def _repr_html_(self) -> str:
        return (f"<div><b>FitPlots</b> keeps the figures in <code>.{html.escape(self.scope)}</code> "
                f"at their column's width</div>")
