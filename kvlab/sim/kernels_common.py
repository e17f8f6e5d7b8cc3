"""Building blocks the compiled replay kernels share: the leading-run lookup, intrusive linked
lists over block ids, a min-heap of int64 rows, and the eviction log.

Lists: ``lk`` int64 [3, n_blocks] holds each block's previous, next and list id (-1: none);
``hd`` int64 [3, n_lists] each list's first (oldest) block, last (newest) block and length.
Heap: an indexed binary min-heap of block ids ``hp`` (int64 [n_blocks]) with each block's place
``pos`` (-1: not in it), ordered by per-block keys ``(k1[b], k2[b], k3[b])`` compared
lexicographically (``k3`` is the access stamp, unique, so the order is total).

numba's on-disk cache (cache=True) is keyed on each kernel's own file: a kernel compiled before an
edit here keeps the old code until its cache in kvlab/sim/__pycache__ is deleted.
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
def _less(k1, k2, k3, a, b):
    if k1[a] != k1[b]:
        return k1[a] < k1[b]
    if k2[a] != k2[b]:
        return k2[a] < k2[b]
    return k3[a] < k3[b]


@numba.njit(cache=True)
def heap_up(hp, pos, k1, k2, k3, i):
    b = hp[i]
    while i > 0:
        p = (i - 1) >> 1
        q = hp[p]
        if not _less(k1, k2, k3, b, q):
            break
        hp[i] = q
        pos[q] = i
        i = p
    hp[i] = b
    pos[b] = i


@numba.njit(cache=True)
def heap_down(hp, pos, n, k1, k2, k3, i):
    b = hp[i]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and _less(k1, k2, k3, hp[c + 1], hp[c]):
            c += 1
        if not _less(k1, k2, k3, hp[c], b):
            break
        hp[i] = hp[c]
        pos[hp[i]] = i
        i = c
    hp[i] = b
    pos[b] = i


@numba.njit(cache=True)
def heap_set(hp, pos, n, k1, k2, k3, b):
    """Insert block ``b``, or restore order after its keys changed; returns the heap's length."""
    i = pos[b]
    if i < 0:
        hp[n] = b
        pos[b] = n
        heap_up(hp, pos, k1, k2, k3, n)
        return n + 1
    heap_up(hp, pos, k1, k2, k3, i)
    heap_down(hp, pos, n, k1, k2, k3, pos[b])
    return n


@numba.njit(cache=True)
def heap_remove(hp, pos, n, k1, k2, k3, b):
    """Take block ``b`` out of the heap; returns the heap's length."""
    i = pos[b]
    n -= 1
    pos[b] = -1
    if i < n:
        last = hp[n]
        hp[i] = last
        pos[last] = i
        heap_up(hp, pos, k1, k2, k3, i)
        heap_down(hp, pos, n, k1, k2, k3, pos[last])
    return n
