"""The Inspector's figures fill their column (kvlab.viz.fit, panels.sync), no model: what sync
sets on a FigureWidget's layout, what the browser is sent (the widget's state), and heights from
the data. The on-screen widths are measured in tests/browser/test_jupyterlab.py.

Mutants caught (each applied by hand and seen to fail here): sync pinning width=900 when no
width is given; sync dropping a given width; autosize left unset; an icicle or block grid
keeping its fixed height; the figure's column not 100% wide; plotly's responsive config off; the
requests table not 100% wide."""

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

import plotly.graph_objects as go  # noqa: E402

from kvlab.errors import VizError  # noqa: E402
from kvlab.viz.fit import (LEVEL_PX, MAX_HEIGHT, MIN_HEIGHT, ROW_PX, FitPlots, check_width,  # noqa: E402
                           figure_widget, fit_height, full_width, layout_size)
from kvlab.viz.panels import sync, table_html  # noqa: E402


def icicle(levels: int) -> go.Figure:
    """A chain root -> n1 -> ... with ``levels`` levels, plus a sibling at level 2."""
    ids = [f"n{i}" for i in range(levels)] + ["side"]
    parents = [""] + [f"n{i}" for i in range(levels - 1)] + ["n0"]
    return go.Figure(go.Icicle(ids=ids, parents=parents, values=[1] * len(ids)), layout=dict(height=420))


def grid(rows: int) -> go.Figure:
    return go.Figure(go.Heatmap(z=[[0, 1]] * rows, y=[f"#{i}" for i in range(rows)]), layout=dict(height=250))


def test_sync_leaves_width_to_the_browser_and_honours_a_pinned_width():
    fw = figure_widget()
    bars = go.Figure(go.Bar(y=[1, 2, 3]), layout=dict(height=300, width=900))
    sync(fw, bars)
    assert fw.layout.width is None and fw.layout.autosize is True and fw.layout.height == 300
    sent = fw.to_plotly_json()["layout"]  # the layout plotly.js is given
    assert "width" not in sent and sent["autosize"] is True
    sync(fw, bars, 640)
    assert fw.layout.width == 640 and fw.to_plotly_json()["layout"]["width"] == 640
    sync(fw, bars)  # back to filling: the pinned width is removed, not left behind
    assert fw.layout.width is None and "width" not in fw.to_plotly_json()["layout"]


def test_figure_widget_starts_sized_in_a_full_width_responsive_column():
    fw = figure_widget(icicle(6))
    column = full_width(fw)
    assert column.layout.width == "100%" and list(column.children) == [fw]
    # its first state (sent whole when the widget opens) is already sized: no width, autosize
    first = fw.get_state()["_widget_layout"]
    assert "width" not in first and first["autosize"] is True and first["height"] == 540
    assert [t["type"] for t in fw.get_state()["_widget_data"]] == ["icicle"]
    pinned = figure_widget(icicle(6), 700).get_state()["_widget_layout"]
    assert pinned["width"] == 700
    # plotly.js re-measures a responsive figure on a window resize (FitPlots fires one)
    assert fw.get_state()["_config"]["responsive"] is True
    assert "kvlab-plot" in fw._dom_classes


def test_heights_follow_the_data_within_bounds():
    assert fit_height(icicle(3)) == 60 + 3 * LEVEL_PX == 300
    assert fit_height(icicle(6)) == 60 + 6 * LEVEL_PX == 540
    assert fit_height(icicle(40)) == MAX_HEIGHT
    assert fit_height(icicle(1)) == MIN_HEIGHT  # root and a sibling: two levels, 220 px floor
    assert fit_height(grid(3)) == MIN_HEIGHT
    assert fit_height(grid(20)) == 80 + 20 * ROW_PX == 520
    assert fit_height(grid(200)) == MAX_HEIGHT
    assert fit_height(go.Figure(go.Bar(y=[1]), layout=dict(height=360))) == 360
    assert fit_height(go.Figure()) is None
    assert layout_size(grid(20), None) == {"autosize": True, "height": 520}
    assert layout_size(icicle(3), 1200) == {"width": 1200, "height": 300}
    fw = figure_widget()
    sync(fw, icicle(6))
    assert fw.layout.height == 540


@pytest.mark.parametrize("bad", [0, -5, True, 900.0, "900px"])
def test_a_width_that_is_not_positive_pixels_is_refused(bad):
    with pytest.raises(VizError, match="width must be None"):
        check_width(bad)
    assert check_width(None) is None and check_width(640) == 640


def test_fitplots_watches_its_scope():
    fit = FitPlots("my-app")
    state = fit.get_state()
    assert state["scope"] == "my-app"
    assert "ResizeObserver" in state["_esm"] and "closest" in state["_esm"]
    assert repr(fit) == "FitPlots(scope='my-app')" and ".my-app" in fit._repr_html_()
    with pytest.raises(VizError, match="one CSS class name"):
        FitPlots("two classes")


def test_requests_table_is_full_width():
    page = table_html([[1, "miss", "0 / 10", "0%", 1.0, 1.0, 0, "first_seen"]])
    assert "class='kv-requests' style='border-collapse:collapse;font-size:12px;width:100%'" in page
    assert page.startswith("<div style='max-height:360px;overflow:auto;width:100%'>")
