"""Compiled replays of lfu, length_aware (one kernel, a mode each) and priority. Each mirrors its
definition in kvlab.policies: the same order, the per-access clock as the last tie-break.

lfu / length_aware order by (count, -depth, stamp). Most blocks are used once, so blocks of count
1 wait in FIFOs (one per position ``j`` for length_aware, deepest first; one for lfu), always
ahead of the rest, which an indexed heap keys ``count`` or ``count * span - j`` (``span``: one more
than the longest request's blocks; depth is ``j * block_size``, so the order is the same).
priority orders by (level, stamp): one LRU list per distinct level, lowest level first."""

from __future__ import annotations

import numba
import numpy as np

from ..policies.weighted import PINNED
from .kernels_common import heap_remove, heap_set, leading_hits, new_heap, new_log, push_last, unlink


def _span(rep) -> int:
    return int(rep.inserted.max()) + 1 if len(rep.inserted) else 1


def _levels(rep):
    """Each request's priority as a dense rank, the rank of PINNED and how many ranks there are."""
    levels = np.unique(np.concatenate([rep.priorities(), np.array([PINNED], np.int64)]))
    rank = np.searchsorted(levels, rep.priorities()).astype(np.int64)
    return rank, int(np.searchsorted(levels, PINNED)), len(levels)


def run_count(policy: str, rep, cap: int, arg: int):
    """Dispatch lfu / length_aware / priority (``arg``: pin_tokens)."""
    evb, evr = new_log(rep.inserted)
    if policy == "priority":
        rank, pinned, n_levels = _levels(rep)
        hits, n = _level_kernel(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, cap,
                                rep.block_size, rank, pinned, n_levels, arg, evb, evr)
    else:
        hits, n = _count_kernel(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, cap,
                                policy == "length_aware", _span(rep), evb, evr)
    return hits, evb[:n], evr[:n]


def sweep_count(policy: str, rep, caps, args):
    """Hit blocks per request (rows) at every capacity (columns), capacities in parallel."""
    caps, args = np.asarray(caps, np.int64), np.asarray(args, np.int64)
    if policy == "priority":
        rank, pinned, n_levels = _levels(rep)
        return _level_sweep(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, caps,
                            rep.block_size, rank, pinned, n_levels, args)
    return _count_sweep(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, caps,
                        policy == "length_aware", _span(rep))


@numba.njit(cache=True)
def _count_kernel(flat, offsets, hittable, inserted, n_blocks, cap, by_depth, span, evb, evr):
    hits = np.zeros(len(hittable), np.int64)
    nb = max(1, n_blocks)
    resident = np.zeros(nb, np.bool_)
    count = np.zeros(nb, np.int64)
    hk, hs, hp, pos = new_heap(nb)      # count >= 2
    lk = np.full((3, nb), -1, np.int64)  # count 1: FIFO per position (length_aware) or one FIFO
    hd = np.full((3, span), -1, np.int64)
    hd[2, :] = 0
    n = 0
    ones = 0
    top = 0
    size = 0
    clock = 0
    n_ev = 0
    for r in range(len(hittable)):
        s = offsets[r]
        hits[r] = leading_hits(flat, s, hittable[r], resident)
        for j in range(inserted[r] - 1, -1, -1):
            b = flat[s + j]
            clock += 1
            if not resident[b]:
                resident[b] = True
                size += 1
                count[b] = 1
                lst = j if by_depth else 0
                push_last(lk, hd, lst, b)
                ones += 1
                top = max(top, lst)
                continue
            if lk[2, b] >= 0:
                unlink(lk, hd, b)
                ones -= 1
            count[b] += 1
            n = heap_set(hk, hs, hp, pos, n, b, count[b] * span - j if by_depth else count[b], clock)
        if cap < 0:
            continue
        while size > cap:
            if ones > 0:
                while hd[2, top] == 0:
                    top -= 1
                b = hd[0, top]
                unlink(lk, hd, b)
                ones -= 1
            else:
                b = hp[0]
                n = heap_remove(hk, hs, hp, pos, n, b)
            resident[b] = False
            size -= 1
            evb[n_ev] = b
            evr[n_ev] = r
            n_ev += 1
    return hits, n_ev


@numba.njit(cache=True)
def _level_kernel(flat, offsets, hittable, inserted, n_blocks, cap, bs, rank, pinned, n_levels,
                  pin_tokens, evb, evr):
    hits = np.zeros(len(hittable), np.int64)
    nb = max(1, n_blocks)
    resident = np.zeros(nb, np.bool_)
    lk = np.full((3, nb), -1, np.int64)  # one LRU list per level rank
    hd = np.full((3, n_levels), -1, np.int64)
    hd[2, :] = 0
    size = 0
    n_ev = 0
    for r in range(len(hittable)):
        s = offsets[r]
        hits[r] = leading_hits(flat, s, hittable[r], resident)
        for j in range(inserted[r] - 1, -1, -1):
            b = flat[s + j]
            lv = pinned if j * bs + bs <= pin_tokens else rank[r]
            if resident[b]:
                lv = max(lv, lk[2, b])
                unlink(lk, hd, b)
            else:
                resident[b] = True
                size += 1
            push_last(lk, hd, lv, b)
        if cap < 0:
            continue
        low = 0
        while size > cap:
            while hd[2, low] == 0:
                low += 1
            b = hd[0, low]
            unlink(lk, hd, b)
            resident[b] = False
            size -= 1
            evb[n_ev] = b
            evr[n_ev] = r
            n_ev += 1
    return hits, n_ev


@numba.njit(cache=True, parallel=True)
def _count_sweep(flat, offsets, hittable, inserted, n_blocks, caps, by_depth, span):
    out = np.zeros((len(hittable), len(caps)), np.int64)
    m = max(1, inserted.sum())
    for k in numba.prange(len(caps)):
        hits, _ = _count_kernel(flat, offsets, hittable, inserted, n_blocks, caps[k], by_depth, span,
                                np.empty(m, np.int64), np.empty(m, np.int64))
        out[:, k] = hits
    return out


@numba.njit(cache=True, parallel=True)
def _level_sweep(flat, offsets, hittable, inserted, n_blocks, caps, bs, rank, pinned, n_levels, args):
    out = np.zeros((len(hittable), len(caps)), np.int64)
    m = max(1, inserted.sum())
    for k in numba.prange(len(caps)):
        hits, _ = _level_kernel(flat, offsets, hittable, inserted, n_blocks, caps[k], bs, rank, pinned,
                                n_levels, args[k], np.empty(m, np.int64), np.empty(m, np.int64))
        out[:, k] = hits
    return out
