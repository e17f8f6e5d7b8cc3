"""MlxLmLRUStore: mlx-lm's own ``LRUPromptCache`` (what ``mlx_lm.server`` runs) behind the store
protocol, the baseline every comparison should include (seed 002).

Its answers map to Match kinds: an exact entry -> ``exact``; a longer entry trimmed to the shared
prefix -> ``supersequence`` (it extends the request) or ``lcp``; a shorter entry -> ``prefix``.
As in mlx-lm, every hit is a ``copy.deepcopy`` of the entry's cache (pitfall 7 in the README: the peak
memory of a hit is the entry twice), and entries are counted (``max_size``), not sized, unless
``max_bytes`` is given.

mlx-lm's chunked caches (llama4) say they can be trimmed anywhere, but go back only to the chunk
they hold (pitfall 11): the adapter hands mlx-lm caches that say the truth, so mlx-lm keeps the
entries before one (instead of dropping them as subsumed) and, when a request parts inside it,
falls back to its longest shorter entry; the miss reason names the entry it fell back from.

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

from ..keys import CacheKey
from ..primitives.display import summary_html, table_html
from ..primitives.snapshots import Snapshot, compact, cut_refusal, non_trimmable_layers, restore, snapshot
from ..primitives.tokens import Tokens
from .base import Capabilities, EventLog, Match, StoreBase, fell_back

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
        covered = len(ids) - len(rest) if cache is not None else 0
        snap = snapshot(cache, tokens=key.ids[:covered]) if cache is not None else None
        if found.exact is not None:
            kind, entry = "exact", tuple(ids)
        elif found.longer is not None and covered > (len(found.shorter) if found.shorter else 0):
            kind, entry = ("supersequence" if found.common_prefix >= len(ids) else "lcp"), tuple(found.longer)
        else:
            kind, entry = "prefix", tuple(found.shorter or ())
        why = ""
        if found.longer is not None and found.common_prefix > covered:
            # mlx-lm did not trim the longer entry: its cache cannot go back anywhere (a chunked
            # cache says so here: _cut_back_truthfully). The reuse core can cut it where every
            # layer can be cut exactly; else mlx-lm's own answer stands, its longest shorter entry
            reuse = min(found.common_prefix, limit)
            # its own ids (a recurrent-only cache does not say how many it holds)
            stored = snapshot(self.cache._trie.get(ns, list(found.longer)).prompt_cache,
                              tokens=[s if isinstance(s, int) else s[0] for s in found.longer])
            refused = cut_refusal(stored, reuse)
            if refused is None:
                kind = "supersequence" if found.common_prefix >= len(ids) else "lcp"
                entry, covered, snap = tuple(found.longer), found.common_prefix, stored
            else:
                why = fell_back(len(found.longer), found.common_prefix, reuse, refused, (covered, covered))
        if snap is None:
            return Match("miss", why=why)
        # a longer entry's own ids are not the request's past the shared prefix: leave them out
        snap = replace(snap, token_ids=key.ids[:covered] if snap.offset == covered else None,
                       fingerprint=self._fingerprint)
        entry_id, entry_tokens, _ = self._resident.get((ns, entry), (None, len(entry), 0))
        return Match(kind, min(covered, limit), snap, entry_tokens, entry_id, why)

    def insert(self, key: CacheKey, tokens: Tokens, snap: Snapshot, *, kind: str = "prompt") -> None:
        ns, ids = MODEL_KEY, tuple(key.symbols()[: snap.offset])
        self._fingerprint = snap.fingerprint or self._fingerprint
        # exact-size arrays (views would keep the whole buffer alive), chunked caches truthful
        caches = _cut_back_truthfully(restore(compact(snap)))
        nbytes = sum(c.nbytes for c in caches)  # what LRUPromptCache counts for the entry
        self.cache.insert_cache(ns, list(ids), caches, cache_type=_cache_type(kind))
        if (ns, ids) not in self._resident:
            self._resident[(ns, ids)] = (next(self._ids), len(ids), nbytes)
            self.log.add("insert", tokens=len(ids), nbytes=nbytes, entry=self._resident[(ns, ids)][0],
                         kind=kind)
        self._sync(ns, ids, snap.cuts_anywhere)

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


def _never() -> bool:
    return False


def _cut_back_truthfully(caches: list) -> list:
    """``caches`` with every chunked cache that no longer holds its first chunk saying it cannot
    be trimmed (pitfall 11: mlx-lm's says it can, then trims only back to its chunk start). mlx-lm
    then keeps the entries before it instead of dropping them as subsumed, and answers a request
    that parts inside it with its longest shorter entry (``fetch_nearest_cache``'s own fallback)."""
    for c in caches:
        for part in getattr(c, "caches", (c,)):
            if type(part).__name__ == "ChunkedKVCache" and part.start_position > 0:
                part.is_trimmable = _never
    return caches


def _cache_type(kind: str) -> str:
    # mlx-lm's eviction order prefers dropping "assistant" (prompt+output) entries, then "user"
    return {"prompt+output": "assistant", "checkpoint": "system"}.get(kind, "user")
