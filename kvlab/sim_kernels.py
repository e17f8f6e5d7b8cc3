"""The simulator's compiled (numba) kernels: per-policy replays and the single-pass LRU
stack-distance sweep. Pure array code; kvlab.simulator prepares the arrays and reads the results.

Arrays: ``flat`` block ids of all requests back to back, ``offsets`` each request's start,
``hittable`` full blocks within its first n-1 tokens, ``inserted`` full blocks it caches.
"""

from __future__ import annotations

import numba
import numpy as np


def replay_kernel(rep, policy: str, cap: int | None) -> tuple[np.ndarray, int]:
    """One replay of ``rep`` (a simulator.Replay) through a policy's compiled kernel."""
    c = -1 if cap is None else cap
    kernel = {"lru": _lru_kernel, "infinite": _lru_kernel, "fifo": _fifo_kernel,
              "lfu": _lfu_kernel}[policy]
    hits, evictions = kernel(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, c)
    return hits, int(evictions)


@numba.njit(cache=True)
def _leading_hits(flat, start, n, resident):
    k = 0
    while k < n and resident[flat[start + k]]:
        k += 1
    return k


@numba.njit(cache=True)
def _lru_kernel(flat, offsets, hittable, inserted, n_blocks, cap):
    # a doubly linked list over block ids: head is most recent, tail least
    hits = np.zeros(len(hittable), np.int64)
    prev = np.full(n_blocks, -1, np.int64)
    nxt = np.full(n_blocks, -1, np.int64)
    resident = np.zeros(n_blocks, np.bool_)
    head = -1
    tail = -1
    size = 0
    evictions = 0
    for r in range(len(hittable)):
        s = offsets[r]
        hits[r] = _leading_hits(flat, s, hittable[r], resident)
        for j in range(inserted[r] - 1, -1, -1):
            b = flat[s + j]
            if resident[b]:
                if head == b:
                    continue
                p, q = prev[b], nxt[b]  # unlink; b is not head so p >= 0
                nxt[p] = q
                if q >= 0:
                    prev[q] = p
                else:
                    tail = p
            else:
                resident[b] = True
                size += 1
            prev[b] = -1
            nxt[b] = head
            if head >= 0:
                prev[head] = b
            head = b
            if tail < 0:
                tail = b
        if cap >= 0:
            while size > cap:
                b = tail
                tail = prev[b]
                if tail >= 0:
                    nxt[tail] = -1
                else:
                    head = -1
                prev[b] = -1
                resident[b] = False
                size -= 1
                evictions += 1
    return hits, evictions


@numba.njit(cache=True)
def _fifo_kernel(flat, offsets, hittable, inserted, n_blocks, cap):
    hits = np.zeros(len(hittable), np.int64)
    resident = np.zeros(n_blocks, np.bool_)
    queue = np.empty(max(1, inserted.sum()), np.int64)  # one entry per admission
    qh = 0
    qt = 0
    size = 0
    evictions = 0
    for r in range(len(hittable)):
        s = offsets[r]
        hits[r] = _leading_hits(flat, s, hittable[r], resident)
        for j in range(inserted[r] - 1, -1, -1):
            b = flat[s + j]
            if not resident[b]:
                resident[b] = True
                queue[qt] = b
                qt += 1
                size += 1
        if cap >= 0:
            while size > cap:
                resident[queue[qh]] = False
                qh += 1
                size -= 1
                evictions += 1
    return hits, evictions


@numba.njit(cache=True)
def _heap_less(f, t, i, j):
    return f[i] < f[j] or (f[i] == f[j] and t[i] < t[j])


@numba.njit(cache=True)
def _heap_swap(f, t, v, i, j):
    f[i], f[j] = f[j], f[i]
    t[i], t[j] = t[j], t[i]
    v[i], v[j] = v[j], v[i]


