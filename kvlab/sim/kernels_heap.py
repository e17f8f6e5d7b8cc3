"""Compiled replays of belady and cost_aware (leaf-only GreedyDual). Each mirrors its definition
in kvlab.policies: the same keys, the same per-access clock as the last tie-break; an indexed
heap holds the candidates (belady: blocks with a next hittable use, keyed (-next use, -depth)
packed as ``-(next * span + j)``, ``j`` the block's index in its request and ``span`` one more
than the longest request's blocks; cost_aware: resident leaves)."""

from __future__ import annotations

import numba
import numpy as np

from ..errors import TraceError
from .kernels_common import (NEVER, heap_remove, heap_set, leading_hits, new_heap, new_log, push_last,
                             unlink)


def _span(rep) -> int:
    span = int(rep.inserted.max()) + 1 if len(rep.inserted) else 1
    if (len(rep.tokens) + 2) * span >= 1 << 62:
        raise TraceError(f"{len(rep.tokens)} requests of up to {span - 1} blocks overflow the packed keys")
    return span


def run_belady(rep, cap: int):
    evb, evr = new_log(rep.inserted)
    nxt = next_uses(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks)
    hits, n = _belady_kernel(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, cap,
                             _span(rep), nxt, evb, evr)
    return hits, evb[:n], evr[:n]


def run_cost(rep, cap: int, linear: int):
    evb, evr = new_log(rep.inserted)
    hits, n = _cost_kernel(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, cap,
                           rep.block_size, linear, evb, evr)
    return hits, evb[:n], evr[:n]


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
def _belady_kernel(flat, offsets, hittable, inserted, n_blocks, cap, span, nxt, evb, evr):
    # Blocks with a next hittable use wait in the heap keyed -(next * span + j); the rest (NEVER,
    # always the first victims) in a FIFO per position j, deepest position first: the same order.
    hits = np.zeros(len(hittable), np.int64)
    nb = max(1, n_blocks)
    resident = np.zeros(nb, np.bool_)
    hk, hs, hp, pos = new_heap(nb)
    lk = np.full((3, nb), -1, np.int64)
    hd = np.full((3, span), -1, np.int64)
    hd[2, :] = 0
    n = 0
    never = 0
    top = -1  # no FIFO above this position holds a block
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
            if lk[2, b] >= 0:
                unlink(lk, hd, b)
                never -= 1
            if nxt[s + j] >= NEVER:
                if pos[b] >= 0:
                    n = heap_remove(hk, hs, hp, pos, n, b)
                push_last(lk, hd, j, b)
                never += 1
                top = max(top, j)
            else:
                n = heap_set(hk, hs, hp, pos, n, b, -(nxt[s + j] * span + j), clock)
        if cap < 0:
            continue
        while size > cap:
            if never > 0:
                while hd[2, top] == 0:
                    top -= 1
                b = hd[0, top]
                unlink(lk, hd, b)
                never -= 1
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
def _cost_kernel(flat, offsets, hittable, inserted, n_blocks, cap, bs, linear, evb, evr):
    hits = np.zeros(len(hittable), np.int64)
    nb = max(1, n_blocks)
    resident = np.zeros(nb, np.bool_)
    freq = np.zeros(nb, np.int64)
    value = np.zeros(nb, np.int64)   # H = inflation + hits x recompute cost
    stamp = np.zeros(nb, np.int64)
    parent = np.full(nb, -1, np.int64)
    children = np.zeros(nb, np.int64)
    hk, hs, hp, pos = new_heap(nb)   # resident leaves only
    n = 0
    size = 0
    inflation = 0
    clock = 0
    n_ev = 0
    for r in range(len(hittable)):
        s = offsets[r]
        hits[r] = leading_hits(flat, s, hittable[r], resident)
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
        if cap < 0:
            continue
        while size > cap:
            b = hp[0]
            n = heap_remove(hk, hs, hp, pos, n, b)
            inflation = value[b]
            resident[b] = False
            size -= 1
            p = parent[b]
            if p >= 0:
                children[p] -= 1
                if children[p] == 0 and resident[p]:
                    n = heap_set(hk, hs, hp, pos, n, p, value[p], stamp[p])
            evb[n_ev] = b
            evr[n_ev] = r
            n_ev += 1
    return hits, n_ev


def sweep_heap(policy: str, rep, caps, args):
    """Hit blocks per request (rows) at every capacity (columns), capacities in parallel."""
    caps = np.asarray(caps, np.int64)
    if policy == "cost_aware":
        return _cost_sweep(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, caps,
                           rep.block_size, np.asarray(args, np.int64))
    nxt = next_uses(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks)
    return _belady_sweep(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, caps, _span(rep), nxt)


@numba.njit(cache=True, parallel=True)
def _belady_sweep(flat, offsets, hittable, inserted, n_blocks, caps, span, nxt):
    out = np.zeros((len(hittable), len(caps)), np.int64)
    m = max(1, inserted.sum())
    for k in numba.prange(len(caps)):
        hits, _ = _belady_kernel(flat, offsets, hittable, inserted, n_blocks, caps[k], span, nxt,
                                 np.empty(m, np.int64), np.empty(m, np.int64))
        out[:, k] = hits
    return out


@numba.njit(cache=True, parallel=True)
def _cost_sweep(flat, offsets, hittable, inserted, n_blocks, caps, bs, args):
    out = np.zeros((len(hittable), len(caps)), np.int64)
    m = max(1, inserted.sum())
    for k in numba.prange(len(caps)):
        hits, _ = _cost_kernel(flat, offsets, hittable, inserted, n_blocks, caps[k], bs, args[k],
                               np.empty(m, np.int64), np.empty(m, np.int64))
        out[:, k] = hits
    return out
