"""What a router believes each instance holds, block by block: the views a cache-aware rule reads
(kvlab.cluster.routers), in plain Python, shared by the live router (kvlab.cluster.live) and the
simulator's reference replay (kvlab.cluster.reference, which the compiled kernel is tested equal to).

- ``precise``: the instances' own events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared),
  applied as they arrive.
- ``stale``: the same events applied ``delay`` seconds after they happened.
- ``approximate``: the router's own record of the full blocks it routed to each instance, evicted
  as the rule's original evicts (``RouterInfo.approximate``): LRU down to ``cap`` blocks, blocks
  unused for ``ttl`` seconds, or never.

A block is any hashable id: the simulator's dense ids, a live router's 64-bit block hashes.

Example:
    >>> v = BlockViews(2, "stale", delay=1.0)
    >>> v.stored(0.0, 1, [10, 11]); v.advance(0.5); v.match([10, 11], 2).tolist()
    [0, 0]
    >>> v.advance(1.0); v.match([10, 11], 2).tolist()
    [0, 2]
"""

from __future__ import annotations

import html
from collections import OrderedDict, deque

import numpy as np

KINDS = ("precise", "approximate", "stale")  # kvlab.cluster.kernel numbers them so


class BlockViews:
    """One view of ``n`` instances (module docstring). ``held[i]``: block -> the time it was last
    stored or routed, oldest first."""

    def __init__(self, n: int, kind: str = "precise", delay: float = 0.0, cap: int = -1, ttl: float = 0.0):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.kind, self.delay, self.cap, self.ttl = kind, float(delay), int(cap), float(ttl)
        self.held = [OrderedDict() for _ in range(n)]
        self.pending: deque = deque()  # (time, instance, block or None: all cleared, stored)

    # -- events (precise, stale) ------------------------------------------------------------------
    def stored(self, t: float, i: int, blocks) -> None:
        self.pending.extend((t, i, b, True) for b in blocks)

    def removed(self, t: float, i: int, blocks) -> None:
        self.pending.extend((t, i, b, False) for b in blocks)

    def cleared(self, t: float, i: int) -> None:
        self.pending.append((t, i, None, False))

    # -- the router's own record (approximate) ----------------------------------------------------
    def routed(self, t: float, i: int, blocks) -> None:
        """Instance ``i`` was sent a request whose full blocks are ``blocks`` (in prompt order):
        recorded last block first, so the first is the newest and is evicted last."""
        if self.kind != "approximate":
            return
        held = self.held[i]
        for b in reversed(blocks):
            held.pop(b, None)
            held[b] = t
        while self.cap >= 0 and len(held) > self.cap:
            held.popitem(last=False)

    # -- reading ----------------------------------------------------------------------------------
    def advance(self, t: float) -> None:
        """Bring the view to time ``t``: events at most ``delay`` old applied, TTL expiry."""
        while self.pending and self.pending[0][0] <= t - self.delay:
            te, i, b, stored = self.pending.popleft()
            if b is None:
                self.held[i].clear()
            elif stored:
                self.held[i][b] = te
            else:
                self.held[i].pop(b, None)
        if self.kind == "approximate" and self.ttl > 0:
            for held in self.held:
                while held and next(iter(held.values())) < t - self.ttl:
                    held.popitem(last=False)

    def match(self, blocks, h: int) -> np.ndarray:
        """Per instance, the leading run of the first ``h`` of ``blocks`` the view says it holds."""
        out = np.zeros(len(self.held), np.int64)
        for i, held in enumerate(self.held):
            k = 0
            while k < h and blocks[k] in held:
                k += 1
            out[i] = k
        return out

    def size(self, i: int) -> int:
        return len(self.held[i])

    def clear(self, i: int) -> None:
        """Forget what instance ``i`` holds now and what its pending events say (it went down)."""
        self.held[i].clear()
        self.pending = deque(e for e in self.pending if e[1] != i)

    def __repr__(self) -> str:
        what = {"stale": f"stale:{self.delay:g}", "approximate": "approximate"}.get(self.kind, self.kind)
        return f"BlockViews({what}, {len(self.held)} instances, {[len(h) for h in self.held]} blocks)"

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"
