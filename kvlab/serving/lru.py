"""ObservedLRU: mlx-lm's own ``LRUPromptCache``, unchanged, with every call recorded as events.

``--store mlx-lru`` serves through exactly what ``mlx_lm.server`` runs (its trie, its deep copy
on every hit, its eviction order by cache type, ``--prompt-cache-bytes`` via ``trim_to``): each
call is passed straight through and its outcome written down, so plain mlx-lm is a row in every
comparison. mlx-lm reports neither which branch a lookup took nor what an insert evicted; the
trie's read-only ``search`` gives the first, and comparing resident keys before and after each
call gives the second.

Example:
    >>> lru = ObservedLRU(LRUPromptCache(10), ServerEvents())
    >>> ResponseGenerator(provider, lru)
"""

from __future__ import annotations

import html
import itertools
import time

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache

from .adapter import Attribution
from .events import ServerEvents


class ObservedLRU(Attribution):
    """A recording pass-through over ``mlx_lm.models.cache.LRUPromptCache`` (module docstring)."""

    name = "mlx-lru"

    def __init__(self, cache: LRUPromptCache, events: ServerEvents, *, budget_bytes: int | None = None):
        super().__init__(events)
        self.cache = cache
        self.store = self  # what the server shows as its store
        self.budget_bytes = budget_bytes
        self.max_size = cache.max_size
        self._resident: dict[tuple, tuple[int, int, int, str]] = {}  # key -> (id, tokens, bytes, type)
        self._ids = itertools.count(1)
        self.evictions = 0
        self.peak_bytes = 0
        self.over_after_trim = 0  # trim_to calls that left more bytes than asked

    # -- mlx-lm's interface, passed through -------------------------------------------------------
    def fetch_nearest_cache(self, model_key, tokens):
        with self.lock:
            rid, start = self.current, time.perf_counter()
            found = self.cache._trie.search(model_key, tokens)  # read-only: which branch mlx-lm takes
            cache, rest = self.cache.fetch_nearest_cache(model_key, tokens)
            reused = len(tokens) - len(rest) if cache is not None else 0
            kind, entry = "miss", None
            # mlx-lm can hand back a cache trimmed to 0 tokens (a longer entry sharing nothing
            # usable, e.g. a one-token prompt): that is a miss, with no entry to name
            if cache is not None and reused > 0:
                if found.exact is not None:
                    kind, key = "exact", found.exact
                elif found.longer is not None and reused > (len(found.shorter) if found.shorter else 0):
                    kind, key = ("supersequence" if found.common_prefix >= len(tokens) else "lcp"), found.longer
                else:
                    kind, key = "prefix", found.shorter
                entry = self._resident.get((found.model, tuple(key)), (None,))[0]
            self.lookups += 1
            self.hits += reused > 0
            self.reused_tokens += reused
            self.events.add("lookup", request=rid, tokens=len(tokens), detail=kind)
            self.events.add("hit" if reused else "miss", request=rid, tokens=reused, entry=entry, detail=kind)
            if rid is not None:
                self.requests[rid] = {"kind": kind, "entry": entry, "why": "",
                                      "lookup_s": time.perf_counter() - start}
            return cache, rest

    def insert_cache(self, model_key, tokens, prompt_cache, *, cache_type: str = "assistant"):
        with self.lock:
            rid = self.owner(tokens, cache_type)
            self.events.add("offer", request=rid, tokens=len(tokens), detail=cache_type, segment=cache_type)
            key = (model_key, tuple(tokens))
            before = self._resident.get(key)
            self.cache.insert_cache(model_key, tokens, prompt_cache, cache_type=cache_type)
            nbytes = sum(c.nbytes for c in prompt_cache)  # what LRUPromptCache counts
            if before is not None:
                self.events.add("evict", request=rid, tokens=before[1], nbytes=before[2], entry=before[0],
                                detail="replaced", segment=before[3])
            entry = next(self._ids)
            self._resident[key] = (entry, len(tokens), nbytes, cache_type)
            self.events.add("insert", request=rid, tokens=len(tokens), nbytes=nbytes, entry=entry,
                            detail=cache_type, segment=cache_type)
            self._sync(rid, key if can_trim_prompt_cache(prompt_cache) else None, "lru")

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        with self.lock:
            self.cache.trim_to(n_sequences=n_sequences, n_bytes=n_bytes)
            self._sync(None, None, "trim_to")
            if n_bytes is not None and self.cache.nbytes > max(0, n_bytes):
                self.over_after_trim += 1

    @property
    def nbytes(self) -> int:
        with self.lock:
            return self.cache.nbytes

    def __len__(self) -> int:
        with self.lock:
            return len(self.cache)

    @property
    def entries(self) -> int:
        return len(self)

    def stats_by_type(self) -> dict:
        with self.lock:
            return self.cache.stats_by_type()

    # -- internals --------------------------------------------------------------------------------
    def _sync(self, rid, inserted, reason: str) -> None:
        """Record the entries mlx-lm dropped during the last call (it does not report them)."""
        for key in list(self._resident):
            if self._present(key):
                continue
            entry, tokens, nbytes, segment = self._resident.pop(key)
            subsumed = (inserted is not None and key[0] == inserted[0]
                        and inserted[1][: len(key[1])] == key[1])
            self.evictions += not subsumed
            if not subsumed:
                self.count_eviction(rid)
            self.events.add("evict", request=rid, tokens=tokens, nbytes=nbytes, entry=entry,
                            detail="subsumed" if subsumed else reason, segment=segment)
        self.peak_bytes = max(self.peak_bytes, self.cache.nbytes)

    def _present(self, key) -> bool:
        try:
            self.cache._trie.get(key[0], list(key[1]))
            return True
        except KeyError:
            return False

    def invariants(self) -> dict:
        """As StoreAdapter.invariants: bytes equal the sum of the entries, no request still
        registered, and the budget kept as mlx-lm defines it: ``--prompt-cache-bytes`` is checked
        by ``trim_to(n_bytes=budget - running batch)`` when a request is admitted, so inserts may
        exceed it until the next admission (``peak_bytes`` shows by how much); what must hold is
        that every ``trim_to`` left at most the bytes it was asked for."""
        with self.lock:
            listed = sum(v[2] for v in self._resident.values())
            held = self.cache.nbytes
            within = self.over_after_trim == 0
            return {"bytes": held, "entries_bytes": listed, "bytes_match": listed == held,
                    "peak_bytes": self.peak_bytes, "budget_bytes": self.budget_bytes,
                    "within_budget": within, "inflight": sorted(self.inflight), "referenced_blocks": 0,
                    "ok": listed == held and within and not self.inflight}

    def __repr__(self) -> str:
        return (f"ObservedLRU(mlx-lm LRUPromptCache: {len(self)} of {self.max_size} entries, "
                f"{self.nbytes} B, {self.evictions} evictions)")

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{e}</td><td>{t}</td><td>{b}</td><td>{s}</td></tr>"
                       for e, t, b, s in sorted(self._resident.values()))
        return (f"<div><b>ObservedLRU</b> {html.escape(repr(self))}<table><tr><th>entry</th>"
                f"<th>tokens</th><th>bytes</th><th>type</th></tr>{rows}</table></div>")
