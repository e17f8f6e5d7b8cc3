"""kvlab.viz: plotly figures (data in, Figure out) and the ipywidgets Inspector.

Needs the notebook extras (``pip install "kvlab[notebooks]"``); ``import kvlab`` alone never imports
plotly.

Example:
    >>> kv.viz.prefix_tree(engine.store, m.tokenizer)
    >>> kv.viz.memory_over_time(engine.events, budget_bytes=engine.store.budget_bytes)
    >>> kv.Inspector(engine)
"""

from __future__ import annotations

import importlib

from ..errors import MissingExtraError, VizError


def require(module: str, what: str = "kvlab.viz"):
    """Import ``module`` or raise a MissingExtraError that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"{what} needs {module.split('.')[0]}, which is not installed: "
            f'pip install "kvlab[notebooks]" (or pip install plotly ipywidgets anywidget)') from e


require("plotly.graph_objects")

from .figures import (block_grid, divergence, hit_ratio_curves, memory_over_time,  # noqa: E402
                      prefix_tree)

__all__ = ["prefix_tree", "memory_over_time", "divergence", "block_grid", "hit_ratio_curves",
           "Inspector", "VizError"]


def __getattr__(name):
    # ipywidgets is imported only when the widget is asked for
    if name == "Inspector":
        from .widgets import Inspector

        return Inspector
    raise AttributeError(f"module 'kvlab.viz' has no attribute {name!r}")
