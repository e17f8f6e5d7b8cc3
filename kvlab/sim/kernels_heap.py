"""Compiled replays of the heap-ordered policies. Each mirrors its definition in kvlab.policies:
the same keys, the same per-access clock as the last tie-break.

lfu, length_aware and belady share one kernel (a mode each): the blocks every order evicts first
wait in FIFOs, one per position ``j`` (deepest first; lfu: one FIFO), ahead of an indexed heap of
the rest. lfu / length_aware order by (count, -depth, stamp): most blocks are used once, and count-1
blocks are the FIFOs'; the heap keys ``count`` or ``count * span - j`` (``span``: one more than
the longest request's blocks; depth is ``j * block_size``, so the order is the same). belady's
FIFOs hold the blocks without a next hittable use; the heap keys (-next use, -depth) packed as
``-(next * span + j)``. cost_aware (leaf-only GreedyDual) keeps its resident leaves in the heap.
"""

from __future__ import annotations

import numba
import numpy as np

from ..errors import TraceError
from .kernels_common import (NEVER, evicted, heap_remove, heap_set, lookup, new_heap, new_lists, new_log, new_replay,
                             push_last, unlink)

MODES = {"lfu": 0, "length_aware": 1, "belady": 2}


def _span(rep) -> int:
    span = int(rep.inserted.max()) + 1 if len(rep.inserted) else 1
    if (len(rep.tokens) + 2) * span >= 1 << 62:
        raise TraceError(f"{len(rep.tokens)} requests of up to {span - 1} blocks overflow the packed keys")
    return span


def _next(policy, rep):
    if policy != "belady":
        return np.zeros(1, np.int64)
    return next_uses(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks)


def run_heap(policy: str, rep, cap: int, arg: int):
    """Dispatch lfu / length_aware / belady / cost_aware (``arg``: cost_aware's linear cost)."""
    evb, evr = new_log(rep.inserted)
    if policy == "cost_aware":
        hits, n = _cost_kernel(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, cap,
                               rep.block_size, arg, evb, evr)
    else:
        hits, n = _ranked_kernel(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, cap,
                                 MODES[policy], _span(rep), _next(policy, rep), evb, evr)
    return hits, evb[:n], evr[:n]


def sweep_heap(policy: str, rep, caps, args):
    """Hit blocks per request (rows) at every capacity (columns), capacities in parallel."""
    caps = np.asarray(caps, np.int64)
    if policy == "cost_aware":
        return _cost_sweep(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, caps,
                           rep.block_size, np.asarray(args, np.int64))
    return _ranked_sweep(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, caps,
                         MODES[policy], _span(rep), _next(policy, rep))


@numba.njit(cache=True)
def next_uses(flat, offsets, hittable, inserted, n_blocks):
    """For every inserted block reference, the request where keeping the block next pays off:
    its next access if that access can hit it (within the first n-1 tokens), NEVER if the next
    access cannot (it re-inserts the block anyway) or never comes. What belady ranks by."""
    nxt = np.full(max(1, offsets[-1]), NEVER, np.int64)
    seen = np.full(max(1, n_blocks), NEVER, np.int64)
    for r in range(len(hittable) - 1, -1, -1):
        s = offsets[r]
        for j in range(inserted[r]):
            nxt[s + j] = seen[flat[s + j]]
        for j in range(inserted[r] - 1, -1, -1):
            seen[flat[s + j]] = r if j < hittable[r] else NEVER
    return nxt