@numba.njit(cache=True)
def _lfu_kernel(flat, offsets, hittable, inserted, n_blocks, cap):
    # a min-heap on (count, last use) with lazy deletion: stale entries are skipped when popped
    hits = np.zeros(len(hittable), np.int64)
    resident = np.zeros(n_blocks, np.bool_)
    count = np.zeros(n_blocks, np.int64)
    stamp = np.zeros(n_blocks, np.int64)
    m = max(1, inserted.sum())  # one push per access, so the heap never outgrows this
    hf = np.empty(m, np.int64)
    ht = np.empty(m, np.int64)
    hv = np.empty(m, np.int64)
    hn = 0
    clock = 0
    size = 0
    evictions = 0
    for r in range(len(hittable)):
        s = offsets[r]
        hits[r] = _leading_hits(flat, s, hittable[r], resident)
        for j in range(inserted[r] - 1, -1, -1):
            b = flat[s + j]
            clock += 1
            if resident[b]:
                count[b] += 1
            else:
                resident[b] = True
                count[b] = 1
                size += 1
            stamp[b] = clock
            hf[hn], ht[hn], hv[hn] = count[b], clock, b
            i = hn
            hn += 1
            while i > 0:
                p = (i - 1) // 2
                if _heap_less(hf, ht, i, p):
                    _heap_swap(hf, ht, hv, i, p)
                    i = p
                else:
                    break
        if cap >= 0:
            while size > cap:
                b = hv[0]
                live = resident[b] and hf[0] == count[b] and ht[0] == stamp[b]
                hn -= 1
                _heap_swap(hf, ht, hv, 0, hn)
                _sift_down(hf, ht, hv, hn, 0)
                if live:
                    resident[b] = False
                    size -= 1
                    evictions += 1
    return hits, evictions


@numba.njit(cache=True)
def _sift_down(hf, ht, hv, n, i):
    while True:
        c = 2 * i + 1
        if c >= n:
            return
        if c + 1 < n and _heap_less(hf, ht, c + 1, c):
            c += 1
        if _heap_less(hf, ht, c, i):
            _heap_swap(hf, ht, hv, c, i)
            i = c
        else:
            return


@numba.njit(cache=True)
def lru_stack_kernel(flat, offsets, hittable, inserted, n_blocks, caps):
    """Hit blocks per request (rows) for every capacity in ``caps`` (blocks, ascending; columns).

    Mattson: every replay of LRU keeps the top C blocks of one recency stack, so a block is
    resident at capacity C iff its stack depth < C. A Fenwick tree over access times counts the
    blocks used since a block's last use (its depth). The leading-run rule becomes: hits at C =
    the number of leading blocks whose running maximum depth is < C.
    """
    n_req = len(hittable)
    k_caps = len(caps)
    out = np.zeros((n_req, k_caps), np.int32)  # hit blocks per request fit; halves a big sweep
    total = inserted.sum()
    tree = np.zeros(total + 1, np.int64)
    last = np.zeros(n_blocks, np.int64)  # last access time, 0 = never
    live = 0
    clock = 0
    run_max = np.empty(max(1, hittable.max()) if n_req else 1, np.int64)
    for r in range(n_req):
        s = offsets[r]
        n_ok = 0
        deepest = 0
        for j in range(hittable[r]):
            t = last[flat[s + j]]
            if t == 0:
                break
            seen = 0  # accesses up to time t still live = blocks at least as old as this one
            i = t
            while i > 0:
                seen += tree[i]
                i -= i & (-i)
            depth = live - seen
            if depth > deepest:
                deepest = depth
            run_max[n_ok] = deepest
            n_ok += 1
        j = 0
        for k in range(k_caps):
            while j < n_ok and run_max[j] < caps[k]:
                j += 1
            out[r, k] = j
        for j in range(inserted[r] - 1, -1, -1):
            b = flat[s + j]
            t = last[b]
            if t != 0:
                i = t
                while i <= total:
                    tree[i] -= 1
                    i += i & (-i)
            else:
                live += 1
            clock += 1
            last[b] = clock
            i = clock
            while i <= total:
                tree[i] += 1
                i += i & (-i)
    return out
