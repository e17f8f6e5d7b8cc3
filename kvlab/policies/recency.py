"""Recency policies: LRU, FIFO and segmented LRU (SLRU)."""

from __future__ import annotations

from collections import OrderedDict

from .base import Policy, Unit, first


class LRU(Policy):
    """Evict the least recently used unit (vLLM's free-block queue, SGLang's default)."""

    name = "lru"

    def __init__(self, capacity=None):
        super().__init__(capacity)
        self.order: OrderedDict = OrderedDict()  # least recent first

    def _insert(self, unit: Unit) -> None:
        self.order[unit.key] = None

    def _hit(self, unit: Unit) -> None:
        self.order.move_to_end(unit.key)

    def _pick(self, ok):
        key = first(self.order, ok)
        del self.order[key]
        return key

    def _forget(self, key) -> None:
        del self.order[key]


class FIFO(LRU):
    """Evict the longest resident unit; hits do not refresh."""

    name = "fifo"

    def _hit(self, unit: Unit) -> None:
        pass


class SLRU(Policy):
    """Segmented LRU: new units enter a probationary LRU segment; a hit there promotes the unit
    to a protected LRU segment of at most ``protected_percent`` of capacity, whose overflow is
    demoted back to probation's most recent end. Victims come from probation first."""

    name = "slru"

    def __init__(self, capacity=None, *, protected_percent: int = 80):
        super().__init__(capacity)
        self.protected_cap = None if capacity is None else capacity * protected_percent // 100
        self.probation: OrderedDict = OrderedDict()  # key -> size, least recent first
        self.protected: OrderedDict = OrderedDict()
        self.protected_size = 0

    def _insert(self, unit: Unit) -> None:
        self.probation[unit.key] = unit.size

    def _hit(self, unit: Unit) -> None:
        k = unit.key
        if k in self.protected:
            self.protected.move_to_end(k)
            return
        self.protected[k] = self.probation.pop(k)
        self.protected_size += self.protected[k]
        while self.protected_cap is not None and self.protected_size > self.protected_cap:
            old, size = self.protected.popitem(last=False)
            self.protected_size -= size
            self.probation[old] = size

    def _pick(self, ok):
        key = first(self.probation, ok)
        if key is not None:
            del self.probation[key]
            return key
        key = first(self.protected, ok)
        self.protected_size -= self.protected.pop(key)
        return key

    def _forget(self, key) -> None:
        if key in self.probation:
            del self.probation[key]
        else:
            self.protected_size -= self.protected.pop(key)
