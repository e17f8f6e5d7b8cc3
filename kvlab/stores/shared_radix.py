"""SharedRadixStore: a radix tree whose nodes own their edge's KV (SGLang's RadixAttention).

RadixStore keeps one snapshot per entry, so sibling prompts each store their shared prefix. Here
every node holds an exact-size copy of the KV of its edge tokens only (``kvlab.stores.edge_kv``),
so a prefix shared by many prompts is stored once. A hit concatenates the slices along the matched
path into one snapshot of exactly the reused tokens; an insert stores only the tokens the tree
lacks; an insert that parts ways inside an edge splits that node, and its KV (two copies; logged
as an ``evict`` of the old node with reason ``split``, ``capacity=False``, and two ``insert``\\ s).

Eviction is leaf-first: only a node with no children that no request in flight holds (the path
of the insert running: its nodes are locked) can go, chosen by ``policy`` (any online name in
``kvlab.policies.POLICIES``, default ``"lru"``) among those. Each node is one policy unit of its
bytes (capacity: ``budget_bytes``), depth = its first token's position, parent = its parent
node; an insert accesses every node on its path, tail first, as PagedStore does with its blocks.
On a backend that limits live buffers (Metal: ``kvlab.device``), the limit is a second capacity:
leaves go for room in buffers as for bytes, and an insert whose path alone would exceed it is refused
(``BufferLimitError``).
The policy interface has no resize, so a split re-registers both halves (the untouched half
loses its history and counts as used now). Room is made before new KV is copied in, so the
bytes held never exceed the budget.

Reuse: ``min(shared tokens, limit)`` whatever was inserted, exactly what RadixStore gives a
trimmable model (its trimmed ``lcp``/``supersequence`` hits), with the same match kinds
(``exact``, ``supersequence``, ``prefix`` where an insert ended, else ``lcp``); no trim is needed.
Under a budget the two keep different things: RadixStore drops whole entries, this store the
deepest unshared tokens first.

Only attention KV (``KVCache``, ``QuantizedKVCache``) is cut per token. Sliding-window and
recurrent layers (hybrid models, CacheList layers, pure recurrent models) are held as
checkpoints (``kvlab.stores.shared_node``): each insert of such a model keeps one at its end
(the Engine inserts at the positions its checkpoint policy names), and a hit is the deepest
checkpoint on the matched path, at or below the limit, with the full KV sliced up to it.
A chunked-attention layer (Llama 4) is held as a sliding window of its chunk size (its KV counts
as ``window`` in ``components()``, which gives the bytes of each kind). Windows with sink tokens
are refused, the layer named; a store in front of a tier (``on_evict``) holds full KV only.
Extra keys and the salt enter through ``CacheKey.symbols()``, as in RadixStore. One model and
one KV format per store.

Example:
    >>> store = kv.stores.SharedRadixStore(budget_bytes=256 << 20, policy="lru")
    >>> engine = kv.Engine(m, store)
    >>> store.tree_frame()
"""

from __future__ import annotations


import polars as pl

from ..errors import SnapshotError
from ..keys import CacheKey
from ..policies import KIND_PRIORITY, Unit, store_policy
from ..primitives.cache_parts import WINDOWED, arrays_of, assemble, fresh_of, parts_of, structure_of
from ..primitives.snapshots import Snapshot
from ..primitives.tokens import Tokens, common_prefix_len
from . import node_hits
from .base import Capabilities, Match, too_big
from .budgeted import BudgetedStore
from .edge_kv import cut, join, nbytes_of
from .paged_parts import needs, obstacle
from .shared_node import Node, checkpoint_of, components_of, edge_ids, frame_of, full_only, html_of, window_state

SPLIT = "split"  # the reason logged when a node is replaced by its two halves


