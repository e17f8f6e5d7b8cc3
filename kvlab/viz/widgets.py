"""``kv.Inspector``'s import path: the app lives in ``kvlab.viz.inspector``; ``FitPlots`` (keeps
plotly figures at their column's width) in ``kvlab.viz.fit``.

Example:
    >>> from kvlab.viz.widgets import Inspector
"""

from .fit import FitPlots
from .inspector import Inspector

__all__ = ["Inspector", "FitPlots"]
