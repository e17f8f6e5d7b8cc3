"""``kv.Inspector``'s import path: the app lives in ``kvlab.viz.inspector``.

Example:
    >>> from kvlab.viz.widgets import Inspector
"""

from .inspector import Inspector

__all__ = ["Inspector"]
