"""What a DiskStore knows of its files without reading them: an entry per file (DiskEntry), by hash
name, their bytes, and which of them can serve a key (reads no data).

Entries whose key has a namespace (a salt or extra keys) serve only as a whole prefix, found by the
digest of the request's prefix of their length; plain entries keep their ids and serve their
longest common prefix with a request, as far as the request's own namespace is empty.

Example:
    >>> index = DiskIndex()
    >>> index.add(DiskEntry("f00", Path("f00.safetensors"), 40, 4096, 0, as_ids(range(40))))
    >>> [(reuse, shared) for reuse, shared, _ in index.candidates(CacheKey(tuple(range(50))), 49)]
    [(40, 40)]
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..keys import CacheKey
from ..primitives.units import fmt_bytes
from .disk_files import as_ids

__all__ = ["DiskEntry", "DiskIndex"]


@dataclass(eq=False)
class DiskEntry:
    """One indexed file: hash name, path, tokens, bytes on disk, recency (mtime, ns), and for
    entries whose key has no namespace (``plain``) their ids (int64 [tokens]) for LCP lookups."""

    name: str
    path: Path
    tokens: int
    nbytes: int
    mtime_ns: int
    ids: np.ndarray | None = None
    hits: int = 0

    def __repr__(self) -> str:
        return f"DiskEntry({self.name[:12]}, {self.tokens} tokens, {fmt_bytes(self.nbytes)})"

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"


class DiskIndex:
    """Entries by hash name, the bytes they hold, and how many namespaced entries have each length
    (the lengths a lookup tries by digest)."""

    def __init__(self):
        self.by_name: dict[str, DiskEntry] = {}
        self.lengths: dict[int, int] = {}  # tokens -> count, of entries with a namespace
        self.nbytes = 0

    def add(self, e: DiskEntry) -> None:
        self.by_name[e.name] = e
        if e.ids is None:
            self.lengths[e.tokens] = self.lengths.get(e.tokens, 0) + 1
        self.nbytes += e.nbytes

    def remove(self, e: DiskEntry) -> None:
        del self.by_name[e.name]
        if e.ids is None:
            self.lengths[e.tokens] -= 1
            if not self.lengths[e.tokens]:
                del self.lengths[e.tokens]
        self.nbytes -= e.nbytes

    def get(self, name: str) -> DiskEntry | None:
        return self.by_name.get(name)

    def __getitem__(self, name: str) -> DiskEntry:
        return self.by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def __len__(self) -> int:
        return len(self.by_name)

    def values(self):
        return self.by_name.values()

    def candidates(self, key: CacheKey, limit: int) -> list[tuple[int, int, DiskEntry]]:
        """(reusable tokens, shared tokens, entry) for the entries that can serve ``key`` (at most
        ``limit`` tokens), most reusable first, then most recent."""
        found = {}
        for n in self.lengths:  # entries with a namespace: only as a whole prefix, by name
            e = self.by_name.get(key.digest(n)) if n <= limit or n == len(key) else None
            if e is not None:
                found[e.name] = (min(n, limit), n, e)
        # plain entries share KV up to their common prefix, while the request's namespace is empty
        free = 0 if key.salt is not None else min((s[0] for s in key.extra_keys), default=len(key))
        q = as_ids(key.ids[:free])
        for e in self.by_name.values():
            if e.ids is not None and free:
                m = min(len(e.ids), len(q))
                diff = np.flatnonzero(e.ids[:m] != q[:m])
                shared = int(diff[0]) if len(diff) else m
                if min(shared, limit) > 0:
                    found[e.name] = (min(shared, limit), shared, e)
        return sorted(found.values(), key=lambda c: (-c[0], -c[2].mtime_ns))

    def __repr__(self) -> str:
        return f"DiskIndex({len(self.by_name)} files, {fmt_bytes(self.nbytes)})"
