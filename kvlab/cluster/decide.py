"""Every routing rule as one compiled function: the simulator's kernel and the real router
(kvlab.cluster.router) call the same ``decide``, so a rule is written once.

A rule maps (the request's blocks, what a view says each instance holds, each instance's load)
to an instance. Inputs, one entry per instance (int64 / float64 arrays of length N):
``match`` leading blocks of the request the view says the instance holds; ``running`` requests
routed there and not finished; ``wait`` seconds until its prefill queue is free; ``usage`` its
cache's fill (0..1); ``vsize`` blocks the view holds for it; ``work`` prefill seconds routed there
within Preble's window; ``active`` blocks of its unfinished requests (prompt + output, Dynamo's
decode blocks); ``up`` whether it may be chosen. Per request: ``nblk`` its hittable blocks,
``prompt`` / ``out`` tokens, ``session`` a 64-bit hash of its session. ``prm`` holds the shared
slots (``P_*``: the prefill cost model t = a + b·new + c·new·cached + d·new², decode seconds per
token, block size) and the rule's own parameters from ``P_RULE`` on (kvlab.cluster.routers names
them). ``st`` is the rule's state: ``st[0]`` a splitmix64 random state, ``st[1]`` round robin's
counter. ``scores`` receives each instance's score (what /kvlab/route rows show). Ties go to the
lowest index, so a replay is deterministic. Returns the instance, or -1 when none is up.

Example:
    >>> decide(R_ROUND_ROBIN, prm, st, match, 4, 64, 8, running, wait, usage, vsize, work, active, up,
    ...        ring_pos, ring_own, 0, scores)
    0
"""

from __future__ import annotations

import numba
import numpy as np

# shared parameter slots
P_A, P_B, P_C, P_D, P_DECODE, P_BLOCK, P_RULE = 0, 1, 2, 3, 4, 5, 8
(R_RANDOM, R_ROUND_ROBIN, R_LEAST_LOADED, R_POWER_OF_TWO, R_SESSION, R_SGLANG, R_RAY, R_AIBRIX,
 R_LLMD, R_DYNAMO, R_PREBLE, R_MOONCAKE) = range(12)
MASK64 = (1 << 64) - 1


@numba.njit(cache=True)
def splitmix(x):
    """One splitmix64 step: a well-mixed 64-bit value of ``x`` (numba and Python agree)."""
    z = np.uint64(x) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@numba.njit(cache=True)
def _draw(st, n):
    """A uniform int in [0, n) from the state ``st[0]``, which advances."""
    st[0] = np.int64(splitmix(st[0]))
    return np.int64(np.uint64(st[0]) % np.uint64(n))


@numba.njit(cache=True)
def prefill_s(prm, cached, new):
    """The cost model's prefill seconds of ``new`` tokens on ``cached`` ones."""
    return prm[P_A] + prm[P_B] * new + prm[P_C] * new * cached + prm[P_D] * new * new


@numba.njit(cache=True)
def _argmin(values, up):
    best = -1
    for i in range(len(values)):
        if up[i] and (best < 0 or values[i] < values[best]):
            best = i
    return best


@numba.njit(cache=True)
def least_loaded(running, up):
    return _argmin(running, up)


@numba.njit(cache=True)
def _random_up(st, up):
    n = 0
    for i in range(len(up)):
        n += up[i]
    if n == 0:
        return -1
    k = _draw(st, n)
    for i in range(len(up)):
        if up[i]:
            if k == 0:
                return i
            k -= 1
    return -1


@numba.njit(cache=True)
def _power_of_two(st, running, up):
    a = _random_up(st, up)
    n = 0
    for i in range(len(up)):
        n += up[i]
    if n < 2:
        return a
    b = a
    while b == a:
        b = _random_up(st, up)
    return b if running[b] < running[a] else a


@numba.njit(cache=True)
def _loads(running, up):
    lo, hi, total, n = np.int64(1) << 62, np.int64(-1), 0.0, 0
    for i in range(len(running)):
        if up[i]:
            lo, hi = min(lo, running[i]), max(hi, running[i])
            total += running[i]
            n += 1
    return lo, hi, total, n


@numba.njit(cache=True)
def _ring(ring_pos, ring_own, session, up):
    """Consistent hashing: the first up owner clockwise from the session's point on the ring."""
    m = len(ring_pos)
    j = np.searchsorted(ring_pos, np.uint64(session))
    for step in range(m):
        own = ring_own[(j + step) % m]
        if up[own]:
            return own
    return -1


@numba.njit(cache=True)
def _best_match(match, running, up, limit):
    """The up instance with the longest match among those with running <= limit (ties: lighter, then lower)."""
    best = -1
    for i in range(len(match)):
        if up[i] and running[i] <= limit and (best < 0 or match[i] > match[best]
                                              or (match[i] == match[best] and running[i] < running[best])):
            best = i
    return best


