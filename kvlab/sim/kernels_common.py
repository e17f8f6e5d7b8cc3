"""Building blocks the compiled replay kernels share: the leading-run lookup, intrusive linked
lists over block ids, a min-heap of int64 rows, and the eviction log.

Lists: ``lk`` int64 [3, n_blocks] holds each block's previous, next and list id (-1: none);
``hd`` int64 [3, n_lists] each list's first (oldest) block, last (newest) block and length.
Heap: ``h`` int64 [capacity, 4] rows ``(k1, k2, stamp, block)``, compared lexicographically.
"""

from __future__ import annotations

import numba
import numpy as np

NEVER = np.int64(1) << 62


@numba.njit(cache=True)
def leading_hits(flat, start, n, resident):
    k = 0
    while k < n and resident[flat[start + k]]:
        k += 1
    return k


def new_lists(n_blocks: int, n_lists: int):
    lk = np.full((3, max(1, n_blocks)), -1, np.int64)
    hd = np.full((3, n_lists), -1, np.int64)
    hd[2, :] = 0
    return lk, hd


def new_log(inserted):
    """Room for every eviction: a block leaves at most once per time it was inserted."""
    m = max(1, int(inserted.sum()))
    return np.empty(m, np.int64), np.empty(m, np.int64)


@numba.njit(cache=True)
def push_last(lk, hd, lst, b):
    t = hd[1, lst]
    lk[0, b] = t
    lk[1, b] = -1
    lk[2, b] = lst
    if t >= 0:
        lk[1, t] = b
    else:
        hd[0, lst] = b
    hd[1, lst] = b
    hd[2, lst] += 1


@numba.njit(cache=True)
def unlink(lk, hd, b):
    lst, p, q = lk[2, b], lk[0, b], lk[1, b]
    if p >= 0:
        lk[1, p] = q
    else:
        hd[0, lst] = q
    if q >= 0:
        lk[0, q] = p
    else:
        hd[1, lst] = p
    hd[2, lst] -= 1
    lk[2, b] = -1


@numba.njit(cache=True)
def move_last(lk, hd, lst, b):
    unlink(lk, hd, b)
    push_last(lk, hd, lst, b)


@numba.njit(cache=True)
def _less(h, i, j):
    for c in range(4):
        if h[i, c] != h[j, c]:
            return h[i, c] < h[j, c]
    return False


@numba.njit(cache=True)
def _swap(h, i, j):
    for c in range(4):
        h[i, c], h[j, c] = h[j, c], h[i, c]


@numba.njit(cache=True)
def heap_push(h, n, k1, k2, stamp, b):
    h[n, 0], h[n, 1], h[n, 2], h[n, 3] = k1, k2, stamp, b
    i = n
    while i > 0:
        p = (i - 1) // 2
        if _less(h, i, p):
            _swap(h, i, p)
            i = p
        else:
            break
    return n + 1


@numba.njit(cache=True)
def heap_pop(h, n):
    """Drop the smallest row (read ``h[0]`` first); returns the new length."""
    n -= 1
    _swap(h, 0, n)
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and _less(h, c + 1, c):
            c += 1
        if _less(h, c, i):
            _swap(h, c, i)
            i = c
        else:
            break
    return n
