"""The notebook extras viz needs (plotly, ipywidgets, anywidget), imported with an install hint.

Example:
    >>> go = require("plotly.graph_objects")
"""

from __future__ import annotations

import importlib

from ..errors import MissingExtraError


def require(module: str, what: str = "kvlab.viz"):
    """Import ``module`` or raise a MissingExtraError that says how to install it.

    Example:
        >>> require("plotly.graph_objects").Figure
        <class 'plotly.graph_objs._figure.Figure'>
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"{what} needs {module.split('.')[0]}, which is not installed: "
            f'pip install "kvlab[notebooks]" (or pip install plotly ipywidgets anywidget)') from e
