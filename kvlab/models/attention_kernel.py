"""The compiled loops of kvlab's CPU attention (``kvlab.models.cpu_attention`` prepares their inputs).

One task per (batch, query head, block of query rows), run in parallel by numba: the block's scores
against only the keys some row of it can see (causal block skipping), its masks, a softmax whose
``exp`` is a vectorisable polynomial (MLX's CPU ``exp`` is scalar, ~40M values/s), and the
weighted sum of values, all while the block's scores stay in the core's cache (flash attention's
order, without the online rescaling: a block's row of scores fits).

Semantics are MLX's (``mlx/fast.cpp``, the fallback of ``scaled_dot_product_attention``): queries
scaled before the product; a boolean mask sets hidden scores to float32's lowest value (a fully
hidden row averages every value), an additive one is added; a sink is one more logit per head.
A key outside a row's visible range [lo, hi) gets probability exactly 0, as MLX's exp gives it.
"""

from __future__ import annotations

import numba
import numpy as np

LOWEST = np.float32(np.finfo(np.float32).min)
# reassociation (vectorised reductions) and contraction (FMA), but no "no NaNs / no infinities":
# additive masks carry -inf and a row of them must give MLX's NaN
FLAGS = {"reassoc", "contract", "nsz", "arcp"}
MODE_NONE, MODE_CAUSAL, MODE_BOOL, MODE_ADD = 0, 1, 2, 3


@numba.njit(fastmath=FLAGS, cache=True, inline="always")
def _exp(x, bits):
    """x = exp(x) in place, returning the sum: MLX's own CPU exp (mlx/backend/cpu/simd/math.h:
    2**(x log2 e) as a degree-6 polynomial of the fraction times 2**integer built from its bits,
    0 below -88), the same operations in the same order, so a probability here is MLX's to the
    bit where LLVM contracts as MLX's fma does. Branch-free, so LLVM vectorises both loops.
    Every loop here and in ``attend`` counts from 0 over a slice: numba wraps negative indices,
    and a loop from a runtime start keeps that check and does not vectorise (10x slower)."""
    scale = bits.view(np.float32)
    for j in range(x.shape[0]):
        v = x[j]
        y = v * np.float32(1.442695)
        n = np.floor(y + np.float32(0.5))
        f = y - n
        p = np.float32(1.535336188319500e-4)
        p = p * f + np.float32(1.339887440266574e-3)
        p = p * f + np.float32(9.618437357674640e-3)
        p = p * f + np.float32(5.550332471162809e-2)
        p = p * f + np.float32(2.402264791363012e-1)
        p = p * f + np.float32(6.931472028550421e-1)
        p = p * f + np.float32(1.0)
        x[j] = np.float32(0.0) if v < np.float32(-88.0) else p
        bits[j] = (np.int32(max(n, np.float32(-127.0))) + np.int32(127)) << 23
    total = np.float32(0.0)
    for j in range(x.shape[0]):
        e = x[j] * scale[j]
        x[j] = e
        total += e
    return total


@numba.njit(fastmath=FLAGS, cache=True)
def exp_in_place(x):
    """``x = exp(x)`` for a float32 vector of values <= 0, as the kernel computes it; returns the
    sum (how tests check the polynomial against float64)."""
    return _exp(x, np.empty(x.shape[0], np.int32))


@numba.njit(cache=True, inline="always")
def _mask_row(mask, b, h, r):
    """Row ``r`` of ``mask`` for batch ``b``, head ``h``; a dimension of size 1 broadcasts."""
    return mask[b if mask.shape[0] > 1 else 0, h if mask.shape[1] > 1 else 0, r if mask.shape[2] > 1 else 0]


@numba.njit(cache=True)
def _row_range(mode, brow, arow, r, S, offset):
    """The keys row ``r`` sees: [lo, hi); a row that sees none gets [0, S) (MLX then averages
    every value for a boolean mask, and gives NaN for an additive one of -inf)."""
    if mode == MODE_NONE:
        return 0, S
    if mode == MODE_CAUSAL:
        return 0, min(S, offset + r + 1)
    lo, hi = S, 0
    wide = (brow.shape[0] if mode == MODE_BOOL else arow.shape[0]) > 1
    for j in range(S):
        jj = j if wide else 0
        if brow[jj] if mode == MODE_BOOL else arow[jj] > -np.inf:
            lo = min(lo, j)
            hi = j + 1
    if hi == 0:
        return 0, S
    return lo, hi


