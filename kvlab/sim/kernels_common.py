"""Building blocks the compiled replay kernels share: the replay's state and its leading-run
lookup, intrusive linked lists over block ids, a min-heap of int64 rows, and the eviction log.

Lists: ``lk`` int64 [3, n_blocks] holds each block's previous, next and list id (-1: none);
``hd`` int64 [3, n_lists] each list's first (oldest) block, last (newest) block and length.
Heap: an indexed binary min-heap whose slots hold ``(key, stamp, block)`` (``hk``, ``hs``, ``hp``,
int64 [n_blocks]) and ``pos`` each block's slot (-1: not in it), ordered by ``(key, stamp)``; the
stamp is the access clock, unique, so the order is total. Policies with two keys pack them into
``key`` (kernels_heap).

numba's on-disk cache (cache=True) is keyed on each kernel's own file: a kernel compiled before an
edit here keeps the old code until its cache in kvlab/sim/__pycache__ is deleted.
"""

from __future__ import annotations

import numba
import numpy as np

NEVER = np.int64(1) << 62


@numba.njit(cache=True)
def new_replay(hittable, n_blocks):
    """Hit blocks per request (int64 [requests]) and which blocks are resident (bool [blocks])."""
    return np.zeros(len(hittable), np.int64), np.zeros(max(1, n_blocks), np.bool_)


@numba.njit(cache=True)
def leading_hits(flat, start, n, resident):
    k = 0
    while k < n and resident[flat[start + k]]:
        k += 1
    return k


@numba.njit(cache=True)
def lookup(flat, offsets, hittable, resident, hits, r):
    """Request r's lookup: its hits are the leading run of its resident blocks (within the ones it
    can hit); returns where its blocks start in ``flat``."""
    s = offsets[r]
    hits[r] = leading_hits(flat, s, hittable[r], resident)
    return s


@numba.njit(cache=True)
def new_lists(n_blocks, n_lists):
    lk = np.full((3, max(1, n_blocks)), -1, np.int64)
    hd = np.full((3, n_lists), -1, np.int64)
    hd[2, :] = 0
    return lk, hd


@numba.njit(cache=True)
def new_log(inserted):
    """Room for every eviction: a block leaves at most once per time it was inserted."""
    m = max(1, inserted.sum())
    return np.empty(m, np.int64), np.empty(m, np.int64)


@numba.njit(cache=True)
def evicted(resident, evb, evr, n_ev, b, r):
    """Block ``b`` leaves, evicted by request ``r``'s insertion; returns the log's length."""
    resident[b] = False
    evb[n_ev] = b
    evr[n_ev] = r
    return n_ev + 1


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
def _precedes(k1, s1, k2, s2):
    return k1 < k2 or (k1 == k2 and s1 < s2)


@numba.njit(cache=True)
def _put(hk, hs, hp, pos, i, k, st, b):
    hk[i], hs[i], hp[i] = k, st, b
    pos[b] = i


@numba.njit(cache=True)
def heap_up(hk, hs, hp, pos, i):
    k, st, b = hk[i], hs[i], hp[i]
    while i > 0 and _precedes(k, st, hk[(i - 1) >> 1], hs[(i - 1) >> 1]):
        p = (i - 1) >> 1
        _put(hk, hs, hp, pos, i, hk[p], hs[p], hp[p])
        i = p
    _put(hk, hs, hp, pos, i, k, st, b)


@numba.njit(cache=True)
def heap_down(hk, hs, hp, pos, n, i):
    k, st, b = hk[i], hs[i], hp[i]
    while 2 * i + 1 < n:
        c = 2 * i + 1
        if c + 1 < n and _precedes(hk[c + 1], hs[c + 1], hk[c], hs[c]):
            c += 1
        if _precedes(k, st, hk[c], hs[c]):
            break
        _put(hk, hs, hp, pos, i, hk[c], hs[c], hp[c])
        i = c
    _put(hk, hs, hp, pos, i, k, st, b)


@numba.njit(cache=True)
def heap_set(hk, hs, hp, pos, n, b, key, stamp):
    """Insert block ``b`` with ``(key, stamp)``, or move it there; returns the heap's length."""
    i = pos[b]
    if i < 0:
        i = n
        n += 1
    hk[i], hs[i], hp[i] = key, stamp, b
    heap_up(hk, hs, hp, pos, i)
    heap_down(hk, hs, hp, pos, n, pos[b])
    return n


@numba.njit(cache=True)
def heap_remove(hk, hs, hp, pos, n, b):
    """Take block ``b`` out of the heap; returns the heap's length."""
    i = pos[b]
    n -= 1
    pos[b] = -1
    if i < n:
        hk[i], hs[i], hp[i] = hk[n], hs[n], hp[n]
        moved = hp[i]
        pos[moved] = i
        heap_up(hk, hs, hp, pos, i)
        heap_down(hk, hs, hp, pos, n, pos[moved])
    return n


@numba.njit(cache=True)
def new_heap(m):
    """Slots (key, stamp, block) of an indexed min-heap, and each block's slot (-1: absent)."""
    return np.empty(m, np.int64), np.empty(m, np.int64), np.empty(m, np.int64), np.full(m, -1, np.int64)
