"""The compiled cluster replay: N instances, each a block cache (LRU or FIFO) and a prefill
queue, requests routed one by one in arrival order by kvlab.cluster.decide.

Per request, at its arrival time t: requests finished by t leave (a min-heap of finish times),
the Preble window forgets work older than ``window_s``, a stale view applies the events older
than t - delay, a TTL view forgets blocks unused for ``ttl``; the view gives each instance's
match (the leading run of the request's hittable blocks it says that instance holds); the rule
picks an instance k; the request hits the leading run instance k really holds, then k's cache
takes its full blocks tail first and evicts down to capacity (the simulator's semantics,
kvlab.sim.simulator), the router's approximate view records them on k likewise, and k's
queue serves it: prefill starts when k is free (FCFS), lasts the cost model's seconds for the
tokens not hit, and its first token ends TTFT; decode (continuous batching) occupies no queue and
ends ``out`` x decode seconds later. ``given >= 0`` (the ceilings) takes the hits from a single
shared cache replayed beforehand and routes to the least loaded instance.

Cache contents evolve in arrival order; time shapes only the queues, the loads and TTFT.
numba caches this kernel keyed on this file: after editing kvlab.cluster.decide or caches,
delete kvlab/cluster/__pycache__ (as for kvlab.sim's kernels).
"""

from __future__ import annotations

import numba
import numpy as np

from . import caches as mc_
from .decide import decide, least_loaded, prefill_s

PRECISE, APPROXIMATE, STALE = 0, 1, 2


@numba.njit(cache=True)
def _heap_push(hk, hv, n, key, val):
    i = n
    while i > 0 and hk[(i - 1) >> 1] > key:
        p = (i - 1) >> 1
        hk[i], hv[i] = hk[p], hv[p]
        i = p
    hk[i], hv[i] = key, val
    return n + 1


@numba.njit(cache=True)
def _heap_pop(hk, hv, n):
    n -= 1
    k, v = hk[n], hv[n]
    i = 0
    while 2 * i + 1 < n:
        c = 2 * i + 1
        if c + 1 < n and hk[c + 1] < hk[c]:
            c += 1
        if k <= hk[c]:
            break
        hk[i], hv[i] = hk[c], hv[c]
        i = c
    if n > 0:
        hk[i], hv[i] = k, v
    return n


