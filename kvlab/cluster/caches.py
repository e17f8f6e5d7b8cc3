"""N block caches at once, compiled: which instances hold each block (one bit each), and each
instance's eviction order (LRU or FIFO; a TTL view evicts from the same LRU order by age).

``holders`` (uint64 [blocks]) has bit i set when instance i holds the block: a view's match for
every instance is one pass over the request's blocks (kvlab.cluster.kernel), so at most 64
instances. A bounded cache keeps each (instance, block) it holds in a slot: ``head[b]`` is the
first slot of block b's chain (one slot per instance holding it), linked by ``snext``; the slots
of instance i form list i of kvlab.sim.kernels_common's intrusive lists, oldest first. An
unbounded cache (``slots == 0``) never evicts and keeps only the bits.

The tuple ``mc`` is (holders, head, sblock, sinst, snext, lk, hd, free, meta, stamp):
``meta[0]`` free slots left, ``meta[1]`` 1 when bounded, ``stamp`` each slot's last access time.

Example:
    >>> mc = new_caches(10, 2, 4)
    >>> access(mc, 1, 7, 0.0, True), holds(mc, 1, 7), holds(mc, 0, 7)
    (True, True, False)
"""

from __future__ import annotations

import numba
import numpy as np

from ..sim.kernels_common import move_last, new_lists, push_last, unlink

MAX_INSTANCES = 64


@numba.njit(cache=True)
def new_caches(n_blocks, n_inst, slots):
    """Empty caches for ``n_inst`` instances over ``n_blocks`` block ids, ``slots`` slots (0: unbounded)."""
    holders = np.zeros(max(1, n_blocks), np.uint64)
    m = max(1, slots)
    head = np.full(max(1, n_blocks) if slots > 0 else 1, -1, np.int64)
    lk, hd = new_lists(m, n_inst)
    free = np.arange(m - 1, -1, -1).astype(np.int64)
    meta = np.array([m, 1 if slots > 0 else 0], np.int64)
    return (holders, head, np.zeros(m, np.int64), np.zeros(m, np.int64), np.full(m, -1, np.int64), lk, hd,
            free, meta, np.zeros(m, np.float64))


@numba.njit(cache=True)
def holds(mc, i, b):
    return (mc[0][b] >> np.uint64(i)) & np.uint64(1) == 1


@numba.njit(cache=True)
def size(mc, i):
    return mc[6][2, i]


@numba.njit(cache=True)
def _find(mc, i, b):
    s = mc[1][b]
    while s >= 0 and mc[3][s] != i:
        s = mc[4][s]
    return s


@numba.njit(cache=True)
def access(mc, i, b, t, refresh):
    """Instance i uses block b at time t: a held block moves to the newest end (if ``refresh``:
    LRU; FIFO does not), a new one is held. Returns True when it is new."""
    holders, head, sblock, sinst, snext, lk, hd, free, meta, stamp = mc
    bit = np.uint64(1) << np.uint64(i)
    unbounded = meta[1] == 0
    if holders[b] & bit:
        if not unbounded and refresh:
            s = _find(mc, i, b)
            move_last(lk, hd, i, s)
            stamp[s] = t
        return False
    holders[b] |= bit
    if unbounded:
        hd[2, i] += 1
        return True
    if meta[0] == 0:
        raise ValueError("kvlab: a cluster cache ran out of slots (a kvlab bug)")
    meta[0] -= 1
    s = free[meta[0]]
    sblock[s], sinst[s], snext[s], stamp[s] = b, i, head[b], t
    head[b] = s
    push_last(lk, hd, i, s)
    return True


@numba.njit(cache=True)
def oldest(mc, i):
    """(block, last access time) of instance i's next victim; (-1, 0) when it holds none."""
    s = mc[6][0, i]
    return (-1, 0.0) if s < 0 else (mc[2][s], mc[9][s])


@numba.njit(cache=True)
def evict(mc, i):
    """Instance i drops its oldest block; returns it."""
    holders, head, sblock, sinst, snext, lk, hd, free, meta, stamp = mc
    s = hd[0, i]
    b = sblock[s]
    unlink(lk, hd, s)
    if head[b] == s:
        head[b] = snext[s]
    else:
        p = head[b]
        while snext[p] != s:
            p = snext[p]
        snext[p] = snext[s]
    holders[b] &= ~(np.uint64(1) << np.uint64(i))
    free[meta[0]] = s
    meta[0] += 1
    return b


def slots_for(n_inst: int, cap_blocks: int | None, max_inserted: int, references: int) -> int:
    """Slots a bounded cache needs (0: unbounded): every instance full and one request's blocks
    over, but never more than the trace's block references (each slot was one of them)."""
    return 0 if cap_blocks is None else min(n_inst * (cap_blocks + max_inserted), references) + 1