class SharedRadixStore(BudgetedStore):
    """Radix tree of shared KV slices (see module docstring). ``budget_bytes`` defaults to 25% of
    the device's memory (``device``: ``kvlab.device.current()`` unless given); ``policy`` (a name or a ``kvlab.policies.Policy``) and ``policy_params`` choose which
    leaf goes; ``on_evict(node_id: str, snapshot)`` receives the KV of the whole path down to a
    node before it is evicted for room (a tier below could keep it)."""

    name = "shared-radix"

    def __init__(self, budget_bytes: int | None = None, *, policy="lru", policy_params: dict | None = None,
                 on_evict=None, device=None):
        super().__init__(budget_bytes, on_evict, device)
        self._buffers = 0  # device buffers held (Node.buffers), bounded by device.buffer_limit
        self.policy = store_policy(policy, self.budget_bytes, policy_params, store=self.name)
        self.root = Node(0, (), None, 0, None, "root")
        self._nodes: dict[int, Node] = {}
        self._fingerprint: str | None = None
        self._unsliceable = ""  # why the last snapshot offered could not be cut per token
        self._parts = None  # the model's cache parts (kvlab.primitives.cache_parts), from its first snapshot

    # -- protocol ---------------------------------------------------------------------------------
    @property
    def entries(self) -> int:
        """Nodes holding KV (the root holds none)."""
        return len(self._nodes)

    @property
    def capabilities(self) -> Capabilities:
        # a path handed to a tier below restores nothing of a window or a recurrent state
        holds = {"full"} if self.on_evict is not None else {"full", "window", "chunked", "recurrent", "list"}
        return Capabilities(holds=frozenset(holds), budget_bytes=self.budget_bytes, views=("tree",),
                            components=True, eviction_policy=self.policy.name)

    def lookup(self, key: CacheKey, tokens: Tokens, *, limit: int) -> Match:
        if self._unsliceable:
            return Match("miss", why=self._unsliceable)
        sym = key.symbols()
        path, shared = self._walk(sym)
        reuse = min(shared, limit)
        if reuse <= 0:
            return Match("miss", why="" if self._nodes else "nothing cached yet")
        cp = None
        if self._checkpointed:
            at = max((p for n in path for p in n.checkpoints if p <= reuse), default=0)
            if not at:
                return Match("miss", why=f"{reuse} leading tokens are cached, but no checkpoint of "
                             f"{needs(self._parts)} is held within them")
            cp = next(n.checkpoints[at] for n in path if at in n.checkpoints)
            reuse, cp.hits = at, cp.hits + 1
        used = [n for n in path if n.start < reuse]
        last = used[-1]
        if shared == len(sym):
            kind = "exact" if len(sym) in path[-1].ends else "supersequence"
        else:
            kind = "prefix" if reuse in last.ends else "lcp"
        tick = next(self._clock)
        for n in used:  # every node that served tokens, the last perhaps only in part
            n.served = node_hits.credit(n.served, min(n.depth, reuse) - n.start, tick)
            n.last_used = tick
        snap = join([(n.kv, min(n.depth, reuse) - n.start) for n in used], key.ids[:reuse], self._fingerprint)
        if cp is not None:
            snap = self._with_checkpoint(snap, cp)
        return Match(kind, reuse, snap, last.depth, last.id)

    def insert(self, key: CacheKey, tokens: Tokens, snap: Snapshot, *, kind: str = "prompt") -> None:
        parts = parts_of(snap)
        why = obstacle(parts, "SharedRadixStore cannot slice")
        if why:
            self._unsliceable = why
            return
        sym = key.symbols()[: snap.offset]
        n = len(sym)
        if n == 0:
            return
        self._check_model(snap)
        if self._parts is None:
            self._parts = structure_of(parts)
        snap = full_only(snap, parts)
        path, depth = self._walk(sym)
        # the node that holds token n - 1 already, if any, and whether it has a checkpoint at n
        there = path[-1] if depth == n else None
        cp = None
        if self._checkpointed and (there is None or n not in there.checkpoints):
            earlier = [(p, c) for x in path for p, c in x.checkpoints.items() if p <= depth and p < n]
            cp = checkpoint_of(next(self._ids), parts, n, max(earlier, key=lambda pc: pc[0])[1] if earlier else None)
        # bytes the whole path holds once inserted: what it shares, and the rest from snap
        held = sum(x.nbytes if x.depth <= depth else nbytes_of(x.kv, 0, depth - x.start) for x in path)
        new = nbytes_of(snap, depth, n) + (cp.nbytes if cp else 0)
        if held + new > self.budget_bytes:
            raise too_big(self.name, held + new, self.budget_bytes)
        per_node = len(arrays_of([layer.state[:2] for layer in snap.layers]))  # K and V per layer
        new_buffers = per_node * (depth < n) + (len(arrays_of(list(cp.states.values()))) if cp else 0)
        self.device.check_buffers(sum(x.buffers for x in path) + new_buffers + per_node,  # + a split
                                  f"{self.name}: this request's path", "send shorter prompts or use a "
                                  "PagedStore with a bigger block_size")
        if path and path[-1].depth > depth and depth < n:
            path[-1] = self._split(path[-1], depth - path[-1].start)  # parts ways inside the edge
        locked = list(path)
        for x in locked:
            x.lock += 1
        try:
            self._make_room(new, new_buffers)
            if depth < n:
                parent = path[-1] if path else self.root
                leaf = Node(next(self._ids), sym[depth:], parent, n, cut(snap, depth, n), kind)
                parent.children[sym[depth]] = leaf
                self._add(leaf)
                path.append(leaf)
            if cp is not None:
                self._add_checkpoint(path[-1], cp, kind)
        finally:
            for x in locked:
                x.lock -= 1
        # a trimmable path serves every prefix of itself: earlier ends on it are no longer "entries"
        for x in path:
            x.ends = {e for e in x.ends if e >= n}
        path[-1].ends.add(n)
        tick = next(self._clock)
        for x in reversed(path):  # tail first, as PagedStore frees a request's blocks
            x.last_used = tick
            self.policy.access(self._unit(x, kind))

    # -- internals --------------------------------------------------------------------------------
    def _walk(self, sym: tuple) -> tuple[list[Node], int]:
        """The nodes ``sym`` runs through from the root (the last one perhaps only partly) and how
        many of its tokens the tree holds."""
        node, depth, path = self.root, 0, []
        while depth < len(sym):
            child = node.children.get(sym[depth])
            if child is None:
                break
            m = common_prefix_len(child.edge, sym[depth: depth + len(child.edge)])
            path.append(child)
            depth += m
            if m < len(child.edge):
                break
            node = child
        return path, depth

    @property
    def _checkpointed(self) -> bool:
        """A hit needs a checkpoint (this model has window or recurrent parts)."""
        return bool(self._parts) and bool(needs(self._parts))

    def _add_checkpoint(self, node: Node, cp, kind: str) -> None:
        node.checkpoints[cp.position] = cp
        self._bytes += cp.nbytes
        self._buffers += len(arrays_of(list(cp.states.values())))
        self.policy.remove(node.id)  # no resize in the policy interface: the insert re-registers it
        self.log.add("checkpoint_stored", tokens=cp.position, nbytes=cp.nbytes, entry=node.id, kind=kind)

    def _with_checkpoint(self, full: Snapshot, cp) -> Snapshot:
        """The snapshot at ``cp.position``: full KV from the path, the rest from the checkpoint."""
        states, f = {}, 0
        for i, p in enumerate(self._parts):
            if p.kind == "full":
                states[i], f = full.layers[f].state, f + 1
            else:
                states[i] = fresh_of(window_state(cp, i, p) if p.kind in WINDOWED else cp.states[i])
        return Snapshot(assemble(self._parts, states, full.offset), full.offset, full.token_ids, full.fingerprint)

    def _unit(self, node: Node, kind: str) -> Unit:
        parent = None if node.parent is self.root else node.parent.id
        return Unit(node.id, node.nbytes, node.start, node.tokens, parent, KIND_PRIORITY.get(kind, 0))

    def _add(self, node: Node) -> None:
        self._nodes[node.id] = node
        self._bytes += node.nbytes
        self._buffers += node.buffers
        # a split's halves carry their checkpoints' bytes, so evict and insert events still balance
        self.log.add("insert", tokens=node.tokens, nbytes=node.nbytes, entry=node.id, kind=node.kind)

    def _split(self, node: Node, m: int) -> Node:
        """Replace ``node`` by a head of its first ``m`` tokens and a tail of the rest (each with
        its own copy of its KV); returns the head."""
        parent, start = node.parent, node.start
        head = Node(next(self._ids), node.edge[:m], parent, start + m, cut(node.kv, 0, m), node.kind)
        tail = Node(next(self._ids), node.edge[m:], head, node.depth, cut(node.kv, m, node.tokens), node.kind,
                    children=node.children)
        for x in (head, tail):
            x.last_used, x.lock = node.last_used, node.lock
        head.served, tail.served = node_hits.split(node.served, m)
        head.ends = {e for e in node.ends if e <= start + m}
        tail.ends = node.ends - head.ends
        head.checkpoints = {p: c for p, c in node.checkpoints.items() if p <= start + m}
        tail.checkpoints = {p: c for p, c in node.checkpoints.items() if p > start + m}
        for child in tail.children.values():
            child.parent = tail
        head.children = {tail.edge[0]: tail}
        parent.children[head.edge[0]] = head
        del self._nodes[node.id]
        self._bytes -= node.nbytes
        self._buffers -= node.buffers
        self.policy.remove(node.id)
        self.log.add("evict", tokens=node.tokens, nbytes=node.nbytes, entry=node.id, reason=SPLIT)
        for x in (head, tail):
            self._add(x)
            self.policy.access(self._unit(x, x.kind))
        return head

    def _evictable(self, key) -> bool:
        node = self._nodes[key]
        return not node.children and node.lock == 0

    def _make_room(self, incoming: int, buffers: int = 0) -> None:
        limit = self.device.buffer_limit
        while (self._bytes + incoming > self.budget_bytes
               or (limit is not None and self._buffers + buffers > limit)):
            self._evict(self._nodes[self.policy.victim(self._evictable)])

    def _evict(self, node: Node) -> None:
        if self.on_evict is not None and not self._checkpointed:
            self.on_evict(str(node.id), self._path_snapshot(node))  # hand it over first
        del node.parent.children[node.edge[0]]
        del self._nodes[node.id]
        self.policy.remove(node.id)  # a no-op after the policy chose it as victim
        self._bytes -= node.nbytes
        self._buffers -= node.buffers
        self.evictions += 1
        for cp in node.checkpoints.values():  # first, as PagedStore drops a block's checkpoint
            self.log.add("checkpoint_removed", tokens=cp.position, nbytes=cp.nbytes, entry=node.id,
                         reason=self.policy.name)
        self.log.add("evict", tokens=node.tokens, nbytes=node.kv_nbytes, entry=node.id,
                     reason=self.policy.name, capacity=True)

    def _path_snapshot(self, node: Node) -> Snapshot:
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent
        path.reverse()
        ids = [t for x in path for t in edge_ids(x.edge)]
        return join([(x.kv, x.tokens) for x in path], ids, self._fingerprint)

    def _check_model(self, snap: Snapshot) -> None:
        if snap.fingerprint is None:
            return
        if self._fingerprint is None or not self._nodes:
            self._fingerprint = snap.fingerprint
        elif snap.fingerprint != self._fingerprint:
            raise SnapshotError(f"this SharedRadixStore holds KV of model {self._fingerprint[:12]}, not "
                                f"of model {snap.fingerprint[:12]}: its keys do not include the model, "
                                "so use one store per model")

    # -- looking ----------------------------------------------------------------------------------
    def contains(self, key: CacheKey) -> bool:
        """True when the tree holds the KV of every token of ``key``."""
        sym = key.symbols()
        return self._walk(sym)[1] == len(sym)

    def components(self) -> dict:
        """Bytes held per component (``full`` KV slices, ``window`` KV and ``recurrent`` state in
        checkpoints), the checkpoint count, and per layer the window KV tokens held. ``nbytes``
        (their sum) stays the store's memory figure."""
        return components_of(self._nodes.values(), self._parts)

    def tree_frame(self) -> pl.DataFrame:
        """One row per node, RadixStore.tree_frame's columns: id, parent, start, depth, tokens,
        edge_ids, entry (the node itself: every node holds KV), entry_kind, hits, last_used, bytes."""
        return frame_of(self.root)

    def __repr__(self) -> str:
        return (f"SharedRadixStore({self.entries} nodes, {self._bytes / 2**20:.1f} of "
                f"{self.budget_bytes / 2**20:.0f} MiB, {self.evictions} evictions)")

    def _repr_html_(self) -> str:
        return html_of(self, self._unsliceable)