@numba.njit(fastmath=FLAGS, cache=True, inline="always")
def _score_rows(r0, r1, q0, q1, kt, klo, width, scale, pair):
    """r0 (and r1 if ``pair``) += scale * q0 (q1) @ kt[:, klo:klo + width], four of D per pass;
    a lone row goes through the same additions as a paired one, so a score never depends on
    which rows share its block."""
    D = q0.shape[0]
    D4 = D - D % 4
    for d in range(0, D4, 4):
        a0, a1, a2, a3 = q0[d] * scale, q0[d + 1] * scale, q0[d + 2] * scale, q0[d + 3] * scale
        b0, b1, b2, b3 = q1[d] * scale, q1[d + 1] * scale, q1[d + 2] * scale, q1[d + 3] * scale
        k0, k1 = kt[d, klo:klo + width], kt[d + 1, klo:klo + width]
        k2, k3 = kt[d + 2, klo:klo + width], kt[d + 3, klo:klo + width]
        if pair:
            for j in range(width):
                x0, x1, x2, x3 = k0[j], k1[j], k2[j], k3[j]
                r0[j] += a0 * x0 + a1 * x1 + a2 * x2 + a3 * x3
                r1[j] += b0 * x0 + b1 * x1 + b2 * x2 + b3 * x3
        else:
            for j in range(width):
                r0[j] += a0 * k0[j] + a1 * k1[j] + a2 * k2[j] + a3 * k3[j]
    for d in range(D4, D):
        a0, b0 = q0[d] * scale, q1[d] * scale
        kd = kt[d, klo:klo + width]
        for j in range(width):
            r0[j] += a0 * kd[j]
            if pair:
                r1[j] += b0 * kd[j]


@numba.njit(fastmath=FLAGS, cache=True, inline="always")
def _score_row_keys(r0, q0, k, klo, width, scale):
    """``_score_rows`` for one row from keys as they are stored ([S, D]): the same additions in
    the same order (so the same bits), reading each key's dims with a stride. Slower per row
    than the transposed keys (~5x), but it saves transposing the keys when a call has only a
    few rows (a decode step)."""
    D = q0.shape[0]
    D4 = D - D % 4
    for d in range(0, D4, 4):
        a0, a1, a2, a3 = q0[d] * scale, q0[d + 1] * scale, q0[d + 2] * scale, q0[d + 3] * scale
        for j in range(width):
            kj = k[klo + j]
            r0[j] += a0 * kj[d] + a1 * kj[d + 1] + a2 * kj[d + 2] + a3 * kj[d + 3]
    for d in range(D4, D):
        a0 = q0[d] * scale
        for j in range(width):
            r0[j] += a0 * k[klo + j, d]


@numba.njit(fastmath=FLAGS, cache=True)
def _scores(q, k, kt, klo, width, scale, s):
    """s[:, :width] = scale * q @ kt[:, klo:klo + width] (the rest of s: 0) for q [rows, D], kt
    [D, S] (or, when kt is empty, the same from k [S, D]): two rows and four of D per pass, so each loaded key feeds eight multiply-adds (one at
    a time it is L2-bound: ~30 against ~60 GFLOP/s a core, measured). ``kt`` comes whole and each
    row is sliced here: a 2-D slice would be strided to numba, which then does not vectorise."""
    rows = q.shape[0]
    s[:] = 0
    if kt.shape[1] == 0:  # no transposed keys: score from k as stored
        for i in range(rows):
            _score_row_keys(s[i], q[i], k, klo, width, scale)
        return
    for i in range(0, rows - rows % 2, 2):
        _score_rows(s[i], s[i + 1], q[i], q[i + 1], kt, klo, width, scale, True)
    if rows % 2:
        _score_rows(s[rows - 1], s[rows - 1], q[rows - 1], q[rows - 1], kt, klo, width, scale, False)


@numba.njit(fastmath=FLAGS, cache=True)
def _weighted(p, v, klo, width, acc):
    """acc = p[:, :width] @ v[klo:klo + width] for p [rows, width rounded up to 8], v [S, D]:
    eight keys per pass against every row, so the rows' sums stay in L1 and each value row is
    read once. ``klo`` is a multiple of 8 and the last group is padded with zero rows, so a key
    is always summed in the same group of eight: a row's output does not depend on its block."""
    rows = p.shape[0]
    D = v.shape[1]
    acc[:] = 0
    pad = np.zeros((8, D), np.float32)
    for j in range(0, width, 8):
        if j + 8 <= width:
            g = v[klo + j:klo + j + 8]
        else:
            pad[:width - j] = v[klo + j:klo + width]
            g = pad
        v0, v1, v2, v3, v4, v5, v6, v7 = g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7]
        for i in range(rows):
            pi = p[i, j:j + 8]
            ai = acc[i]
            for d in range(D):
                ai[d] += ((pi[0] * v0[d] + pi[1] * v1[d] + pi[2] * v2[d] + pi[3] * v3[d])
                          + (pi[4] * v4[d] + pi[5] * v5[d] + pi[6] * v6[d] + pi[7] * v7[d]))