@numba.njit(cache=True)
def _ranked_kernel(flat, offsets, hittable, inserted, n_blocks, cap, mode, span, nxt, evb, evr):
    hits, resident = new_replay(hittable, n_blocks)
    count = np.zeros(len(resident), np.int64)
    hk, hs, hp, pos = new_heap(len(resident))
    lk, hd = new_lists(n_blocks, span)
    n = ones = top = size = clock = n_ev = 0
    for r in range(len(hittable)):
        s = lookup(flat, offsets, hittable, resident, hits, r)
        for j in range(inserted[r] - 1, -1, -1):
            b = flat[s + j]
            clock += 1
            new = not resident[b]
            if new:  # a block out of the cache is in no FIFO and not in the heap
                resident[b] = True
                size += 1
            elif lk[2, b] >= 0:  # in a FIFO
                unlink(lk, hd, b)
                ones -= 1
            if mode == 2:
                first, key = nxt[s + j] >= NEVER, -(nxt[s + j] * span + j)
            else:
                count[b] = 1 if new else count[b] + 1
                first, key = new, count[b] * span - j if mode == 1 else count[b]
            if first:
                if not new and pos[b] >= 0:
                    n = heap_remove(hk, hs, hp, pos, n, b)
                lst = j if mode != 0 else 0
                push_last(lk, hd, lst, b)
                ones += 1
                top = max(top, lst)
            else:
                n = heap_set(hk, hs, hp, pos, n, b, key, clock)
        while cap >= 0 and size > cap:  # the deepest FIFO's oldest first, then the heap's first
            if ones > 0:
                while hd[2, top] == 0:
                    top -= 1
                b = hd[0, top]
                unlink(lk, hd, b)
                ones -= 1
            else:
                b = hp[0]
                n = heap_remove(hk, hs, hp, pos, n, b)
            n_ev = evicted(resident, evb, evr, n_ev, b, r)
            size -= 1
    return hits, n_ev


@numba.njit(cache=True)
def _cost_kernel(flat, offsets, hittable, inserted, n_blocks, cap, bs, linear, evb, evr):
    hits, resident = new_replay(hittable, n_blocks)
    nb = len(resident)
    freq = np.zeros(nb, np.int64)
    value = np.zeros(nb, np.int64)   # H = inflation + hits x recompute cost
    stamp = np.zeros(nb, np.int64)
    parent = np.full(nb, -1, np.int64)
    children = np.zeros(nb, np.int64)
    hk, hs, hp, pos = new_heap(nb)   # resident leaves only
    n = size = inflation = clock = n_ev = 0
    for r in range(len(hittable)):
        s = lookup(flat, offsets, hittable, resident, hits, r)
        for j in range(inserted[r] - 1, -1, -1):
            b = flat[s + j]
            clock += 1
            if resident[b]:
                freq[b] += 1
            else:
                resident[b] = True
                size += 1
                freq[b] = 1
                p = flat[s + j - 1] if j > 0 else -1
                parent[b] = p
                if p >= 0:
                    children[p] += 1
                    if pos[p] >= 0:  # no longer a leaf
                        n = heap_remove(hk, hs, hp, pos, n, p)
            d = j * bs
            value[b] = inflation + freq[b] * (bs * linear + bs * d + bs * (bs - 1) // 2)
            stamp[b] = clock
            if children[b] == 0:
                n = heap_set(hk, hs, hp, pos, n, b, value[b], clock)
        while cap >= 0 and size > cap:
            b = hp[0]
            n = heap_remove(hk, hs, hp, pos, n, b)
            inflation = value[b]
            n_ev = evicted(resident, evb, evr, n_ev, b, r)
            size -= 1
            p = parent[b]
            if p >= 0:
                children[p] -= 1
                if children[p] == 0 and resident[p]:
                    n = heap_set(hk, hs, hp, pos, n, p, value[p], stamp[p])
    return hits, n_ev


@numba.njit(cache=True, parallel=True)
def _ranked_sweep(flat, offsets, hittable, inserted, n_blocks, caps, mode, span, nxt):
    out = np.zeros((len(hittable), len(caps)), np.int64)
    for k in numba.prange(len(caps)):
        evb, evr = new_log(inserted)
        out[:, k] = _ranked_kernel(flat, offsets, hittable, inserted, n_blocks, caps[k], mode, span, nxt,
                                   evb, evr)[0]
    return out


@numba.njit(cache=True, parallel=True)
def _cost_sweep(flat, offsets, hittable, inserted, n_blocks, caps, bs, args):
    out = np.zeros((len(hittable), len(caps)), np.int64)
    for k in numba.prange(len(caps)):
        evb, evr = new_log(inserted)
        out[:, k] = _cost_kernel(flat, offsets, hittable, inserted, n_blocks, caps[k], bs, args[k], evb, evr)[0]
    return out
