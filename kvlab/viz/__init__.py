"""kvlab.viz: plotly figures (data in, Figure out) and the ipywidgets Inspector.

One module per figure family: ``tree`` (prefix_tree), ``memory`` (memory_over_time),
``prompt_diff`` (divergence), ``blocks`` (block_grid), ``curves`` (hit_rate_curves), ``misses``
(miss_reasons: why tokens missed, from kv.simulate or an Engine), ``kept`` (kept_view,
kept_heatmap, kept_tokens_html: where a KV-cache press looks); the Inspector app in
``inspector`` (with its panels in ``panels``, and ``fit``: figures that fill their column, heights
from the data, re-measured when a hidden tab opens or the column resizes). Needs the notebook extras
(``pip install "kvlab[notebooks]"``); ``import kvlab`` alone never imports plotly.

Example:
    >>> kv.viz.prefix_tree(engine.store, m.tokenizer)
    >>> kv.viz.memory_over_time(engine.events, budget_bytes=engine.store.budget_bytes)
    >>> kv.viz.miss_reasons(engine)
    >>> kv.Inspector(engine)
"""

from __future__ import annotations

from ..errors import MissingExtraError, VizError
from .extras import require

require("plotly.graph_objects")

from .blocks import block_grid  # noqa: E402
from .curves import hit_rate_curves, hit_ratio_curves  # noqa: E402
from .kept import kept_heatmap, kept_tokens_html, kept_view  # noqa: E402
from .memory import memory_over_time  # noqa: E402
from .prompt_diff import divergence  # noqa: E402
from .tree import prefix_tree  # noqa: E402

__all__ = ["prefix_tree", "memory_over_time", "divergence", "block_grid", "hit_rate_curves", "hit_ratio_curves",
           "miss_reasons", "Inspector", "VizError", "MissingExtraError", "require", "kept_view", "kept_heatmap",
           "kept_tokens_html"]


def __getattr__(name):
    # ipywidgets is imported only when the widget is asked for; the reasons' vocabulary
    # (kvlab.policies) only when their figure is
    if name == "Inspector":
        from .inspector import Inspector

        return Inspector
    if name == "miss_reasons":
        from .misses import miss_reasons

        return miss_reasons
    raise AttributeError(f"module 'kvlab.viz' has no attribute {name!r}")
