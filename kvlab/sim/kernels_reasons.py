"""Why each missed prompt token missed (kvlab.policies.reasons), from any replay's hits and
eviction log: one compiled pass that replays residency (every inserted block is resident until
the log evicts it) and classifies the missed tokens of each request."""

from __future__ import annotations

import numba
import numpy as np

# column order of the result: kvlab.policies.reasons.MISS_REASONS
FIRST_SEEN, EVICTED, DIVERGED, PARTIAL, SALT, OVER = range(6)


def explain(rep, cap, hits, ev_block, ev_req):
    """Tokens per reason (int64 [requests, 6]) and, per request, the replay row whose insertion
    evicted its first evicted missed block (-1: none)."""
    unkeyed, n_unkeyed = rep.unkeyed_flat()
    return _reasons_kernel(rep.flat, unkeyed, rep.offsets, rep.hittable, rep.inserted, rep.tokens,
                           rep.n_blocks, n_unkeyed, rep.block_size, -1 if cap is None else cap,
                           hits, ev_block, ev_req)


@numba.njit(cache=True)
def _reasons_kernel(flat, unkeyed, offsets, hittable, inserted, tokens, n_blocks, n_unkeyed, bs,
                    cap, hits, ev_block, ev_req):
    n_req = len(hittable)
    out = np.zeros((n_req, 6), np.int64)
    by = np.full(n_req, -1, np.int64)
    nb = max(1, n_blocks)
    resident = np.zeros(nb, np.bool_)
    ever = np.zeros(nb, np.bool_)
    had_child = np.zeros(nb, np.bool_)
    evicted_by = np.full(nb, -1, np.int64)
    ever_unkeyed = np.zeros(max(1, n_unkeyed), np.bool_)
    e = 0
    for r in range(n_req):
        s = offsets[r]
        h = hittable[r]
        out[r, PARTIAL] = tokens[r] - h * bs
        lim = h if cap < 0 else min(h, cap)
        out[r, OVER] = (h - lim) * bs
        prev = -1
        chain = -1  # reason of the prompt's first never-cached block: diverged or first_seen
        for j in range(hits[r], lim):
            b = flat[s + j]
            if resident[b]:
                reason = prev
            else:
                if ever[b]:
                    reason = EVICTED
                    if by[r] < 0:
                        by[r] = evicted_by[b]
                elif ever_unkeyed[unkeyed[s + j]]:
                    reason = SALT
                else:
                    if chain < 0:
                        chain = DIVERGED if j > 0 and had_child[flat[s + j - 1]] else FIRST_SEEN
                    reason = chain
                prev = reason
            out[r, reason] += bs
        for j in range(inserted[r]):
            b = flat[s + j]
            resident[b] = True
            ever[b] = True
            ever_unkeyed[unkeyed[s + j]] = True
            if j > 0:
                had_child[flat[s + j - 1]] = True
        while e < len(ev_block) and ev_req[e] == r:
            resident[ev_block[e]] = False
            evicted_by[ev_block[e]] = r
            e += 1
    return out, by
