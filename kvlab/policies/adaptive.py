"""Adaptive policies with ghost history: ARC and S3-FIFO."""

from __future__ import annotations

from collections import OrderedDict

from .base import Policy, Unit, first


class ARC(Policy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03). T1 holds units seen once, T2 units
    seen again; ghosts B1/B2 remember what each evicted. A ghost hit in B1 grows T1's target ``p``
    by ``size * max(1, |B2| // |B1|)``, one in B2 shrinks it likewise. The victim is T1's least
    recent unit when ``size(T1) > p`` (or T2 is empty), else T2's; it joins B1 or B2. Ghost lists
    are then trimmed: ``size(T1 + B1) <= capacity`` and ``size(T1 + T2 + B1 + B2) <= 2 * capacity``.
    (Eviction happens after a request's insertions, so the "x in B2" tie rule of the original
    REPLACE has no x and is dropped.)"""

    name = "arc"

    def __init__(self, capacity=None):
        super().__init__(capacity)
        self.t1, self.t2, self.b1, self.b2 = (OrderedDict() for _ in range(4))  # key -> size
        self.sz = {"t1": 0, "t2": 0, "b1": 0, "b2": 0}
        self.p = 0

    def _move(self, key, src: str | None, dst: str, size: int) -> None:
        if src is not None:
            del getattr(self, src)[key]
            self.sz[src] -= size
        getattr(self, dst)[key] = size
        self.sz[dst] += size

    def _insert(self, unit: Unit) -> None:
        k, c = unit.key, self.capacity
        if k in self.b1:
            self.p = min(c, self.p + unit.size * max(1, len(self.b2) // len(self.b1)))
            self._move(k, "b1", "t2", unit.size)
        elif k in self.b2:
            self.p = max(0, self.p - unit.size * max(1, len(self.b1) // len(self.b2)))
            self._move(k, "b2", "t2", unit.size)
        else:
            self._move(k, None, "t1", unit.size)

    def _hit(self, unit: Unit) -> None:
        if unit.key in self.t1:
            self._move(unit.key, "t1", "t2", self.t1[unit.key])
        else:
            self.t2.move_to_end(unit.key)

    def _pick(self, ok):
        a, b = first(self.t1, ok), first(self.t2, ok)
        if a is not None and (b is None or self.sz["t1"] > self.p):
            key, src, dst = a, "t1", "b1"
        else:
            key, src, dst = b, "t2", "b2"
        self._move(key, src, dst, getattr(self, src)[key])
        c = self.capacity
        if c is not None:
            while self.b1 and self.sz["t1"] + self.sz["b1"] > c:
                self.sz["b1"] -= self.b1.popitem(last=False)[1]
            while self.b2 and sum(self.sz.values()) > 2 * c:
                self.sz["b2"] -= self.b2.popitem(last=False)[1]
        return key

    def _forget(self, key) -> None:
        src = "t1" if key in self.t1 else "t2"
        self.sz[src] -= getattr(self, src).pop(key)


class S3FIFO(Policy):
    """S3-FIFO (Yang et al., SOSP'23): a small FIFO (``small_percent`` of capacity), a main FIFO
    and a ghost FIFO of keys evicted from small (as large as main's share). New units enter small,
    or main if their key is a ghost. Hits raise a 2-bit count (max 3). Evicting: while small
    holds at least its share (or main is empty), small's oldest unit moves to main if it was hit
    (count reset) or is evicted into the ghost; otherwise main's oldest is reinserted with its
    count decremented while it is > 0, or evicted (libCacheSim's move-to-main threshold 1)."""

    name = "s3fifo"

    def __init__(self, capacity=None, *, small_percent: int = 10):
        super().__init__(capacity)
        self.small_percent = small_percent
        self.small, self.main, self.ghost = OrderedDict(), OrderedDict(), OrderedDict()  # key -> size
        self.small_size = self.ghost_size = 0
        self.freq: dict = {}
        self.ghost_cap = None if capacity is None else capacity - capacity * small_percent // 100

    def _insert(self, unit: Unit) -> None:
        k = unit.key
        self.freq[k] = 0
        if k in self.ghost:
            self.ghost_size -= self.ghost.pop(k)
            self.main[k] = unit.size
        else:
            self.small[k] = unit.size
            self.small_size += unit.size

    def _hit(self, unit: Unit) -> None:
        self.freq[unit.key] = min(self.freq[unit.key] + 1, 3)

    def _pick(self, ok):
        c = self.capacity or 0
        while True:
            s, m = first(self.small, ok), first(self.main, ok)
            if s is not None and (m is None or 100 * self.small_size >= self.small_percent * c):
                size = self.small.pop(s)
                self.small_size -= size
                if self.freq[s] >= 1:
                    self.freq[s] = 0
                    self.main[s] = size
                    continue
                del self.freq[s]
                self.ghost[s] = size
                self.ghost_size += size
                while self.ghost_cap is not None and self.ghost_size > self.ghost_cap:
                    self.ghost_size -= self.ghost.popitem(last=False)[1]
                return s
            if self.freq[m] > 0:
                self.freq[m] -= 1
                self.main.move_to_end(m)
                continue
            del self.main[m]
            del self.freq[m]
            return m

    def _forget(self, key) -> None:
        del self.freq[key]
        if key in self.small:
            self.small_size -= self.small.pop(key)
        else:
            del self.main[key]
