"""The policy interface: what a cache tells its eviction policy, and what it asks.

A cache (the simulator's block cache, RadixStore, PagedStore) keeps *evictable units*: a block
of a chained-hash prefix cache, or a radix-tree entry. It reports three events and asks one
question:

- ``access(unit)``: the unit was used. A unit the policy does not hold becomes resident
  (an insertion); one it holds is a hit. ``unit`` carries what a policy may weigh: ``size``
  (in the cache's capacity units: blocks in the simulator, bytes in RadixStore), ``depth``
  (position of the unit's first token), ``tokens``, ``parent`` (the unit it extends, for
  chained blocks), ``priority`` and, for the offline optimum only, ``next_use``.
- ``remove(key)``: the cache dropped the unit for its own reasons (subsumed, replaced).
- ``victim(evictable=None) -> key``: choose the next unit to evict and forget it. ``evictable``
  (a predicate on keys) excludes units the cache cannot drop now: PagedStore's blocks held by
  the running request, RadixStore's entry being inserted.

Capacity is set at construction in the same units as ``size`` (``None``: unbounded); the cache
decides *when* to evict (the simulator: after each request, down to capacity), the policy only
*what*. Every policy breaks ties by a per-access clock, so a replay is deterministic.

A new store plugs in the same way: make its units (a radix tree whose nodes own their edge's KV:
key = node, size = the edge's bytes, depth = the edge's first position, tokens = edge length,
parent = the parent node), call ``access`` once per request that uses a unit and ``remove``
when it drops one itself, and evict with ``victim(evictable)`` where ``evictable`` says which
units may go now (leaves not locked by a running request). ``store_policy`` refuses offline
policies; ``Policy.name`` is the eviction reason to log.

Example:
    >>> p = kv.policies.make_policy("lru", capacity=2)
    >>> for k in "aba": p.access(Unit(k))
    >>> p.victim()
    'b'
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable

from ..errors import BudgetError, KvlabError
from ..primitives.display import summary_html

NEVER = 1 << 62  # a next use that never comes (belady)


@dataclass(frozen=True, slots=True)
class Unit:
    """One evictable unit as a policy sees it (see the module docstring for each field).

    Example:
        >>> Unit(7, depth=512, tokens=512, parent=3)
        Unit(7, size=1, depth=512, tokens=512)
    """

    key: Hashable
    size: int = 1
    depth: int = 0
    tokens: int = 1
    parent: Hashable | None = None
    priority: int = 0
    next_use: int = NEVER

    def __repr__(self) -> str:
        return f"Unit({self.key!r}, size={self.size}, depth={self.depth}, tokens={self.tokens})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def _always(key) -> bool:
    return True


class Policy:
    """Base class: residency, sizes and the access clock; subclasses say what to keep.

    Subclasses implement ``_insert(unit)``, ``_hit(unit)``, ``_pick(ok) -> key`` (choose a
    victim among keys with ``ok(key)``, forget it, may update history such as ghost lists) and
    ``_forget(key)`` (drop without history).
    """

    name = ""
    offline = False  # True: needs the future (next_use); only the simulator can run it

    def __init__(self, capacity: int | None = None):
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                     or capacity < 0):
            raise BudgetError(f"{self.name}: capacity must be an int >= 0 or None, got {capacity!r}")
        self.capacity = capacity
        self.size = 0        # total size of resident units
        self.clock = 0       # one tick per access
        self._sizes: dict = {}

    # -- events -------------------------------------------------------------------------------
    def access(self, unit: Unit) -> None:
        """The cache used ``unit``: a hit if resident, else an insertion."""
        self.clock += 1
        if unit.key in self._sizes:
            self._hit(unit)
        else:
            self._sizes[unit.key] = unit.size
            self.size += unit.size
            self._insert(unit)

    def victim(self, evictable: Callable | None = None):
        """The key to evict next (forgotten here; the cache drops the unit)."""
        ok = evictable or _always
        if not self._sizes or (evictable is not None and not any(map(ok, self._sizes))):
            raise BudgetError(f"{self.name}: nothing evictable ({len(self._sizes)} units resident, "
                              "all held by the cache)")
        key = self._pick(ok)
        self.size -= self._sizes.pop(key)
        return key

    def remove(self, key) -> None:
        """The cache dropped ``key`` itself (not to make room): forget it, keep no history."""
        if key in self._sizes:
            self._forget(key)
            self.size -= self._sizes.pop(key)

    def __contains__(self, key) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def __repr__(self) -> str:
        cap = "unbounded" if self.capacity is None else f"{self.capacity:,}"
        return f"{type(self).__name__}({len(self)} units, size {self.size:,} of {cap})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)

    # -- subclass hooks ---------------------------------------------------------------------------
    def _insert(self, unit: Unit) -> None:
        raise NotImplementedError

    def _hit(self, unit: Unit) -> None:
        raise NotImplementedError

    def _pick(self, ok: Callable):
        raise NotImplementedError

    def _forget(self, key) -> None:
        raise NotImplementedError


class Scored(Policy):
    """Evict the lowest score first, then the lowest ``_rank``, then the least recently used: a
    score per resident unit, set by ``_start`` when it becomes resident and by ``_again`` on each
    hit, forgotten when it leaves (lfu counts uses, priority keeps the highest level)."""

    def __init__(self, capacity=None):
        super().__init__(capacity)
        self.score: dict = {}
        self.heap = LazyHeap()

    def _start(self, unit: Unit):
        raise NotImplementedError

    def _again(self, score, unit: Unit):
        raise NotImplementedError

    def _rank(self, unit: Unit) -> int:
        return 0

    def _insert(self, unit: Unit) -> None:
        self.score[unit.key] = self._start(unit)
        self.heap.push(self.score[unit.key], self._rank(unit), self.clock, unit.key)

    def _hit(self, unit: Unit) -> None:
        self.score[unit.key] = self._again(self.score[unit.key], unit)
        self.heap.push(self.score[unit.key], self._rank(unit), self.clock, unit.key)

    def _pick(self, ok):
        key = self.heap.pop(ok)
        del self.score[key]
        return key

    def _forget(self, key) -> None:
        self.heap.drop(key)
        del self.score[key]


def first(order: OrderedDict, ok: Callable):
    """The oldest key of ``order`` with ``ok(key)``, or None."""
    for k in order:
        if ok(k):
            return k
    return None


class LazyHeap:
    """A min-heap of ``(k1, k2, stamp, key)`` where only the newest push of each key counts.

    ``version[key]`` is the stamp of a key's live entry; older entries are skipped when popped.
    ``valid(key)`` adds a policy's own condition (cost_aware: the unit is a leaf); entries that
    are live but fail ``ok`` (held by the cache right now) are put back after the pop.
    """

    def __init__(self):
        self.heap: list = []
        self.version: dict = {}

    def push(self, k1, k2, stamp: int, key) -> None:
        self.version[key] = stamp
        heapq.heappush(self.heap, (k1, k2, stamp, key))

    def drop(self, key) -> None:
        self.version.pop(key, None)

    def pop(self, ok: Callable, valid: Callable = _always):
        held = []
        try:
            while self.heap:
                entry = heapq.heappop(self.heap)
                key = entry[3]
                if self.version.get(key) != entry[2] or not valid(key):
                    continue
                if ok(key):
                    del self.version[key]
                    return key
                held.append(entry)
            raise KvlabError("policy heap is empty while units are resident (a kvlab bug)")
        finally:
            for entry in held:
                heapq.heappush(self.heap, entry)
