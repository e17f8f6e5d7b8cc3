"""Policies that weigh units: by priority (pinning) and by the prefill compute a hit saves."""

from __future__ import annotations

from .base import LazyHeap, Policy, Scored, Unit

PINNED = 1 << 40  # priority of a pinned unit: it goes only when nothing unpinned is left
LINEAR_TOKENS = 16384  # per-token linear work in units of one attention step (see recompute_cost)
# priority of a store entry by its insert kind (stores pass it to Unit.priority)
KIND_PRIORITY = {"system": 1}


def recompute_cost(depth: int, tokens: int, linear: int = LINEAR_TOKENS) -> int:
    """Prefill work to recompute ``tokens`` tokens starting at position ``depth``.

    A token at position p costs ``linear + p``: the projections and MLP (``linear``, about
    ``parameters / (2 * layers * d_model)`` attention steps: ~4k for SmolLM2-135M, ~19k for a
    1B model, ~30k for an 8B one) plus attention over the p tokens before it. So deeper tokens
    cost more, and a block's cost grows with its position.

    Example:
        >>> recompute_cost(0, 4, linear=10), recompute_cost(512, 4, linear=10)
        (46, 2094)
    """
    return tokens * linear + tokens * depth + tokens * (tokens - 1) // 2


class Priority(Scored):
    """Evict the lowest priority first, least recently used among equals (SGLang's
    PriorityStrategy). A unit's priority is the highest of the requests that used it while
    resident (``Unit.priority``: in the simulator a trace's ``priority`` column or
    ``priorities=``, one int per request; in the stores ``KIND_PRIORITY`` of the insert kind).
    Pinning: a request of priority ``PINNED`` pins its units, and ``pin_tokens`` pins the units
    within every prompt's first ``pin_tokens`` tokens (its system prompt, whichever it is).
    Pinned units go only when every resident unit is pinned (a cache that must insert a request
    has to drop something)."""

    name = "priority"

    def __init__(self, capacity=None, *, pin_tokens: int = 0):
        super().__init__(capacity)
        self.pin_tokens = pin_tokens

    def _start(self, unit: Unit) -> int:
        return PINNED if unit.depth + unit.tokens <= self.pin_tokens else unit.priority

    def _again(self, level: int, unit: Unit) -> int:
        return max(level, self._start(unit))


class CostAware(Policy):
    """Evict what saves the least prefill compute per unit of size: GreedyDual-Size-Frequency
    (Cao & Irani 1997; Marconi's FLOP-aware eviction) with H = L + hits x recompute_cost / size,
    L = the H of the last victim (so old values age out). Only leaves go: a unit another
    resident unit extends (its ``parent``) stays until that child has left, because a chained
    prefix cache cannot use a child without its parent (SGLang and Marconi evict leaves only)."""

    name = "cost_aware"

    def __init__(self, capacity=None, *, linear: int = LINEAR_TOKENS):
        super().__init__(capacity)
        self.linear = linear
        self.inflation = 0.0
        self.hits: dict = {}
        self.h: dict = {}
        self.stamp: dict = {}
        self.parent: dict = {}
        self.children: dict = {}  # key -> resident units whose parent it is
        self.heap = LazyHeap()

    def _price(self, unit: Unit) -> None:
        k = unit.key
        self.h[k] = self.inflation + self.hits[k] * (recompute_cost(unit.depth, unit.tokens, self.linear)
                                                     / unit.size)
        self.stamp[k] = self.clock
        self.heap.push(self.h[k], 0, self.clock, k)

    def _insert(self, unit: Unit) -> None:
        self.hits[unit.key] = 1
        self.parent[unit.key] = unit.parent
        if unit.parent is not None:
            self.children[unit.parent] = self.children.get(unit.parent, 0) + 1
        self._price(unit)

    def _hit(self, unit: Unit) -> None:
        self.hits[unit.key] += 1
        self._price(unit)

    def _pick(self, ok):
        key = self.heap.pop(ok, valid=lambda k: not self.children.get(k))
        self.inflation = self.h[key]
        self._release(key)
        return key

    def _forget(self, key) -> None:
        self.heap.drop(key)
        self._release(key)

    def _release(self, key) -> None:
        del self.hits[key], self.h[key], self.stamp[key]
        p = self.parent.pop(key)
        if p is not None:
            self.children[p] -= 1
            if not self.children[p]:
                del self.children[p]
                if p in self.h:  # the parent is resident and now a leaf: a candidate again
                    self.heap.push(self.h[p], 0, self.stamp[p], p)
