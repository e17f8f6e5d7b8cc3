"""The ceiling in one pass: belady's hits at every capacity of a sweep at once.

Why one pass suffices. Belady ranks blocks by a key no capacity changes (next hittable use, then
depth, then age), so a cache of C blocks always holds a subset of what C + 1 holds: it is a stack
algorithm, like LRU. A block whose next access cannot hit is always the first victim, so it never
displaces one that can, and only *reuse intervals* matter: a block accessed by request a and next
hit by request e is kept iff it survives the evictions after requests a .. e-1. Taken in belady's
order (by e, then depth, then age), a later interval never displaces a kept one, so C slots keep
an interval iff one of them is free before a; it takes the one freed latest (best fit), busy until
e - 1 from then on (OPTgen's occupancy test, Jain and Lin 2016, for one capacity).

All capacities share their slots: cache C's free-from steps are cache C-1's plus one more. Level k
holds the steps of the ``caps[k] - caps[k-1]`` slots that capacity adds, as counts per step with a
bitset and its summary (``_latest``: the latest free step below a in a few word operations). The
intervals a request hits that start at the same request (it reuses that request's prefix: about 40
per run on the Mooncake trace) are kept together: level by level, the run takes the steps freed
latest before a and carries the latest it has seen; a step of a deeper level later than the
run's earliest is swapped with it (the carry of Mattson's algorithm). Equal to the per-capacity
replay (kernels_heap) on every trace: tests/unit/test_belady.py.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros

from .kernels_common import NEVER as UNBOUNDED  # a capacity without bound; also an empty level's min
ONE = np.uint64(1)
ALL = ~np.uint64(0)


@numba.njit(cache=True)
def _lowest(bits, summ, k):
    for sw in range(summ.shape[1]):
        if summ[k, sw] != 0:
            w = (sw << 6) + np.int64(trailing_zeros(summ[k, sw]))
            return (w << 6) + np.int64(trailing_zeros(bits[k, w]))
    return UNBOUNDED


@numba.njit(cache=True)
def _add(cnt, bits, summ, mins, k, v, n):
    """n more slots of level k free from step v."""
    if cnt[k, v] == 0:
        w = v >> 6
        if bits[k, w] == 0:
            summ[k, w >> 6] |= ONE << np.uint64(w & 63)
        bits[k, w] |= ONE << np.uint64(v & 63)
        mins[k] = min(mins[k], v)
    cnt[k, v] += n


@numba.njit(cache=True)
def _remove(cnt, bits, summ, mins, k, v, n):
    cnt[k, v] -= n
    if cnt[k, v] == 0:
        w = v >> 6
        bits[k, w] &= ~(ONE << np.uint64(v & 63))
        if bits[k, w] == 0:
            summ[k, w >> 6] &= ~(ONE << np.uint64(w & 63))
        if v == mins[k]:
            mins[k] = _lowest(bits, summ, k)


@numba.njit(cache=True)
def _latest(bits, summ, k, a, lo):
    """The latest step v with free slots at level k and lo < v < a (-1: none)."""
    v = a - 1
    if v <= lo:
        return -1
    w, wl = v >> 6, (lo + 1) >> 6
    x = bits[k, w] & (ALL >> np.uint64(63 - (v & 63)))
    if w == wl:
        x &= ALL << np.uint64((lo + 1) & 63)
        return (w << 6) + 63 - np.int64(leading_zeros(x)) if x != 0 else -1
    if x != 0:
        return (w << 6) + 63 - np.int64(leading_zeros(x))
    u = w - 1
    while u > wl:  # whole words between, through the summary
        sw = u >> 6
        s = summ[k, sw] & (ALL >> np.uint64(63 - (u & 63)))
        if s != 0:
            top = (sw << 6) + 63 - np.int64(leading_zeros(s))
            if top > wl:
                return (top << 6) + 63 - np.int64(leading_zeros(bits[k, top]))
            break
        u = (sw << 6) - 1
    x = bits[k, wl] & (ALL << np.uint64((lo + 1) & 63))
    return (wl << 6) + 63 - np.int64(leading_zeros(x)) if x != 0 else -1


@numba.njit(cache=True)
def _carry_insert(qv, qc, qn, v, c):
    """c more of step v in the carry (distinct steps ascending in qv[:qn], counts in qc)."""
    i = qn
    while i > 0 and qv[i - 1] > v:
        i -= 1
    if i > 0 and qv[i - 1] == v:
        qc[i - 1] += c
        return qn
    for j in range(qn, i, -1):
        qv[j], qc[j] = qv[j - 1], qc[j - 1]
    qv[i], qc[i] = v, c
    return qn + 1


@numba.njit(cache=True)
def _keep_run(cnt, bits, summ, mins, n_levels, a, f, m, qv, qc, level, order, t0):
    """Keep the m intervals order[t0:t0 + m] (all from step a - 1 to f - 1) at every level they
    fit; level[p] = the first level that keeps the interval hit at position p."""
    taken = 0
    qn = 0
    for k in range(n_levels):
        if taken < m and mins[k] < a:
            v = a
            while taken < m:
                x = _latest(bits, summ, k, v, -1)
                if x < 0:
                    break
                c = min(cnt[k, x], m - taken)
                _remove(cnt, bits, summ, mins, k, x, c)
                _add(cnt, bits, summ, mins, k, f, c)
                for t in range(taken, taken + c):
                    level[order[t0 + t]] = k
                taken += c
                qn = _carry_insert(qv, qc, qn, x, c)
                v = x
        if taken == m:
            while True:
                lo = qv[0]
                x = _latest(bits, summ, k, a, lo)
                if x < 0:
                    break
                c = min(cnt[k, x], qc[0])
                _remove(cnt, bits, summ, mins, k, x, c)
                _add(cnt, bits, summ, mins, k, lo, c)
                qc[0] -= c
                if qc[0] == 0:
                    qn -= 1
                    for j in range(qn):
                        qv[j], qc[j] = qv[j + 1], qc[j + 1]
                qn = _carry_insert(qv, qc, qn, x, c)
    for t in range(taken, m):
        level[order[t0 + t]] = n_levels


@numba.njit(cache=True, nogil=True)
def belady_ceiling_kernel(flat, offsets, hittable, inserted, n_blocks, caps):
    """Hit blocks per request (rows) under belady for every capacity in ``caps`` (blocks,
    ascending, ``UNBOUNDED`` for unbounded; columns). See the module docstring."""
    n_req, k_caps = len(hittable), len(caps)
    out = np.zeros((n_req, k_caps), np.int32)
    n_levels = 0
    while n_levels < k_caps and caps[n_levels] < UNBOUNDED:
        n_levels += 1
    steps = n_req + 1  # a slot is free from step s + 1 after its interval's last step s
    words = (steps + 63) >> 6
    rows = max(1, n_levels)
    cnt = np.zeros((rows, steps), np.int64)
    bits = np.zeros((rows, words), np.uint64)
    summ = np.zeros((rows, (words + 63) >> 6), np.uint64)
    mins = np.full(rows, UNBOUNDED, np.int64)
    below = 0
    for k in range(n_levels):
        c = min(caps[k], max(1, n_blocks))  # more slots than blocks never evict
        if c > below:
            _add(cnt, bits, summ, mins, k, 0, c - below)
            below = c
    nb = max(1, n_blocks)
    last_req = np.full(nb, -1, np.int64)  # the request of each block's last access
    last_j = np.zeros(nb, np.int64)
    last_clock = np.zeros(nb, np.int64)
    width = max(1, hittable.max()) if n_req else 1
    level = np.empty(width, np.int64)
    order = np.empty(width, np.int64)
    qv = np.empty(width + 1, np.int64)
    qc = np.empty(width + 1, np.int64)
    clock = 0
    for e in range(n_req):
        s = offsets[e]
        m = 0
        for p in range(hittable[e]):  # the intervals request e hits, in belady's order
            b = flat[s + p]
            if last_req[b] < 0:
                level[p] = k_caps  # never cached: no capacity holds it
                continue
            q = m
            while q > 0:
                o = flat[s + order[q - 1]]
                if last_j[o] < last_j[b] or (last_j[o] == last_j[b] and last_clock[o] > last_clock[b]):
                    break
                order[q] = order[q - 1]
                q -= 1
            order[q] = p
            m += 1
        t0 = 0
        while t0 < m:
            a = last_req[flat[s + order[t0]]]
            t1 = t0 + 1
            while t1 < m and last_req[flat[s + order[t1]]] == a:
                t1 += 1
            _keep_run(cnt, bits, summ, mins, n_levels, a + 1, e, t1 - t0, qv, qc, level, order, t0)
            t0 = t1
        deepest, j = 0, 0
        for k in range(k_caps):  # the leading run of blocks kept at capacity k
            while j < hittable[e]:
                deepest = max(deepest, level[j])
                if deepest > k:
                    break
                j += 1
            out[e, k] = j
        for j in range(inserted[e] - 1, -1, -1):
            b = flat[s + j]
            clock += 1
            last_req[b], last_j[b], last_clock[b] = e, j, clock
    return out
