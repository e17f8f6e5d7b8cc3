"""Frequency policies: LFU, Mooncake's length-aware LFU, and TinyLFU admission in front of LRU."""

from __future__ import annotations

from collections import OrderedDict

from .base import Policy, Scored, Unit, first


class LFU(Scored):
    """Evict the least often used unit; ties: least recently used. A unit's count starts at 1
    when it becomes resident and is forgotten when it leaves (SGLang's LFUStrategy)."""

    name = "lfu"

    def _start(self, unit: Unit) -> int:
        return 1

    def _again(self, count: int, unit: Unit) -> int:
        return count + 1


class LengthAware(LFU):
    """Mooncake's LengthAwareCache: like LFU, but among equally used units the one occurring
    later in its request (deeper) goes first; then least recently used."""

    name = "length_aware"

    def _rank(self, unit: Unit) -> int:
        return -unit.depth


class TinyLFU(Policy):
    """TinyLFU admission in front of LRU. Every access counts toward a key's frequency (kept for
    evicted keys too, halved each time ``sample_factor`` x capacity worth of accesses has been
    seen; exact counts stand in for the count-min sketch). A new unit waits on probation until it
    is hit (then admitted) or must compete: the least recent probationary unit is admitted, and
    the main LRU's victim evicted, only if its frequency is higher; otherwise it is rejected."""

    name = "tinylfu"

    def __init__(self, capacity=None, *, sample_factor: int = 10):
        super().__init__(capacity)
        self.probation: OrderedDict = OrderedDict()  # least recent first
        self.main: OrderedDict = OrderedDict()
        self.counts: dict = {}  # key -> (count, epoch it was last written in)
        self.epoch = 0
        self.sampled = 0
        self.sample = None if capacity is None else sample_factor * capacity

    def freq(self, key) -> int:
        """The aged access count: halved once per epoch since it was last written."""
        count, epoch = self.counts.get(key, (0, self.epoch))
        return count >> (self.epoch - epoch)

    def _count(self, unit: Unit) -> None:
        self.counts[unit.key] = (self.freq(unit.key) + 1, self.epoch)
        if self.sample is not None:
            self.sampled += unit.size
            if self.sampled >= self.sample:
                self.epoch += 1
                self.sampled = 0

    def _insert(self, unit: Unit) -> None:
        self._count(unit)
        self.probation[unit.key] = None

    def _hit(self, unit: Unit) -> None:
        self._count(unit)
        if unit.key in self.main:
            self.main.move_to_end(unit.key)
        else:
            del self.probation[unit.key]
            self.main[unit.key] = None

    def _pick(self, ok):
        cand, old = first(self.probation, ok), first(self.main, ok)
        if old is not None and (cand is None or self.freq(cand) > self.freq(old)):
            if cand is not None:
                del self.probation[cand]
                self.main[cand] = None
            del self.main[old]
            return old
        del self.probation[cand]
        return cand

    def _forget(self, key) -> None:
        (self.main if key in self.main else self.probation).pop(key)
