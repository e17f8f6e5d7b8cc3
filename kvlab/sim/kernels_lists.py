"""Compiled replays of the list-based policies: lru/fifo, slru, s3fifo, arc, tinylfu. Each
mirrors its definition in kvlab.policies line for line (sizes are 1 block; ``cap`` -1 is
unbounded) and returns hits per request plus the eviction log (block, request)."""

from __future__ import annotations

import numba
import numpy as np

from .kernels_common import evicted, lookup, move_last, new_lists, new_log, new_replay, push_last, unlink


def run_lists(policy: str, rep, cap: int, arg: int):
    """Dispatch one list-based policy; ``arg`` is its derived parameter (see dispatch)."""
    lk, hd = new_lists(rep.n_blocks, 4)
    evb, evr = new_log(rep.inserted)
    code = {"lru": 0, "fifo": 1, "slru": 2, "s3fifo": 3, "arc": 4, "tinylfu": 5}[policy]
    hits, n = _lists_kernel(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks, cap,
                            code, arg, lk, hd, evb, evr)
    return hits, evb[:n], evr[:n]


@numba.njit(cache=True)
def _tiny_freq(cnt, ep, epoch, b):
    d = epoch - ep[b]
    return 0 if d >= 63 else cnt[b] >> d


@numba.njit(cache=True)
def _lists_kernel(flat, offsets, hittable, inserted, n_blocks, cap, code, arg, lk, hd, evb, evr):
    # code: 0 lru, 1 fifo, 2 slru (arg: protected cap, -1 none), 3 s3fifo (arg: small percent),
    # 4 arc, 5 tinylfu (arg: sample size, -1 none)
    hits, resident = new_replay(hittable, n_blocks)
    freq = np.zeros(len(resident), np.int64)    # s3fifo counts; tinylfu counts
    ep = np.zeros(len(resident), np.int64)      # tinylfu: epoch a count was written in
    ghost_cap = cap - cap * arg // 100 if code == 3 else 0
    p = 0          # arc: T1's target size
    epoch = 0      # tinylfu
    sampled = 0
    n_ev = 0
    for r in range(len(hittable)):
        s = lookup(flat, offsets, hittable, resident, hits, r)
        for j in range(inserted[r] - 1, -1, -1):
            b = flat[s + j]
            if code == 5:
                f = _tiny_freq(freq, ep, epoch, b) + 1
                freq[b] = f
                ep[b] = epoch
                if arg >= 0:
                    sampled += 1
                    if sampled >= arg:
                        epoch += 1
                        sampled = 0
            if resident[b]:
                if code == 0 or code == 4 or code == 5:
                    move_last(lk, hd, 1 if code != 0 else 0, b)
                elif code == 2:
                    move_last(lk, hd, 1, b)
                    while arg >= 0 and hd[2, 1] > arg:
                        move_last(lk, hd, 0, hd[0, 1])
                elif code == 3:
                    freq[b] = min(freq[b] + 1, 3)
                continue
            resident[b] = True
            if code == 3:
                freq[b] = 0
                if lk[2, b] == 2:
                    move_last(lk, hd, 1, b)
                else:
                    push_last(lk, hd, 0, b)
            elif code == 4 and lk[2, b] == 2:
                p = min(cap, p + max(1, hd[2, 3] // hd[2, 2]))
                move_last(lk, hd, 1, b)
            elif code == 4 and lk[2, b] == 3:
                p = max(0, p - max(1, hd[2, 2] // hd[2, 3]))
                move_last(lk, hd, 1, b)
            else:
                push_last(lk, hd, 0, b)
        if cap < 0:
            continue
        while hd[2, 0] + (hd[2, 1] if code >= 2 else 0) > cap:
            if code <= 1:
                v = hd[0, 0]
                unlink(lk, hd, v)
            elif code == 2:
                v = hd[0, 0] if hd[2, 0] > 0 else hd[0, 1]
                unlink(lk, hd, v)
            elif code == 3:
                v = _s3fifo_victim(lk, hd, freq, cap, arg, ghost_cap)
            elif code == 4:
                v = hd[0, 0]
                if v >= 0 and (hd[2, 1] == 0 or hd[2, 0] > p):
                    move_last(lk, hd, 2, v)
                else:
                    v = hd[0, 1]
                    move_last(lk, hd, 3, v)
                while hd[2, 2] > 0 and hd[2, 0] + hd[2, 2] > cap:
                    unlink(lk, hd, hd[0, 2])
                while hd[2, 3] > 0 and hd[2, 0] + hd[2, 1] + hd[2, 2] + hd[2, 3] > 2 * cap:
                    unlink(lk, hd, hd[0, 3])
            else:
                c, v = hd[0, 0], hd[0, 1]
                if v >= 0 and (c < 0 or _tiny_freq(freq, ep, epoch, c) > _tiny_freq(freq, ep, epoch, v)):
                    if c >= 0:
                        move_last(lk, hd, 1, c)
                    unlink(lk, hd, v)
                else:
                    v = c
                    unlink(lk, hd, v)
            n_ev = evicted(resident, evb, evr, n_ev, v, r)
    return hits, n_ev


@numba.njit(cache=True)
def _s3fifo_victim(lk, hd, freq, cap, small_percent, ghost_cap):
    # lists: 0 small, 1 main, 2 ghost
    while True:
        s, m = hd[0, 0], hd[0, 1]
        if s >= 0 and (m < 0 or 100 * hd[2, 0] >= small_percent * cap):
            if freq[s] >= 1:
                freq[s] = 0
                move_last(lk, hd, 1, s)
                continue
            move_last(lk, hd, 2, s)
            while hd[2, 2] > ghost_cap:
                unlink(lk, hd, hd[0, 2])
            return s
        if freq[m] > 0:
            freq[m] -= 1
            move_last(lk, hd, 1, m)
            continue
        unlink(lk, hd, m)
        return m


def sweep_lists(policy: str, rep, caps, args):
    """Hit blocks per request (rows) at every capacity (columns), capacities in parallel."""
    code = {"lru": 0, "fifo": 1, "slru": 2, "s3fifo": 3, "arc": 4, "tinylfu": 5}[policy]
    return _lists_sweep(rep.flat, rep.offsets, rep.hittable, rep.inserted, rep.n_blocks,
                        np.asarray(caps, np.int64), code, np.asarray(args, np.int64))


@numba.njit(cache=True, parallel=True)
def _lists_sweep(flat, offsets, hittable, inserted, n_blocks, caps, code, args):
    out = np.zeros((len(hittable), len(caps)), np.int64)
    for k in numba.prange(len(caps)):
        lk, hd = new_lists(n_blocks, 4)
        evb, evr = new_log(inserted)
        out[:, k] = _lists_kernel(flat, offsets, hittable, inserted, n_blocks, caps[k], code, args[k],
                                  lk, hd, evb, evr)[0]
    return out
