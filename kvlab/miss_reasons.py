"""Why each prompt token an Engine ran was not reused: a model-free memory of what its store cached
and lost, and the classifier giving every missed token one reason of
``kvlab.policies.reasons.ALL_REASONS``, with the simulator's definitions.

The memory is a per-token trie over ``CacheKey.symbols()`` (so salts and images are part of the
path), fed with the store's own events after each request: an ``insert`` / ``block_stored``
covers the key's first ``tokens`` tokens (a paged block, found by its chained hash, covers its
``block_size`` tokens); an ``evict`` / ``block_removed`` uncovers what that entry covered, and a
token no entry covers any more is *lost*, by that request. A tiered store's ``demote`` hands an
entry to the disk instead of losing it. Plain ids are remembered apart from their namespace, to
tell a salt or an image from a new prompt, and apart per ``scope`` (a server's tenant): ids another
tenant cached are never a reason of this one's (``salt_or_extra_keys`` would tell it that someone
else holds the same tokens).

A request's missed tokens ``[reused, n)``, in units of the store's granularity ``g`` (1, or the
block size; only the units within the first ``n - 1`` tokens can hit):

- ``partial_block``: past the last whole unit within the first ``n - 1`` tokens (the last
  token is always recomputed; a paged store reuses whole blocks only);
- a unit still cached but not served: the reason of the missing unit before it (the leading-run
  rule); if none is missing before it, the store could not cut its entry there:
  ``not_trimmable`` for a cache that cannot be trimmed (a hybrid model without a checkpoint
  there), else ``partial_block`` (a store that reuses only whole entries);
- cached before and lost since: ``over_capacity`` when the request that cached it lost it and
  kept nothing else cached (it alone did not fit; the simulator's positional rule, blocks past
  the capacity, says the same of a request that fits no other way), else ``evicted``
  (``evicted_by``: the request whose insertion evicted the first such unit);
- never cached, but offered to a store that cannot hold this model's cache at all (a paged store
  and a hybrid model), or declined by the store (a ``refuse`` event: the cache could not be cut
  back to where the store keeps it): ``not_trimmable``;
- never cached under this namespace but cached with these ids under another one:
  ``salt_or_extra_keys``;
- never cached: ``diverged`` when the unit before it was cached with another continuation
  (``diverged_at``: the first token that differs), else ``first_seen``; decided at the first
  such unit of the request, as in the simulator.

Example:
    >>> from kvlab.stores.base import StoreEvent
    >>> idx = MissIndex()
    >>> a = CacheKey((1, 2, 3, 4))
    >>> idx.explain(a, 0).reasons["first_seen"], idx.explain(a, 0).reasons["partial_block"]
    (3, 1)
    >>> idx.record(1, a, [StoreEvent("insert", 4, 64, "1")])
    >>> e = idx.explain(CacheKey((1, 2, 9, 9)), 2)
    >>> e.reasons["diverged"], e.diverged_at
    (1, 2)
    >>> idx.record(2, a, [StoreEvent("evict", 4, 64, "1", capacity=True)])
    >>> e = idx.explain(a, 0)
    >>> e.reasons["evicted"], e.evicted_by
    (3, 2)
"""

from __future__ import annotations

from dataclasses import dataclass

from .keys import CacheKey
from .policies.reasons import ALL_REASONS
from .primitives.display import summary_html

COVERS = ("insert", "block_stored", "persist")
REMOVES = ("evict", "block_removed", "corrupt")
REFUSES = ("refuse",)  # a store declined an offer: the cache cannot be cut where it needs it
EVER, IDS_SEEN, HAD_CHILD, OFFERED, OVER, REFUSED = 1, 2, 4, 8, 16, 32  # node flags


@dataclass(frozen=True)
class Explained:
    """One request's missed tokens by reason (every ``ALL_REASONS`` key), the first token that
    differs from everything cached (``diverged_at``) and the request id whose insertion evicted
    the first evicted unit (``evicted_by``)."""

    reasons: dict
    diverged_at: int | None = None
    evicted_by: int | None = None

    @property
    def missed(self) -> int:
        return sum(self.reasons.values())

    def __repr__(self) -> str:
        parts = ", ".join(f"{k} {v}" for k, v in self.reasons.items() if v) or "none"
        return f"Explained({self.missed} missed: {parts})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


