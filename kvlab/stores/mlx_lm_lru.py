"""MlxLmLRUStore: mlx-lm's own ``LRUPromptCache`` (what ``mlx_lm.server`` runs) behind the store
protocol, the baseline every comparison should include (seed 002).

Its answers map to Match kinds: an exact entry -> ``exact``; a longer entry trimmed to the shared
prefix -> ``supersequence`` (it extends the request) or ``lcp``; a shorter entry -> ``prefix``.
As in mlx-lm, every hit is a ``copy.deepcopy`` of the entry's cache (pitfall 7 in the README: the peak
memory of a hit is the entry twice), and entries are counted (``max_size``), not sized, unless
``max_bytes`` is given.

mlx-lm keys its trie by token ids only; the adapter hands it ``CacheKey.symbols()`` instead (plain
ids when there is no salt and no extra key, else ids tagged from where the salt or an image's hash
applies), so a request never reuses KV made for another tenant or with other images, and text
before an image stays reusable as in the other stores.

Example:
    >>> engine = kv.Engine(kv.load("tiny"), kv.MlxLmLRUStore(max_size=10))
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from mlx_lm.models.cache import LRUPromptCache

from ..errors import SnapshotError
from ..keys import CacheKey
from ..primitives.display import summary_html, table_html
from ..primitives.snapshots import Snapshot, compact, non_trimmable_layers, restore, snapshot
from ..primitives.tokens import Tokens
from .base import Capabilities, EventLog, Match, StoreBase

MODEL_KEY = "kvlab"  # mlx-lm's per-model namespace; one adapter serves one model


class MlxLmLRUStore(StoreBase):
    """An adapter over ``mlx_lm.models.cache.LRUPromptCache`` (see module docstring)."""

    name = "mlx-lru"

    def __init__(self, max_size: int = 10, *, max_bytes: int | None = None):
        self.cache = LRUPromptCache(max_size, max_bytes if max_bytes is not None else 1 << 63)
        self.max_size, self.max_bytes = max_size, max_bytes
        self._resident: dict[tuple, tuple[int, int, int]] = {}  # (ns, ids) -> (entry id, tokens, bytes)
        self._fingerprint: str | None = None
        self._ids = itertools.count(1)
        self.evictions = 0
        self.log = EventLog()

    # -- protocol ---------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    @property
    def entries(self) -> int:
        return len(self.cache)


    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(budget_bytes=self.max_bytes)

    def lookup(self, key: CacheKey, tokens: Tokens, *, limit: int) -> Match:
        symbols = list(key.symbols())
        match = self._lookup(key, symbols, limit)
        snap = match.snapshot
        if snap is not None and limit < len(symbols) and non_trimmable_layers(snap, match.tokens):
            # an entry of the whole prompt that cannot be cut back to the limit: an entry ending
            # there (a checkpoint at n - 1) can serve instead
            shorter = self._lookup(key, symbols[:limit], limit)
            if shorter.tokens:
                return shorter
        return match

    def _lookup(self, key: CacheKey, ids: list, limit: int) -> Match:
        ns = MODEL_KEY
        # mlx-lm's answer does not say which branch it took; its trie's search does (read-only)
        found = self.cache._trie.search(ns, ids)
        cache, rest = self.cache.fetch_nearest_cache(ns, ids)
        if cache is None:
            return Match("miss", why="" if found.common_prefix == 0 else
                         f"an entry shares {found.common_prefix} tokens but mlx-lm does not trim it "
                         "(its cache is not trimmable)")
        covered = len(ids) - len(rest)
        if found.exact is not None:
            kind, entry = "exact", tuple(ids)
        elif found.longer is not None and covered > (len(found.shorter) if found.shorter else 0):
            kind, entry = ("supersequence" if found.common_prefix >= len(ids) else "lcp"), tuple(found.longer)
        else:
            kind, entry = "prefix", tuple(found.shorter)
        try:
            snap = snapshot(cache, tokens=key.ids[:covered])
        except SnapshotError:  # mlx-lm's trim of a chunked cache stops at its chunk start, silently
            snap = None
        if kind in ("supersequence", "lcp") or snap is None:
            # mlx-lm cut its copy back wherever its layers say they can be cut, and a chunked
            # cache wrongly says so (pitfall 11): hand over the entry as stored, for the reuse
            # core to cut only where every layer can be cut exactly, else the shorter entry
            stored = snapshot(self.cache._trie.get(ns, list(entry)).prompt_cache)
            if not non_trimmable_layers(stored, min(covered, limit)):
                snap = stored
            elif found.shorter:
                kind, entry, covered = "prefix", tuple(found.shorter), len(found.shorter)
                snap = snapshot(self.cache._trie.get(ns, list(entry)).prompt_cache)
            else:
                snap = stored
        # a longer entry's own ids are not the request's past the shared prefix: leave them out
        snap = replace(snap, token_ids=key.ids[:covered] if snap.offset == covered else None,
                       fingerprint=self._fingerprint)
        entry_id, entry_tokens, _ = self._resident.get((ns, entry), (None, len(entry), 0))
        return Match(kind, min(covered, limit), snap, entry_tokens, entry_id)

    def insert(self, key: CacheKey, tokens: Tokens, snap: Snapshot, *, kind: str = "prompt") -> None:
        ns, ids = MODEL_KEY, tuple(key.symbols()[: snap.offset])
        self._fingerprint = snap.fingerprint or self._fingerprint
        caches = restore(compact(snap))  # exact-size arrays: views would keep the whole buffer alive
        nbytes = sum(c.nbytes for c in caches)  # what LRUPromptCache counts for the entry
        self.cache.insert_cache(ns, list(ids), caches, cache_type=_cache_type(kind))
        if (ns, ids) not in self._resident:
            self._resident[(ns, ids)] = (next(self._ids), len(ids), nbytes)
            self.log.add("insert", tokens=len(ids), nbytes=nbytes, entry=self._resident[(ns, ids)][0],
                         kind=kind)
        self._sync(ns, ids, snap.trimmable)

    # -- internals --------------------------------------------------------------------------------
    def _sync(self, ns, ids, trimmable: bool) -> None:
        """Log the entries mlx-lm dropped during the last insert (it does not report them)."""
        for k in list(self._resident):
            if k == (ns, ids) or self._present(*k):
                continue
            entry_id, tokens, nbytes = self._resident.pop(k)
            subsumed = trimmable and k[0] == ns and ids[: len(k[1])] == k[1]
            if not subsumed:
                self.evictions += 1
            self.log.add("evict", tokens=tokens, nbytes=nbytes, entry=entry_id,
                         reason="subsumed" if subsumed else "lru", capacity=not subsumed)

    def _present(self, ns, ids) -> bool:
        try:
            self.cache._trie.get(ns, list(ids))
            return True
        except KeyError:
            return False

    def __repr__(self) -> str:
        return (f"MlxLmLRUStore({self.entries} of {self.max_size} entries, "
                f"{self.nbytes / 2**20:.1f} MiB, {self.evictions} evictions)")

    def _repr_html_(self) -> str:
        return summary_html("MlxLmLRUStore", "mlx-lm's LRUPromptCache", repr(self),
                            body=table_html(["entry", "tokens", "bytes"], sorted(self._resident.values())))


def _cache_type(kind: str) -> str:
    # mlx-lm's eviction order prefers dropping "assistant" (prompt+output) entries, then "user"
    return {"prompt+output": "assistant", "checkpoint": "system"}.get(kind, "user")
