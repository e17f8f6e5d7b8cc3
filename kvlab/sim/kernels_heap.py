"""Compiled replays of the key-ordered policies: lfu, length_aware, priority, belady (one kernel,
a mode each) and cost_aware (leaf-only GreedyDual). Each mirrors its definition in
kvlab.policies: the same keys, the same per-access clock as the last tie-break; an indexed heap
holds exactly the candidates (resident blocks; for cost_aware, resident leaves)."""

from __future__ import annotations

import numba
import numpy as np

from ..policies.weighted import PINNED
from .kernels_common import NEVER, heap_remove, heap_set, leading_hits, new_log

MODES = {"lfu": 0, "length_aware": 1, "priority": 2, "belady": 3}


def run_heap(policy: str, rep, cap: int, arg: int):
    """Dispatch lfu / length_aware / priority (``arg``: pin_tokens) / belady."""
    evb, evr = new_log(rep.inserted)
    nxt = next_uses(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks) \
        if policy == "belady" else np.zeros(1, np.int64)
    hits, n = _heap_kernel(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, cap,
                           MODES[policy], rep.block_size, rep.priorities(), arg, nxt, evb, evr)
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
def _heap_kernel(flat, offsets, hittable, inserted, n_blocks, cap, mode, bs, prio, pin_tokens,
                 nxt, evb, evr):
    hits = np.zeros(len(hittable), np.int64)
    nb = max(1, n_blocks)
    resident = np.zeros(nb, np.bool_)
    k1 = np.zeros(nb, np.int64)   # lfu: count; priority: level; belady: -next use
    k2 = np.zeros(nb, np.int64)   # length_aware, belady: -depth
    k3 = np.zeros(nb, np.int64)   # the access stamp
    hp = np.empty(nb, np.int64)
    pos = np.full(nb, -1, np.int64)
    n = 0
    clock = 0
    n_ev = 0
    for r in range(len(hittable)):
        s = offsets[r]
        hits[r] = leading_hits(flat, s, hittable[r], resident)
        for j in range(inserted[r] - 1, -1, -1):
            b = flat[s + j]
            clock += 1
            if mode <= 1:
                k1[b] = k1[b] + 1 if resident[b] else 1
                if mode == 1:
                    k2[b] = -(j * bs)
            elif mode == 2:
                lv = PINNED if j * bs + bs <= pin_tokens else prio[r]
                k1[b] = max(k1[b], lv) if resident[b] else lv
            else:
                k1[b] = -nxt[s + j]
                k2[b] = -(j * bs)
            k3[b] = clock
            resident[b] = True
            n = heap_set(hp, pos, n, k1, k2, k3, b)
        if cap < 0:
            continue
        while n > cap:
            b = hp[0]
            n = heap_remove(hp, pos, n, k1, k2, k3, b)
            resident[b] = False
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
    zero = np.zeros(nb, np.int64)
    stamp = np.zeros(nb, np.int64)
    parent = np.full(nb, -1, np.int64)
    children = np.zeros(nb, np.int64)
    hp = np.empty(nb, np.int64)      # resident leaves only
    pos = np.full(nb, -1, np.int64)
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
                        n = heap_remove(hp, pos, n, value, zero, stamp, p)
            d = j * bs
            value[b] = inflation + freq[b] * (bs * linear + bs * d + bs * (bs - 1) // 2)
            stamp[b] = clock
            if children[b] == 0:
                n = heap_set(hp, pos, n, value, zero, stamp, b)
        if cap < 0:
            continue
        while size > cap:
            b = hp[0]
            n = heap_remove(hp, pos, n, value, zero, stamp, b)
            inflation = value[b]
            resident[b] = False
            size -= 1
            p = parent[b]
            if p >= 0:
                children[p] -= 1
                if children[p] == 0 and resident[p]:
                    n = heap_set(hp, pos, n, value, zero, stamp, p)
            evb[n_ev] = b
            evr[n_ev] = r
            n_ev += 1
    return hits, n_ev
