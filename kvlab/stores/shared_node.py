"""A SharedRadixStore node (an edge of symbols, the full-attention KV of exactly those tokens, and
the checkpoints taken at positions inside the edge), the frames and HTML that show a tree of them,
and what a checkpoint holds.

A checkpoint at position p (``kvlab.stores.paged_parts.Checkpoint``; no block: it sits on the node
whose edge holds token p - 1) keeps every recurrent state as taken at p and, per sliding-window
layer (and chunked-attention layer, held as a window of its chunk size), the last min(window,
held) tokens before p, in temporal order: a hit restores full KV
sliced from the path plus the deepest checkpoint at or below the match, so never a state taken
past where the prompt diverges. Window tokens are stored once along a path: a checkpoint whose
window reaches back past an earlier checkpoint on its path (its ``base``) keeps only the tokens
after it and takes the rest from there. A base sits on the same node or an ancestor, so leaf-first
eviction never drops it before the checkpoints that use it.

Example:
    >>> frame_of(store.root).columns[:4]
    ['id', 'parent', 'start', 'depth']
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

import mlx.core as mx

from ..primitives.cache_parts import WINDOWED, Part, arrays_of, copy_of, nbytes_of, window_kv, window_size, windowed_state
from ..primitives.display import summary_html, table_html
from ..primitives.snapshots import LayerState, Snapshot
from . import node_hits
from .paged_parts import COMPONENTS, Checkpoint


@dataclass(eq=False)
class Node:
    """One node: ``edge`` (symbols of tokens [depth - len(edge), depth)), ``kv`` (a snapshot of
    the full-attention KV of exactly those tokens; None at the root), ``checkpoints`` (position in
    (start, depth] -> Checkpoint), ``ends`` (positions in (start, depth] where an insert
    ended and no later insert extended it: what match kinds call an entry), ``lock`` (inserts in
    flight whose path runs through it: it cannot be evicted)."""

    id: int
    edge: tuple
    parent: "Node | None"
    depth: int
    kv: Snapshot | None
    kind: str
    children: dict = field(default_factory=dict)
    checkpoints: dict = field(default_factory=dict)
    ends: set = field(default_factory=set)
    lock: int = 0
    served: dict = field(default_factory=dict)  # lookups that reused its tokens (kvlab.stores.node_hits)
    last_used: int = 0

    @property
    def hits(self) -> int:
        """Lookups that reused at least one of its tokens."""
        return node_hits.hits(self.served)

    @property
    def kv_nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.nbytes

    @property
    def nbytes(self) -> int:
        """Its KV and its checkpoints."""
        return self.kv_nbytes + sum(cp.nbytes for cp in self.checkpoints.values())

    @property
    def buffers(self) -> int:
        """Device buffers it keeps alive (Metal limits their number): its KV's and its checkpoints'."""
        kv = 0 if self.kv is None else len(arrays_of([layer.state[:2] for layer in self.kv.layers]))
        return kv + sum(len(arrays_of(list(cp.states.values()))) for cp in self.checkpoints.values())

    @property
    def start(self) -> int:
        return self.depth - len(self.edge)

    @property
    def tokens(self) -> int:
        return len(self.edge)

    def walk(self):
        yield self
        for child in self.children.values():
            yield from child.walk()

    def __repr__(self) -> str:
        return f"Node({self.id}, tokens [{self.start}, {self.depth}), {self.nbytes} B, {len(self.children)} children)"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def full_only(snap: Snapshot, parts: tuple[Part, ...]) -> Snapshot:
    """``snap``'s full-attention parts as a snapshot of KVCache-like layers (what nodes slice)."""
    layers = tuple(LayerState(p.cls, p.state, snap.offset, nbytes_of(tuple(p.state[:2])))
                   for p in parts if p.kind == "full")
    return Snapshot(layers, snap.offset, snap.token_ids, snap.fingerprint)


