"""kv.Inspector's sizing on the tiny model: by default no figure has a width (each fills its
column in the browser), autosize is on, the heights follow the data, every figure sits in a
full-width column and the app carries the FitPlots watcher; ``width=`` pins every figure.

Mutants caught: the Inspector's default ``width=900`` restored (every figure pinned to 900 px);
the tabs or a figure's column not 100% wide; FitPlots left out of the app."""

import pytest

import kvlab as kv

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from kvlab.viz.fit import FitPlots, fit_height  # noqa: E402
from kvlab.viz.tree import prefix_tree  # noqa: E402

pytestmark = pytest.mark.model

REQUESTS = [[{"role": "user", "content": "What does tests/test_app.py check?"}],
            [{"role": "user", "content": "What does app.py parse?"}]]


def figure_columns(ins):
    """Each figure's parent box in the app, by figure name."""
    boxes, stack = {}, [ins.widget]
    while stack:
        w = stack.pop()
        for child in getattr(w, "children", ()):
            for name, fw in ins.figs.items():
                if child is fw:
                    boxes[name] = w
            stack.append(child)
    return boxes


def test_inspector_figures_fill_by_default_and_pin_on_request(tiny):
    engine = kv.Engine(tiny, kv.RadixStore(budget_bytes=64 << 20))
    ins = kv.Inspector(engine)
    pinned = kv.Inspector(engine, width=640)
    for r in REQUESTS:
        engine.run(r, max_tokens=2)
    ins.tabs.selected_index = ins.tabs.children.index(figure_columns(ins)["budget"])  # draws the curve
    pinned.tabs.selected_index = ins.tabs.selected_index
    assert ins.width is None and set(ins.figs) == {"tree", "memory", "divergence", "blocks", "budget", "misses"}
    for name, fw in ins.figs.items():
        assert fw.layout.width is None and fw.layout.autosize is True, name
        assert "width" not in fw.to_plotly_json()["layout"], name
        assert fw.get_state()["_config"]["responsive"] is True, name
    for name, fw in pinned.figs.items():
        assert fw.layout.width == 640 and fw.to_plotly_json()["layout"]["width"] == 640, name
    # the tree: root, the shared prefix, two tails -> three levels; its height is the fitted one
    tree = ins.figs["tree"]
    assert len(tree.data[0].ids) == 4
    assert tree.layout.height == fit_height(prefix_tree(engine.store, tiny.tokenizer)) == 300
    blocks = ins.figs["blocks"]
    assert blocks.layout.height == fit_height(blocks) == 220  # two rows: the floor
    columns = figure_columns(ins)
    assert set(columns) == set(ins.figs)
    assert all(box.layout.width == "100%" and len(box.children) == 1 for box in columns.values())
    assert ins.tabs.layout.width == "100%" and ins.widget.layout.width == "100%"
    assert ins.table.layout.width == "100%"
    fits = [w for w in ins.widget.children if isinstance(w, FitPlots)]
    assert len(fits) == 1 and fits[0].scope == "kvlab-inspector" and "kvlab-inspector" in ins.widget._dom_classes
    with pytest.raises(kv.viz.VizError, match="width must be None"):
        kv.Inspector(engine, width=0)