@numba.njit(cache=True)
def decide(code, prm, st, match, nblk, prompt, out, running, wait, usage, vsize, work, active, up,
           ring_pos, ring_own, session, scores):
    """The instance rule ``code`` picks (module docstring); -1 when no instance is up."""
    n = len(match)
    bs = prm[P_BLOCK]
    q = P_RULE
    for i in range(n):
        scores[i] = 0.0
    lo, hi, total, n_up = _loads(running, up)
    if n_up == 0:
        return -1
    if code == R_RANDOM:
        return _random_up(st, up)
    if code == R_ROUND_ROBIN:
        k = st[1] % n
        st[1] += 1
        while not up[k]:
            k = (k + 1) % n
        return k
    if code == R_LEAST_LOADED:
        for i in range(n):
            scores[i] = running[i]
        return least_loaded(running, up)
    if code == R_POWER_OF_TWO:
        return _power_of_two(st, running, up)
    if code == R_SESSION:
        return _ring(ring_pos, ring_own, session, up)
    for i in range(n):
        scores[i] = match[i] * bs / max(prompt, 1)
    if code == R_SGLANG:  # cache_threshold, balance_abs, balance_rel, fix_miss_load, fix_rebalance
        if hi - lo > prm[q + 1] and hi > prm[q + 2] * lo:
            if prm[q + 4] > 0:
                k = _best_match(match, running, up, lo + prm[q + 1])
                if match[k] > 0:
                    return k
            return least_loaded(running, up)
        k = _best_match(match, running, up, np.int64(1) << 62)
        if scores[k] >= prm[q]:
            return k
        if prm[q + 3] > 0:
            return least_loaded(running, up)
        best = -1  # the smallest tree; among equals the least loaded
        for i in range(n):
            if up[i] and (best < 0 or vsize[i] < vsize[best]
                          or (vsize[i] == vsize[best] and running[i] < running[best])):
                best = i
        return best
    if code == R_RAY:  # imbalanced_threshold, match_rate_threshold
        if hi - lo > prm[q]:
            return _power_of_two(st, running, up)
        k = _best_match(match, running, up, np.int64(1) << 62)
        if scores[k] >= prm[q + 1]:
            return k
        small = np.int64(1) << 62
        for i in range(n):
            if up[i]:
                small = min(small, vsize[i])
        best = -1
        for i in range(n):
            if up[i] and vsize[i] == small and (best < 0 or running[i] < running[best]):
                best = i
        return best
    if code == R_AIBRIX:  # imbalance_abs, std_factor
        if hi - lo > prm[q]:
            return least_loaded(running, up)
        mean = total / n_up
        var = 0.0
        for i in range(n):
            if up[i]:
                var += (running[i] - mean) ** 2
        k = _best_match(match, running, up, mean + prm[q + 1] * np.sqrt(var / n_up))
        if k >= 0 and match[k] > 0:
            return k
        return least_loaded(running, up)
    if code == R_LLMD:  # w_prefix, w_queue, w_kv
        best = -1
        for i in range(n):
            prefix = match[i] / nblk if nblk > 0 else 0.0
            queue = 1.0 if hi == lo else (hi - running[i]) / (hi - lo)
            scores[i] = prm[q] * prefix + prm[q + 1] * queue + prm[q + 2] * (1.0 - usage[i])
            if up[i] and (best < 0 or scores[i] > scores[best]):
                best = i
        return best
    if code == R_DYNAMO:  # overlap_weight, temperature
        req = -(-(prompt + out) // np.int64(bs))
        for i in range(n):
            scores[i] = prm[q] * max(nblk - match[i], 0) + active[i] + req
        if prm[q + 1] <= 0:
            return _argmin(scores, up)
        top = 0.0
        for i in range(n):
            if up[i]:
                top = max(top, scores[i])
        weights = np.zeros(n)
        acc = 0.0
        for i in range(n):
            if up[i]:
                weights[i] = np.exp(-scores[i] / max(top, 1e-12) / prm[q + 1])
                acc += weights[i]
        st[0] = np.int64(splitmix(st[0]))
        x = (np.uint64(st[0]) >> np.uint64(11)) * (1.0 / 9007199254740992.0) * acc
        for i in range(n):
            if up[i]:
                x -= weights[i]
                if x < 0:
                    return i
        return _argmin(scores, up)
    if code == R_PREBLE:  # window_s (the kernel keeps ``work``)
        k = -1  # the longest cached prefix, the least recent work among equals
        for i in range(n):
            if up[i] and (k < 0 or match[i] > match[k] or (match[i] == match[k] and work[i] < work[k])):
                k = i
        for i in range(n):
            scores[i] = work[i] + prefill_s(prm, match[i] * bs, prompt - match[i] * bs)
        if match[k] * bs > prompt - match[k] * bs:  # exploit: the cached prefix is longer than the new part
            return k
        return _argmin(scores, up)
    if code == R_MOONCAKE:
        for i in range(n):
            scores[i] = wait[i] + prefill_s(prm, match[i] * bs, prompt - match[i] * bs)
        return _argmin(scores, up)
    return -1


def mix64(x: np.ndarray) -> np.ndarray:
    """:func:`splitmix` over a uint64 array, in numpy (no compilation).

    Example:
        >>> int(mix64(np.array([7], np.uint64))[0]) == int(splitmix(7))
        True
    """
    with np.errstate(over="ignore"):
        z = np.asarray(x).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def session_ring(n: int, vnodes: int = 100, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A consistent-hash ring of ``n`` instances with ``vnodes`` points each: (sorted positions
    as uint64, each point's instance). Removing an instance moves only its own sessions.

    Example:
        >>> pos, own = session_ring(2, vnodes=3)
        >>> len(pos), sorted(set(own.tolist()))
        (6, [0, 1])
    """
    points = [(int(splitmix((seed << 32) ^ (i << 16) ^ v)), i) for i in range(n) for v in range(vnodes)]
    points.sort()
    return (np.array([p for p, _ in points], dtype=np.uint64), np.array([i for _, i in points], dtype=np.int64))
