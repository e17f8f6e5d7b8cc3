"""Belady's offline optimum (MIN) for a forced-insertion prefix cache."""

from __future__ import annotations

from .base import LazyHeap, Policy, Unit


class Belady(Policy):
    """Evict the unit whose next hittable use is farthest (``Unit.next_use``: the index of the
    next request that accesses it, when that request can hit it, i.e. holds it within its first
    n-1 tokens; NEVER when the next access cannot hit it, since that access re-inserts the
    block anyway, or when there is none); ties: the deeper unit first, so a block's descendants
    go before it; then least recently used. Offline: only a replay knows next uses, so stores
    refuse it.

    Why this is the optimum under kvlab's simulator semantics (every full block of a request is
    inserted anyway, then the cache evicts down to capacity; a request hits the leading run of
    resident blocks): keeping a block pays only at its next access, and only if that access can
    hit it, so this is Belady's MIN over the hits that keeping can win; with chained blocks a
    child's hittable uses are among its parent's, so ties evict descendants first. Taking "next
    hittable use" literally (skipping a next access that cannot hit) is not optimal: a pinned
    counterexample and an exhaustive search over small traces are in tests/unit/test_belady.py,
    and a property test checks that no policy beats it on traces from the workload generators.
    """

    name = "belady"
    offline = True

    def __init__(self, capacity=None):
        super().__init__(capacity)
        self.heap = LazyHeap()

    def _insert(self, unit: Unit) -> None:
        self.heap.push(-unit.next_use, -unit.depth, self.clock, unit.key)

    _hit = _insert

    def _pick(self, ok):
        return self.heap.pop(ok)

    def _forget(self, key) -> None:
        self.heap.drop(key)