@numba.njit(cache=True)
def cluster_kernel(flat, offsets, hittable, inserted, tokens, outs, arrival, session, n_inst, code, prm, st,
                   ring_pos, ring_own, cap, refresh, view_kind, delay, vcap, ttl, given, window_s, ring_size,
                   true_mc, view_mc):
    """Route and serve every request; returns (instance, hit blocks, TTFT s, the view's match on
    the chosen instance) per request. ``cap`` / ``vcap`` blocks per instance (-1: unbounded)."""
    n_req = len(tokens)
    bs = prm[5]
    inst = np.zeros(n_req, np.int64)
    hits = np.zeros(n_req, np.int64)
    ttft = np.zeros(n_req)
    vmatch = np.zeros(n_req, np.int64)
    pre = np.zeros(n_req)
    running = np.zeros(n_inst, np.int64)
    active = np.zeros(n_inst, np.int64)
    free_at = np.zeros(n_inst)
    wait = np.zeros(n_inst)
    usage = np.zeros(n_inst)
    vsize = np.zeros(n_inst, np.int64)
    work = np.zeros(n_inst)
    match = np.zeros(n_inst, np.int64)
    scores = np.zeros(n_inst)
    up = np.ones(n_inst, np.bool_)
    hk = np.zeros(max(1, n_req))
    hv = np.zeros(max(1, n_req), np.int64)
    hn = 0
    wh = 0
    ev_t = np.zeros(max(1, ring_size))
    ev_b = np.zeros(max(1, ring_size), np.int64)
    ev_i = np.zeros(max(1, ring_size), np.int64)  # instance + 1, negative: removed
    e_head = e_tail = 0
    view = true_mc if view_kind == PRECISE else view_mc
    for r in range(n_req):
        t = arrival[r]
        while hn > 0 and hk[0] <= t:
            j = hv[0]
            hn = _heap_pop(hk, hv, hn)
            running[inst[j]] -= 1
            active[inst[j]] -= -(-(tokens[j] + outs[j]) // np.int64(bs))
        while wh < r and arrival[wh] < t - window_s:
            work[inst[wh]] -= pre[wh]
            wh += 1
        if view_kind == STALE:
            while e_head < e_tail and ev_t[e_head % ring_size] <= t - delay:
                x, b = ev_i[e_head % ring_size], ev_b[e_head % ring_size]
                if x > 0:
                    view[0][b] |= np.uint64(1) << np.uint64(x - 1)
                else:
                    view[0][b] &= ~(np.uint64(1) << np.uint64(-x - 1))
                e_head += 1
        if view_kind == APPROXIMATE and ttl > 0:
            for i in range(n_inst):
                while mc_.size(view, i) > 0 and mc_.oldest(view, i)[1] < t - ttl:
                    mc_.evict(view, i)
        s, h = offsets[r], hittable[r]
        if given[0] >= 0:
            k = least_loaded(running, up)
            hits[r] = given[r]
        else:
            alive = (np.uint64(1) << np.uint64(n_inst)) - np.uint64(1) if n_inst < 64 else ~np.uint64(0)
            for i in range(n_inst):
                match[i] = h
                wait[i] = max(0.0, free_at[i] - t)
                usage[i] = mc_.size(true_mc, i) / cap if cap > 0 else 0.0
                vsize[i] = mc_.size(view, i) if view_kind != STALE else mc_.size(true_mc, i)
            for j in range(h):
                held = view[0][flat[s + j]] & alive
                gone = alive & ~held
                if gone:
                    for i in range(n_inst):
                        if (gone >> np.uint64(i)) & np.uint64(1):
                            match[i] = j
                    alive = held
                if not alive:
                    break
            k = decide(code, prm, st, match, h, tokens[r], outs[r], running, wait, usage, vsize, work, active,
                       up, ring_pos, ring_own, session[r], scores)
            vmatch[r] = match[k]
            m = 0
            while m < h and mc_.holds(true_mc, k, flat[s + m]):
                m += 1
            hits[r] = m
            for j in range(inserted[r] - 1, -1, -1):
                b = flat[s + j]
                if mc_.access(true_mc, k, b, t, refresh) and view_kind == STALE:
                    ev_t[e_tail % ring_size], ev_b[e_tail % ring_size], ev_i[e_tail % ring_size] = t, b, k + 1
                    e_tail += 1
                    if e_tail - e_head > ring_size:
                        raise ValueError("kvlab: the stale view's event ring overflowed (a kvlab bug)")
                if view_kind == APPROXIMATE:
                    mc_.access(view_mc, k, b, t, True)
            while cap >= 0 and mc_.size(true_mc, k) > cap:
                b = mc_.evict(true_mc, k)
                if view_kind == STALE:
                    ev_t[e_tail % ring_size], ev_b[e_tail % ring_size], ev_i[e_tail % ring_size] = t, b, -(k + 1)
                    e_tail += 1
                    if e_tail - e_head > ring_size:
                        raise ValueError("kvlab: the stale view's event ring overflowed (a kvlab bug)")
            while view_kind == APPROXIMATE and vcap >= 0 and mc_.size(view_mc, k) > vcap:
                mc_.evict(view_mc, k)
        inst[r] = k
        hit_tokens = hits[r] * np.int64(bs)
        pre[r] = prefill_s(prm, hit_tokens, tokens[r] - hit_tokens)
        start = max(t, free_at[k])
        free_at[k] = start + pre[r]
        ttft[r] = free_at[k] - t
        hn = _heap_push(hk, hv, hn, free_at[k] + outs[r] * prm[4], r)
        running[k] += 1
        active[k] += -(-(tokens[r] + outs[r]) // np.int64(bs))
        work[k] += pre[r]
    return inst, hits, ttft, vmatch
