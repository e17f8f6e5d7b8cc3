"""The plain-Python replay: kvlab.policies' definitions driven through the simulator's
semantics, with each missed token's reason worked out from the live state. Every compiled
kernel (and the reason pass) is tested equal to this."""

from __future__ import annotations

import numpy as np

from ..policies import NEVER, Unit, make_policy
from .prepare import PreparedTrace, Replayed

FIRST_SEEN, EVICTED, DIVERGED, PARTIAL, SALT, OVER = range(6)  # MISS_REASONS order


def next_uses_python(rep: PreparedTrace) -> list[int]:
    """Per inserted block reference: the next request that accesses the block, if that access
    can hit it; NEVER if it cannot (it re-inserts the block for free) or never comes."""
    flat, nxt, seen = rep.flat.tolist(), [NEVER] * len(rep.flat), {}
    for r in range(len(rep.tokens) - 1, -1, -1):
        s, h, ins = int(rep.offsets[r]), int(rep.hittable[r]), int(rep.inserted[r])
        for j in range(ins):
            nxt[s + j] = seen.get(flat[s + j], NEVER)
        for j in reversed(range(ins)):
            seen[flat[s + j]] = r if j < h else NEVER
    return nxt


def run_python(rep: PreparedTrace, policy: str, cap: int | None, params: dict | None = None, *,
               reasons: bool = True) -> Replayed:
    """One replay through the plain-Python definition (``policy="infinite"``: LRU, no capacity).

    Per request: hit the leading run of resident blocks within the first n-1 tokens; explain
    every missed token (unless ``reasons=False``); access the request's full blocks tail first
    (so its head ends most recent); then evict until the resident size is at most ``cap`` blocks.
    """
    pol = make_policy("lru" if policy == "infinite" else policy, cap, **(params or {}))
    flat, unkeyed = rep.flat.tolist(), rep.unkeyed_flat()[0].tolist()
    nxt = next_uses_python(rep) if pol.offline else None
    prio, bs = rep.priorities().tolist(), rep.block_size
    n_req = len(rep.tokens)
    hits = np.zeros(n_req, np.int64)
    table = np.zeros((n_req, 6), np.int64)
    by = np.full(n_req, -1, np.int64)
    ever, ever_unkeyed, had_child, evictor = set(), set(), set(), {}
    log_b, log_r = [], []
    for r in range(n_req):
        s, h, ins = int(rep.offsets[r]), int(rep.hittable[r]), int(rep.inserted[r])
        ids = flat[s:int(rep.offsets[r + 1])]
        k = 0
        while k < h and ids[k] in pol:
            k += 1
        hits[r] = k
        # -- why the rest missed ------------------------------------------------------------
        if reasons:
            row = table[r]
            row[PARTIAL] = int(rep.tokens[r]) - h * bs
            lim = h if cap is None else min(h, cap)
            row[OVER] = (h - lim) * bs
            prev = chain = None
            for j in range(k, lim):
                b = ids[j]
                if b in pol:
                    why = prev  # resident, but behind a missing block
                else:
                    if b in ever:
                        why = EVICTED
                        if by[r] < 0:
                            by[r] = evictor[b]
                    elif unkeyed[s + j] in ever_unkeyed:
                        why = SALT
                    else:
                        if chain is None:
                            chain = DIVERGED if j > 0 and ids[j - 1] in had_child else FIRST_SEEN
                        why = chain
                    prev = why
                row[why] += bs
        # -- insert, tail first, then evict down to capacity -------------------------------
        for j in range(ins - 1, -1, -1):
            pol.access(Unit(ids[j], 1, j * bs, bs, ids[j - 1] if j else None, prio[r],
                            nxt[s + j] if nxt is not None else NEVER))
        for j in range(ins if reasons else 0):
            ever.add(ids[j])
            ever_unkeyed.add(unkeyed[s + j])
            if j:
                had_child.add(ids[j - 1])
        while cap is not None and pol.size > cap:
            b = pol.victim()
            evictor[b] = r
            log_b.append(b)
            log_r.append(r)
    log = np.array(log_b, np.int64), np.array(log_r, np.int64)
    return Replayed(hits, *log, table, by) if reasons else Replayed(hits, *log)


def replay_python(rep: PreparedTrace, policy: str, cap: int | None, params: dict | None = None
                  ) -> tuple[np.ndarray, int]:
    """Hit blocks per request and the eviction count: the plain reference for every kernel.

    Example:
        >>> hits, evictions = replay_python(prepare_replay([[1, 2, 3], [1, 2, 4]], 1, 1, None), "lru", 2)
        >>> hits.tolist(), evictions
        ([0, 2], 2)
    """
    out = run_python(rep, policy, cap, params, reasons=False)
    return out.hits, out.evictions
