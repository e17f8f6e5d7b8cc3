"""``%kvlab tree``, ``stats`` and ``inspect``: what the engine's store holds and how it did."""

from __future__ import annotations

from IPython.core.error import UsageError

from .text import tree_lines
from .views import StatsView, TreeView


def register(sub) -> None:
    p = sub.add_parser("tree", help="the store's prefix tree (radix nodes, or a paged store's block runs)")
    p.set_defaults(handler=tree)
    p = sub.add_parser("stats", help="hit rates (per token and per request) and events")
    p.set_defaults(handler=stats)
    p = sub.add_parser("inspect", help="kv.Inspector on the engine")
    p.set_defaults(handler=inspect)


def tree(state, args, cell, local_ns):
    engine = state.need_engine()
    store = engine.store
    if store is None:
        raise UsageError("the engine has no store (--store none): there is no tree to show")
    views = store.capabilities.views
    entries = store.frame("entries") if "entries" in views else None
    if "tree" not in views:  # no tree (paged blocks, one system entry, mlx-lm's LRU): its table
        return TreeView(store, [], store.frame("blocks") if "blocks" in views else entries)
    return TreeView(store, tree_lines(store.frame("tree"), state.model.tokenizer), entries)


def stats(state, args, cell, local_ns):
    engine = state.need_engine()
    return StatsView(engine.stats(), engine.events, engine)


def inspect(state, args, cell, local_ns):
    engine = state.need_engine()
    try:
        from ..viz.widgets import Inspector
    except ImportError as e:
        raise UsageError(f"kv.Inspector is not available here ({e}); "
                         "install kvlab[notebooks] for the widgets") from None
    return Inspector(engine)