@numba.njit(parallel=True, fastmath=FLAGS, cache=True)
def attend(q, k, kt, v, out, S, scale, mode, offset, bmask, amask, sinks, bq):
    """out = softmax(scale * q @ k[:, :, :S].T + mask) @ v[:, :, :S] per head, in place.

    q, out: [B, Hq, L, D] float32; k, v: [B, Hk, >= S, D] (a cache's buffers: rows past S are
    never read); kt: k transposed, [B, Hk, D, S], or [B, Hk, 0, 0] to score from k itself;
    ``mode``: MODE_*; ``offset``: S - L (causal); ``bmask`` (bool) / ``amask`` (float32): the array
    mask, 4-D, each dimension its full size or 1 (broadcast; a 1x1x1x1 placeholder when unused);
    ``sinks``: [Hq] or empty; ``bq``: query rows per task."""
    B, Hq, L, D = q.shape
    Hk = k.shape[1]
    rep = Hq // Hk
    nb = (L + bq - 1) // bq
    has_sinks = sinks.shape[0] > 0
    for task in numba.prange(B * Hq * nb):
        b = task // (Hq * nb)
        h = (task // nb) % Hq
        i0 = (task % nb) * bq
        rows = min(L, i0 + bq) - i0
        g = h // rep
        lo = np.empty(rows, np.int64)
        hi = np.empty(rows, np.int64)
        klo, khi = S, 0
        for i in range(rows):
            lo[i], hi[i] = _row_range(mode, _mask_row(bmask, b, h, i0 + i), _mask_row(amask, b, h, i0 + i),
                                      i0 + i, S, offset)
            klo = min(klo, lo[i])
            khi = max(khi, hi[i])
        klo -= klo % 8  # groups of eight keys at fixed positions (``_weighted``)
        width = khi - klo
        s = np.empty((rows, (width + 7) // 8 * 8), np.float32)
        _scores(q[b, h, i0:i0 + rows], k[b, g], kt[b, g], klo, width, scale, s)
        bits = np.empty(width, np.int32)
        inv = np.empty(rows, np.float32)
        for i in range(rows):
            a, z = lo[i] - klo, hi[i] - klo
            s[i, :a] = 0
            s[i, z:] = 0
            row = s[i, a:z]
            r = i0 + i
            if mode == MODE_BOOL:
                brow = _mask_row(bmask, b, h, r)
                wide = brow.shape[0] > 1
                for j in range(z - a):
                    if not brow[klo + a + j if wide else 0]:
                        row[j] = LOWEST
            elif mode == MODE_ADD:
                arow = _mask_row(amask, b, h, r)
                if arow.shape[0] > 1:
                    arow = arow[klo + a:klo + z]
                    for j in range(z - a):
                        row[j] += arow[j]
                else:
                    for j in range(z - a):
                        row[j] += arow[0]
            m = -np.inf
            for j in range(z - a):
                m = max(m, row[j])
            if has_sinks:
                m = max(m, np.float32(sinks[h]))
            if m == -np.inf or m != m:  # every logit -inf (or NaN): MLX's softmax gives NaN
                row[:] = 0
                inv[i] = np.nan
                continue
            for j in range(z - a):
                row[j] -= m
            total = _exp(row, bits[:z - a])
            if has_sinks:
                total += np.float32(np.exp(np.float32(sinks[h]) - m))
            inv[i] = np.float32(1.0) / total
        acc = np.empty((rows, D), np.float32)
        _weighted(s, v[b, g], klo, width, acc)
        for i in range(rows):
            for d in range(D):
                out[b, h, i0 + i, d] = acc[i, d] * inv[i]


@numba.njit(parallel=True, fastmath=FLAGS, cache=True)
def softmax_rows(x, bits):
    """Each row of the C-contiguous float32 matrix ``x`` replaced by its softmax, in place, with
    ``_exp`` (MLX's CPU exp) and MLX's order: subtract the row's maximum, exponentiate, multiply
    by the sum's reciprocal. A row of -inf becomes NaN, as MLX's. ``bits``: int32 scratch of x's
    shape."""
    for r in numba.prange(x.shape[0]):
        row = x[r]
        top = -np.inf
        for j in range(row.shape[0]):
            top = max(top, row[j])
        for j in range(row.shape[0]):
            row[j] = row[j] - top
        scale = np.float32(1.0) / _exp(row, bits[r])
        for j in range(row.shape[0]):
            row[j] = row[j] * scale
