"""The plain-Python cluster replay: kvlab.policies' own definitions as each instance's cache,
kvlab.cluster.views (which a live router reads too) as the approximate and stale views, heapq as
the queue of finishing requests. It follows
kvlab.cluster.kernel step for step and is what that kernel is tested equal to; it also runs the
eviction policies the kernel does not compile (every name in kvlab.policies but belady).

``round_robin`` and the ceilings route here without kvlab.cluster.decide (request i to i mod N;
the least loaded instance), so those two are checked against code written twice.
"""

from __future__ import annotations

import heapq

import numpy as np

from ..policies import Unit, make_policy
from .decide import R_ROUND_ROBIN, decide
from .views import KINDS, BlockViews


def _prefill(prm, cached, new):
    return prm[0] + prm[1] * new + prm[2] * new * cached + prm[3] * new * new


def reference(spec: dict, policy: str) -> tuple:
    """Replay ``spec`` (kvlab.cluster.simulate's arrays and settings) in plain Python; returns
    (instance, hit blocks, TTFT s, view match) per request, as cluster_kernel does."""
    flat, offsets = spec["flat"].tolist(), spec["offsets"].tolist()
    hittable, inserted = spec["hittable"].tolist(), spec["inserted"].tolist()
    tokens, outs, arrival = spec["tokens"].tolist(), spec["outs"].tolist(), spec["arrival"].tolist()
    n, prm, cap = spec["n_inst"], spec["prm"], spec["cap"]
    bs = int(prm[5])
    kind, delay, vcap, ttl = spec["view_kind"], spec["delay"], spec["vcap"], spec["ttl"]
    given, window = spec["given"], spec["window_s"]
    st = spec["st"].copy()
    pols = [make_policy(policy, None if cap < 0 else cap) for _ in range(n)]
    view = BlockViews(n, KINDS[kind], delay, vcap, ttl)
    heap: list = []
    running, active, work, free_at = [0] * n, [0] * n, [0.0] * n, [0.0] * n
    inst, hits, ttft, vmatch, pre = [0] * len(tokens), [0] * len(tokens), [0.0] * len(tokens), [0] * len(tokens), []
    wh = 0
    scores = np.zeros(n)
    for r in range(len(tokens)):
        t = arrival[r]
        while heap and heap[0][0] <= t:
            _, j = heapq.heappop(heap)
            running[inst[j]] -= 1
            active[inst[j]] -= -(-(tokens[j] + outs[j]) // bs)
        while wh < r and arrival[wh] < t - window:
            work[inst[wh]] -= pre[wh]
            wh += 1
        view.advance(t)
        s, h = offsets[r], hittable[r]
        ids = flat[s:offsets[r + 1]]
        if given[0] >= 0:
            k = min(range(n), key=lambda i: (running[i], i))
            hits[r] = int(given[r])
        else:
            match = (np.array([_run(ids, h, pols[i].__contains__) for i in range(n)], np.int64) if kind == 0
                     else view.match(ids, h))
            if spec["code"] == R_ROUND_ROBIN:
                k = r % n
            else:
                sizes = [len(p) for p in pols]
                vsize = np.array([view.size(i) if kind == 1 else sizes[i] for i in range(n)], np.int64)
                k = int(decide(spec["code"], prm, st, match, h, tokens[r], outs[r], np.array(running, np.int64),
                               np.array([max(0.0, f - t) for f in free_at]),
                               np.array([x / cap if cap > 0 else 0.0 for x in sizes]), vsize,
                               np.array(work), np.array(active, np.int64), np.ones(n, np.bool_),
                               spec["ring_pos"], spec["ring_own"], spec["session"][r], scores))
            vmatch[r] = int(match[k])
            hits[r] = _run(ids, h, pols[k].__contains__)
            for j in range(inserted[r] - 1, -1, -1):
                new = ids[j] not in pols[k]
                pols[k].access(Unit(ids[j], 1, j * bs, bs, ids[j - 1] if j else None))
                if new and kind == 2:
                    view.stored(t, k, [ids[j]])
            view.routed(t, k, ids[:inserted[r]])
            while cap >= 0 and pols[k].size > cap:
                b = pols[k].victim()
                if kind == 2:
                    view.removed(t, k, [b])
        inst[r] = k
        pre.append(_prefill(prm, hits[r] * bs, tokens[r] - hits[r] * bs))
        free_at[k] = max(t, free_at[k]) + pre[r]
        ttft[r] = free_at[k] - t
        heapq.heappush(heap, (free_at[k] + outs[r] * prm[4], r))
        running[k] += 1
        active[k] += -(-(tokens[r] + outs[r]) // bs)
        work[k] += pre[r]
    return tuple(np.asarray(x) for x in (inst, hits, ttft, vmatch))


def _run(ids, h, held) -> int:
    k = 0
    while k < h and held(ids[k]):
        k += 1
    return k
