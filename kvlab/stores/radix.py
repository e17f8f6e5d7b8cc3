"""RadixStore: a token-level radix tree of snapshots evicted under a byte budget (SGLang-like).

Eviction drops whole entries, chosen by ``policy`` (any online name in
``kvlab.policies.POLICIES``, default ``"lru"``): an entry is one evictable unit of its snapshot's
bytes, depth 0 (a snapshot holds its whole prefix) and priority by insert kind
(``kvlab.policies.KIND_PRIORITY``); lookups and refreshed inserts are its hits.

Match kinds: ``exact`` (an entry for exactly these tokens), ``prefix`` (an entry for a prefix of
them), ``lcp`` (a longer entry that shares a prefix, trimmed to it) and ``supersequence`` (an entry
that extends the request, trimmed). The last two need a trimmable cache; for hybrid/SSM models the
Engine inserts checkpoints at message boundaries so ``prefix`` hits still work.

The tree is keyed by ``CacheKey.symbols()``: extra keys (image hashes) and the salt become part of
each token's symbol from the position where they start, so requests with identical ids but
different images part ways at the first placeholder.

Example:
    >>> store = kv.RadixStore(budget_bytes=256 << 20)
    >>> engine = kv.Engine(m, store)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import polars as pl

from ..keys import CacheKey
from ..policies import KIND_PRIORITY, Unit, store_policy
from ..primitives.display import summary_html, table_html
from ..primitives.snapshots import Snapshot, compact, cut_refusal
from ..primitives.tokens import Tokens, common_prefix_len
from . import node_hits
from .base import MISS, NON_CAPACITY_REASONS, Capabilities, Match, fell_back, too_big
from .budgeted import BudgetedStore


@dataclass(eq=False)
class Entry:
    id: int
    snapshot: Snapshot
    tokens: int
    kind: str
    created: int
    last_used: int
    hits: int = 0

    @property
    def nbytes(self) -> int:
        return self.snapshot.nbytes


@dataclass(eq=False)
class Node:
    edge: tuple
    parent: "Node | None"
    depth: int
    children: dict = field(default_factory=dict)
    entry: Entry | None = None
    id: int = 0
    served: dict = field(default_factory=dict)  # lookups that reused its tokens (kvlab.stores.node_hits)

    def walk(self):
        yield self
        for child in self.children.values():
            yield from child.walk()


class RadixStore(BudgetedStore):
    """Token-level radix tree (see module docstring). ``budget_bytes`` defaults to 25% of the
    device's memory (``kvlab.device``); ``policy`` (a name or a ``kvlab.policies.Policy``) and ``policy_params`` choose eviction."""

    name = "radix"

    def __init__(self, budget_bytes: int | None = None, *, subsume: bool = True, policy="lru",
                 policy_params: dict | None = None, on_evict=None):
        super().__init__(budget_bytes, on_evict)  # on_evict(entry_id: str, snapshot)
        self.policy = store_policy(policy, self.budget_bytes, policy_params, store=self.name)
        self.subsume = subsume
        self.root = Node((), None, 0, id=0)
        self._entries: dict[int, tuple[Entry, Node]] = {}

    # -- protocol ---------------------------------------------------------------------------------
    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(budget_bytes=self.budget_bytes, views=("tree", "entries"), eviction_policy=self.policy.name)


    def lookup(self, key: CacheKey, tokens: Tokens, *, limit: int) -> Match:
        sym = key.symbols()
        node, depth, partial = self.root, 0, None
        best: Match = MISS
        path = [self.root]
        while True:
            if node.entry is not None and 0 < depth <= limit:
                best = Match("prefix", depth, node.entry.snapshot, depth, node.entry.id)
            if depth == len(sym):
                break
            child = node.children.get(sym[depth])
            if child is None:
                break
            m = common_prefix_len(child.edge, sym[depth:])
            if m < len(child.edge):
                depth += m
                partial = child
                break
            node, depth = child, depth + len(child.edge)
            path.append(node)
        shared = depth
        below = self._entries_below(partial if partial is not None else node, include_self=partial is not None)
        if partial is None and node.entry is not None and depth == len(sym) and depth > limit:
            below.insert(0, node.entry)  # exact entry: usable only trimmed by one token
        if below and shared > best.tokens:
            reuse = min(shared, limit)
            # a chunked cache can drop its last token but not always go back to the shared prefix
            cuttable = [e for e in below if cut_refusal(e.snapshot, reuse) is None]
            if cuttable:
                e = max(cuttable, key=lambda e: e.last_used)
                if reuse > best.tokens:
                    kind = ("exact" if e.tokens == len(sym) == shared else
                            "supersequence" if shared == len(sym) else "lcp")
                    best = Match(kind, reuse, e.snapshot, e.tokens, e.id)
            else:
                # fall back to the deepest entry that can be restored exactly, as mlx-lm's
                # fetch_nearest_cache falls back to its longest shorter entry, and say from what
                best = self._cuttable_above(path, limit, best.tokens) or best
                served = self._entries[best.entry_id][0] if best.tokens else None
                why = fell_back(below[0].tokens, shared, reuse, cut_refusal(below[0].snapshot, reuse),
                                served and (best.tokens, served.tokens),
                                "checkpoint" if served and served.kind == "checkpoint" else "entry")
                best = replace(best, why=why)
        if best.entry_id is not None:
            self._touch(best.entry_id, sym, best.tokens)
        return best

    def insert(self, key: CacheKey, tokens: Tokens, snap: Snapshot, *, kind: str = "prompt") -> None:
        if snap.nbytes > self.budget_bytes:
            raise too_big(self.name, snap.nbytes, self.budget_bytes)
        sym = key.symbols()[: snap.offset]
        if not sym:
            return
        node = self._node_for(sym)
        old = node.entry
        if (old is not None and old.snapshot.fingerprint == snap.fingerprint
                and old.snapshot.kinds == snap.kinds):
            # same tokens, same model: the KV is the same, so keep the entry and refresh it
            old.last_used = next(self._clock)
            self.policy.access(self._unit(old))
            return
        # keep exact-size copies: the snapshot's views would hold mlx-lm's whole buffer, not nbytes
        snap = compact(snap)
        if snap.nbytes > self.budget_bytes:  # a rotating window's ring can hold more than its tokens
            self._prune(node)
            raise too_big(self.name, snap.nbytes, self.budget_bytes)
        if old is not None:
            self._drop(old, node, "replaced")
            node = self._node_for(sym)  # dropping may have pruned or merged the node
        entry = Entry(next(self._ids), snap, len(sym), kind, next(self._clock), 0)
        entry.last_used = entry.created
        node.entry = entry
        self._entries[entry.id] = (entry, node)
        self._bytes += entry.nbytes
        self.policy.access(self._unit(entry))
        self.log.add("insert", tokens=entry.tokens, nbytes=entry.nbytes, entry=entry.id, kind=kind)
        if self.subsume and snap.cuts_anywhere:
            # An entry that can be cut back anywhere serves every prefix of itself, so ancestors
            # only cost memory (a chunked cache past its first chunk cannot: they stay).
            anc = node.parent
            while anc is not None:
                if anc.entry is not None and anc.entry.snapshot.trimmable:
                    self._drop(anc.entry, anc, "subsumed")
                anc = anc.parent
        self._evict(protect=entry.id)

    # -- internals --------------------------------------------------------------------------------
    def _cuttable_above(self, path: list, limit: int, floor: int) -> Match | None:
        """The best match branching off the path above its uncuttable end (a store can hold
        cuttable and uncuttable entries: rotating windows before and after they wrap, chunked
        caches before and after they drop their first chunk): the deepest path node with an entry
        below it that can be cut back exactly to the node, its most recently used one."""
        for node in reversed(path):
            reuse = min(node.depth, limit)
            if reuse <= floor:
                return None
            cuttable = [e for e in self._entries_below(node, True) if cut_refusal(e.snapshot, reuse) is None]
            if cuttable:
                e = max(cuttable, key=lambda e: e.last_used)
                return Match("prefix" if e.tokens == reuse else "lcp", reuse, e.snapshot, e.tokens, e.id)
        return None

    def _entries_below(self, node: Node, include_self: bool) -> list[Entry]:
        out = []
        for n in node.walk():
            if n.entry is not None and (include_self or n is not node):
                out.append(n.entry)
        return out

    def _unit(self, entry: Entry) -> Unit:
        return Unit(entry.id, entry.nbytes, 0, entry.tokens, None, KIND_PRIORITY.get(entry.kind, 0))

    def _touch(self, entry_id: int, sym: tuple, reuse: int) -> None:
        """Credit the entry that served, and every node holding the ``reuse`` tokens it served
        (not the root; the last one perhaps only in part)."""
        entry, _ = self._entries[entry_id]
        tick = next(self._clock)
        entry.last_used, entry.hits = tick, entry.hits + 1
        self.policy.access(self._unit(entry))
        node, depth = self.root, 0
        while depth < reuse and (child := node.children.get(sym[depth])) is not None:
            child.served = node_hits.credit(child.served, min(len(child.edge), reuse - depth), tick)
            node, depth = child, depth + len(child.edge)

    def _node_for(self, sym: tuple) -> Node:
        node, depth = self.root, 0
        while depth < len(sym):
            child = node.children.get(sym[depth])
            if child is None:
                new = Node(sym[depth:], node, len(sym), id=next(self._ids))
                node.children[sym[depth]] = new
                return new
            m = common_prefix_len(child.edge, sym[depth:])
            if m < len(child.edge):
                mid = Node(child.edge[:m], node, depth + m, id=next(self._ids))
                mid.served, child.served = node_hits.split(child.served, m)
                node.children[sym[depth]] = mid
                child.edge = child.edge[m:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            node, depth = child, depth + len(child.edge)
        return node

    def _drop(self, entry: Entry, node: Node, reason: str) -> None:
        capacity = reason not in NON_CAPACITY_REASONS
        if capacity and self.on_evict is not None:
            self.on_evict(str(entry.id), entry.snapshot)  # hand it over (a tier demotes it) first
        node.entry = None
        del self._entries[entry.id]
        self.policy.remove(entry.id)  # a no-op after the policy chose it as victim
        self._bytes -= entry.nbytes
        self.log.add("evict", tokens=entry.tokens, nbytes=entry.nbytes, entry=entry.id, reason=reason,
                     capacity=capacity)
        if capacity:
            self.evictions += 1
        self._prune(node)

    def _prune(self, node: Node) -> None:
        while node is not self.root and node.entry is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[0]]
            node = parent
        if node is not self.root and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()
            child.served = node_hits.join(node.served, len(node.edge), child.served)
            child.edge = node.edge + child.edge
            child.parent = node.parent
            node.parent.children[node.edge[0]] = child

    def _evict(self, protect: int) -> None:
        while self._bytes > self.budget_bytes:
            if not any(i != protect for i in self._entries):
                break
            victim, node = self._entries[self.policy.victim(lambda i: i != protect)]
            self._drop(victim, node, self.policy.name)

    # -- looking ----------------------------------------------------------------------------------
    def contains(self, key: CacheKey) -> bool:
        """True when an entry for exactly these tokens is resident."""
        sym = key.symbols()
        node, depth = self.root, 0
        while depth < len(sym):
            child = node.children.get(sym[depth])
            if child is None or sym[depth: depth + len(child.edge)] != child.edge:
                return False
            node, depth = child, depth + len(child.edge)
        return node.entry is not None

    def tree_frame(self) -> pl.DataFrame:
        """One row per radix node: id, parent, start, depth, tokens, edge token ids, entry, bytes,
        ``hits`` (lookups that reused at least one of its tokens; the root holds none, so 0) and
        ``last_used`` (the clock tick of the latest; 0: never hit)."""
        rows = []
        for n in self.root.walk():
            ids = [s if isinstance(s, int) else s[0] for s in n.edge]
            rows.append({"id": n.id, "parent": None if n.parent is None else n.parent.id,
                         "start": n.depth - len(n.edge), "depth": n.depth, "tokens": len(n.edge),
                         "edge_ids": ids, "entry": n.entry.id if n.entry else None,
                         "entry_kind": n.entry.kind if n.entry else None,
                         "hits": node_hits.hits(n.served), "last_used": node_hits.last_hit(n.served),
                         "bytes": n.entry.nbytes if n.entry else 0})
        return pl.DataFrame(rows, schema_overrides={"parent": pl.Int64, "entry": pl.Int64})

    def entries_frame(self) -> pl.DataFrame:
        return pl.DataFrame([{"entry": e.id, "tokens": e.tokens, "bytes": e.nbytes, "kind": e.kind,
                              "hits": e.hits, "last_used": e.last_used, "trimmable": e.snapshot.trimmable}
                             for e, _ in self._entries.values()],
                            schema={"entry": pl.Int64, "tokens": pl.Int64, "bytes": pl.Int64,
                                    "kind": pl.Utf8, "hits": pl.Int64, "last_used": pl.Int64,
                                    "trimmable": pl.Boolean})

    def __repr__(self) -> str:
        return (f"RadixStore({self.entries} entries, {self._bytes / 2**20:.1f} of "
                f"{self.budget_bytes / 2**20:.0f} MiB, {self.evictions} evictions)")

    def _repr_html_(self) -> str:
        entries = self.entries_frame()
        return summary_html("RadixStore", f"{self.entries} entries",
                            f"{self._bytes / 2**20:.2f} MiB of {self.budget_bytes / 2**20:.0f} MiB",
                            f"{self.evictions} evictions",
                            body=table_html(entries.columns, entries.head(50).rows(), total=entries.height))


