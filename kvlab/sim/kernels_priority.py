"""Compiled replay of priority, mirroring its definition in kvlab.policies: the order is (level,
stamp), so one LRU list per distinct level, the lowest level evicted first; a block within the
first ``pin_tokens`` tokens of its request is PINNED."""

from __future__ import annotations

import numba
import numpy as np

from ..policies.weighted import PINNED
from .kernels_common import evicted, lookup, new_lists, new_log, new_replay, push_last, unlink


def _levels(rep):
    """Each request's priority as a dense rank, the rank of PINNED and how many ranks there are."""
    levels = np.unique(np.concatenate([rep.priorities(), np.array([PINNED], np.int64)]))
    rank = np.searchsorted(levels, rep.priorities()).astype(np.int64)
    return rank, int(np.searchsorted(levels, PINNED)), len(levels)


def run_priority(policy: str, rep, cap: int, arg: int):
    """Replay priority (``arg``: pin_tokens)."""
    evb, evr = new_log(rep.inserted)
    rank, pinned, n_levels = _levels(rep)
    hits, n = _level_kernel(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, cap,
                            rep.block_size, rank, pinned, n_levels, arg, evb, evr)
    return hits, evb[:n], evr[:n]


def sweep_priority(policy: str, rep, caps, args):
    """Hit blocks per request (rows) at every capacity (columns), capacities in parallel."""
    rank, pinned, n_levels = _levels(rep)
    return _level_sweep(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks,
                        np.asarray(caps, np.int64), rep.block_size, rank, pinned, n_levels,
                        np.asarray(args, np.int64))


@numba.njit(cache=True)
def _level_kernel(flat, offsets, hittable, inserted, n_blocks, cap, bs, rank, pinned, n_levels,
                  pin_tokens, evb, evr):
    hits, resident = new_replay(hittable, n_blocks)
    lk, hd = new_lists(n_blocks, n_levels)  # one LRU list per level rank
    size = n_ev = 0
    for r in range(len(hittable)):
        s = lookup(flat, offsets, hittable, resident, hits, r)
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
        low = 0
        while cap >= 0 and size > cap:
            while hd[2, low] == 0:
                low += 1
            b = hd[0, low]
            unlink(lk, hd, b)
            n_ev = evicted(resident, evb, evr, n_ev, b, r)
            size -= 1
    return hits, n_ev


@numba.njit(cache=True, parallel=True)
def _level_sweep(flat, offsets, hittable, inserted, n_blocks, caps, bs, rank, pinned, n_levels, args):
    out = np.zeros((len(hittable), len(caps)), np.int64)
    for k in numba.prange(len(caps)):
        evb, evr = new_log(inserted)
        out[:, k] = _level_kernel(flat, offsets, hittable, inserted, n_blocks, caps[k], bs, rank, pinned,
                                  n_levels, args[k], evb, evr)[0]
    return out
