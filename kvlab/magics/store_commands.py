"""``%kvlab tree``, ``stats`` and ``inspect``: what the engine's store holds and how it did."""

from __future__ import annotations

from IPython.core.error import UsageError

from .text import tree_lines
from .views import StatsView, TreeView


def register(sub) -> None:
    p = sub.add_parser("tree", help="the store's radix tree")
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
    frame = store.tree_frame() if hasattr(store, "tree_frame") else None
    if frame is None:  # no tree (paged blocks, one system entry, mlx-lm's LRU): its table
        table = next((getattr(store, n)() for n in ("blocks_frame", "entries_frame")
                      if hasattr(store, n)), None)
        return TreeView(store, [], table)
    entries = store.entries_frame() if hasattr(store, "entries_frame") else None
    return TreeView(store, tree_lines(frame, state.model.tokenizer), entries)


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
