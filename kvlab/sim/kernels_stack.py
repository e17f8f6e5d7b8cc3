"""The single-pass LRU sweep: Mattson's stack distances give every capacity's hits at once."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
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