def checkpoint_of(cid: int, parts: tuple[Part, ...], offset: int, base: Checkpoint | None = None) -> Checkpoint:
    """Copies of what a hit at ``offset`` needs besides full KV; ``base``: the deepest earlier
    checkpoint on the same path, whose window tokens it need not copy (module docstring). A
    window part's state is (own keys, own values, position of the first own token, position of
    the first token the window holds, base or None, offset, window size)."""
    states = {}
    for i, p in enumerate(parts):
        if p.kind == "recurrent":
            states[i] = copy_of(p.state)
        elif p.kind in WINDOWED:
            k, v, _ = window_kv(p.state)
            lo = offset - min(k.shape[2], window_size(p))
            shared = base is not None and lo < base.position and base.states[i][3] <= lo
            first = base.position if shared else lo
            own = copy_of((k[..., k.shape[2] - (offset - first):, :], v[..., v.shape[2] - (offset - first):, :]))
            states[i] = (*own, first, lo, base if shared else None, offset, window_size(p))
    return Checkpoint(cid, b"", offset, states, nbytes_of(list(states.values())), ())


def window_state(cp: Checkpoint, i: int, part: Part) -> tuple:
    """The RotatingKVCache (or ChunkedKVCache) state of window part ``i`` (``part``) at ``cp``: its
    own tokens, preceded by the ones its bases hold back to the first token the window holds."""
    keys, values, first, lo, base, offset, size = cp.states[i]
    ks, vs = [keys], [values]
    while first > lo:  # base holds tokens up to its position, which is ``first``
        bk, bv, bfirst, _, nxt, _, _ = base.states[i]
        s = max(lo, bfirst)
        ks.insert(0, bk[..., s - bfirst:, :])
        vs.insert(0, bv[..., s - bfirst:, :])
        first, base = s, nxt
    return windowed_state(part, mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2), offset)


def components_of(nodes, parts: tuple[Part, ...] | None) -> dict:
    """PagedStore.components' figures for a tree's ``nodes``: bytes of full KV, window KV and
    recurrent state, the checkpoint count, and per layer the window KV tokens held."""
    out = dict.fromkeys(COMPONENTS, 0)
    out["full"] = sum(n.kv_nbytes for n in nodes)
    tokens: dict[int, int] = {}
    count = 0
    for n in nodes:
        for cp in n.checkpoints.values():
            count += 1
            for i, state in cp.states.items():
                windowed = parts[i].kind in WINDOWED  # chunked KV counts as window KV
                out["window" if windowed else parts[i].kind] += nbytes_of(state)
                if windowed:
                    tokens[parts[i].layer] = tokens.get(parts[i].layer, 0) + state[0].shape[2]
    return {**out, "checkpoints": count, "window_tokens": tokens}


def edge_ids(edge: tuple) -> list[int]:
    """Token ids of an edge's symbols (a symbol is an id, or (id, namespace tag))."""
    return [s if isinstance(s, int) else s[0] for s in edge]


def frame_of(root: Node) -> pl.DataFrame:
    """One row per node, with RadixStore.tree_frame's columns (``entry`` is the node's own id:
    every node but the root holds KV)."""
    rows = []
    for n in root.walk():
        own = n is not root
        rows.append({"id": n.id, "parent": None if n.parent is None else n.parent.id,
                     "start": n.start, "depth": n.depth, "tokens": n.tokens, "edge_ids": edge_ids(n.edge),
                     "entry": n.id if own else None, "entry_kind": n.kind if own else None,
                     "hits": n.hits, "last_used": n.last_used, "bytes": n.nbytes,
                     "checkpoints": sorted(n.checkpoints)})
    return pl.DataFrame(rows, schema_overrides={"parent": pl.Int64, "entry": pl.Int64,
                                                "edge_ids": pl.List(pl.Int64),
                                                "checkpoints": pl.List(pl.Int64)})


def html_of(store, note: str = "") -> str:
    """A store's _repr_html_: its summary line and its first 50 nodes."""
    frame = frame_of(store.root).drop("edge_ids")
    c = store.components()
    return summary_html("SharedRadixStore", f"{store.entries} nodes",
                        f"{store.nbytes / 2**20:.2f} MiB of {store.budget_bytes / 2**20:.0f} MiB",
                        f"full KV {c['full']} B, window KV {c['window']} B, recurrent {c['recurrent']} B "
                        f"in {c['checkpoints']} checkpoints",
                        f"{store.evictions} evictions", f"policy {store.policy.name}", note=note,
                        body=table_html(frame.columns, frame.head(50).rows(), total=frame.height))