class MissIndex:
    """The Engine's memory of what its store cached and lost (see module docstring).

    ``block_size``: a paged store's (its events name blocks by chained hash, and it reuses whole
    blocks); None for stores of whole entries (reuse at any token). ``unstorable``: the store can
    hold none of this engine's caches (a store that slices KV per block or token, and a model
    whose cache cannot be cut); then what was offered before and missed again is
    ``not_trimmable``.
    """

    def __init__(self, block_size: int | None = None, *, unstorable: bool = False):
        self.block_size = block_size
        self.granularity = block_size or 1
        self.unstorable = unstorable
        self._child: dict[tuple, int] = {}   # (parent node, symbol) -> node; node 0 is the root
        self._parent = [-1]
        self._flags = [0]
        self._cover = [0]                    # resident entries covering the node
        self._covered_by = [-1]              # the request that last covered it
        self._lost_by = [-1]                 # the request whose events left it uncovered
        self._records: dict[tuple, tuple] = {}  # (tier, entry) -> (last node, tokens, request)

    # -- the trie ---------------------------------------------------------------------------------
    def _path(self, symbols, create: bool, root: int = 0) -> list[int]:
        """Nodes of symbols[:1], symbols[:2], ... below ``root`` (as far as they exist, unless
        ``create``)."""
        path, node = [], root
        if node < 0:
            return path
        for s in symbols:
            nxt = self._child.get((node, s))
            if nxt is None:
                if not create:
                    break
                nxt = len(self._parent)
                self._child[(node, s)] = nxt
                self._parent.append(node)
                self._flags.append(0)
                self._cover.append(0)
                self._covered_by.append(-1)
                self._lost_by.append(-1)
            path.append(nxt)
            node = nxt
        return path

    def _plain(self, key: CacheKey, sym, path: list[int], scope, create: bool) -> list[int]:
        """The nodes of ``key``'s plain ids: ``path`` itself for a key without a namespace in
        the shared scope, else below the scope's own root (a node no symbol of a key can reach)."""
        if scope is None:
            return path if sym is key.ids else self._path(key.ids, create)
        root = self._path((("scope", str(scope)),), create)
        return self._path(key.ids, create, root[0] if root else -1)

    @property
    def nodes(self) -> int:
        return len(self._parent) - 1

    # -- explaining -------------------------------------------------------------------------------
    def explain(self, key: CacheKey, reused: int, *, untrimmable: bool = False,
                refused: int = 0, scope=None) -> Explained:
        """Why the tokens of ``key`` past ``reused`` were not reused, from what was cached before
        this request (call it before ``record`` of the same request). ``untrimmable``: the
        engine's cache cannot be trimmed; ``refused``: tokens the store served that could not be
        trimmed to fit (``not_trimmable``, whatever the memory says); ``scope``: the tenant whose
        plain ids count (None: everyone's)."""
        n, g = len(key), self.granularity
        sym = key.symbols()
        path = self._path(sym, False)
        plain = self._plain(key, sym, path, scope, False)
        out = dict.fromkeys(ALL_REASONS, 0)
        units = (n - 1) // g
        out["partial_block"] = n - max(units * g, reused)
        prev = chain = diverged_at = evicted_by = None
        for u in range(reused // g, units):
            lo, hi = max(u * g, reused), (u + 1) * g
            if hi <= lo:
                continue
            node = path[hi - 1] if hi <= len(path) else None
            flags = self._flags[node] if node is not None else 0
            if hi <= refused:
                why = "not_trimmable"
            elif node is not None and self._cover[node] > 0:
                why = prev or ("not_trimmable" if untrimmable else "partial_block")
            elif flags & EVER:
                if flags & OVER:
                    why = "over_capacity"
                else:
                    why = "evicted"
                    evicted_by = self._lost_by[node] if evicted_by is None else evicted_by
            elif (self.unstorable and flags & OFFERED) or flags & REFUSED:
                why = "not_trimmable"
            elif hi <= len(plain) and self._flags[plain[hi - 1]] & IDS_SEEN:
                why = "salt_or_extra_keys"
            else:
                if chain is None:
                    before = path[u * g - 1] if 0 < u * g <= len(path) else None
                    chain = ("diverged" if before is not None and self._flags[before] & HAD_CHILD
                             else "first_seen")
                    if chain == "diverged":
                        p = u * g
                        while p < len(path) and self._flags[path[p]] & EVER:
                            p += 1
                        diverged_at = p
                why = chain
            prev = why
            out[why] += hi - lo
        return Explained(out, diverged_at, evicted_by)

    # -- remembering ------------------------------------------------------------------------------
    def record(self, request: int, key: CacheKey, events, *, offered: CacheKey | None = None,
               scope=None) -> None:
        """Apply one request's store events. ``key``: the longest key the request inserted (every
        other insert of the request is a prefix of it); ``offered``: what it offered the store;
        ``scope``: the request's tenant (its plain ids are remembered for it alone)."""
        sym = key.symbols()
        path = plain = blocks = None
        pending = None  # a tiered store's demote: the next entry leaving RAM moves to this disk name
        own: list[int] = []  # nodes this request cached and lost again
        for ev in events:
            if ev.event == "demote":
                pending = None if ev.reason else ev.entry
                continue
            name = (ev.tier, ev.entry)
            if ev.event in COVERS:
                # a promoted copy is already covered by its disk file; a reason means it was skipped
                if ev.entry is None or ev.reason or ev.kind == "promoted" or name in self._records:
                    continue
                if path is None:
                    path = self._path(sym, True)
                    plain = self._plain(key, sym, path, scope, True)
                    blocks = ({h.hex(): i for i, h in enumerate(key.block_hashes(self.block_size))}
                              if self.block_size else {})
                i = blocks.get(ev.entry)
                lo, hi = ((i * self.granularity, (i + 1) * self.granularity) if i is not None
                          else (0, min(int(ev.tokens), len(path))))
                if hi > lo:
                    self._cover_range(request, path, plain, lo, hi)
                    self._records[name] = (path[hi - 1], hi - lo, request)
            elif ev.event in REFUSES:
                if path is None:
                    path = self._path(sym, True)
                for node in path[: int(ev.tokens)]:
                    self._flags[node] |= REFUSED
            elif ev.event in REMOVES:
                rec, target, pending = self._records.pop(name, None), pending, None
                if rec is None:
                    continue
                if target is not None and ev.capacity and ev.tier == "ram":
                    target = ("disk", target)
                    if target not in self._records:
                        self._records[target] = rec  # handed to the disk: still cached
                        continue
                self._uncover(request, rec[0], rec[1], own)
        # lost by the request that cached it, with nothing but that request left: it alone did
        # not fit (had anything else stayed, the policy chose to evict the request's own KV)
        if own and all(rec[2] == request for rec in self._records.values()):
            for node in own:
                self._flags[node] |= OVER
        if offered is not None and self.unstorable:
            for node in self._path(offered.symbols(), True):
                self._flags[node] |= OFFERED

    def _cover_range(self, request: int, path: list[int], plain: list[int], lo: int, hi: int) -> None:
        for p in range(lo, hi):
            node = path[p]
            self._cover[node] += 1
            self._covered_by[node] = request
            self._flags[node] &= ~OVER
            if not self._flags[node] & EVER:
                self._flags[node] |= EVER
                self._flags[self._parent[node]] |= HAD_CHILD
            self._flags[plain[p]] |= IDS_SEEN

    def _uncover(self, request: int, node: int, tokens: int, own: list[int]) -> None:
        for _ in range(tokens):
            self._cover[node] -= 1
            if self._cover[node] == 0:
                self._lost_by[node] = request
                if self._covered_by[node] == request:
                    own.append(node)
            node = self._parent[node]

    def __repr__(self) -> str:
        unit = f"blocks of {self.block_size}" if self.block_size else "entries"
        return (f"MissIndex({unit}, {self.nodes} token nodes, "
                f"{len(self._records)} cached entries)")

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)
