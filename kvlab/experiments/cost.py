"""Prefill cost model: what a prefix-cache hit is worth in seconds on this machine.

Prefilling ``new`` tokens on top of ``cached`` ones costs

    t = a + b·new + c·new·cached + d·new²

``a``: per call (the last position's output projection, dispatch); ``b``: per new token (the
MLP and projections of every layer); ``c``: each new token attends to every cached key;
``d``: the new tokens attend to each other. Causal attention does half of new² (``d = c/2``) when
the kernel skips masked blocks; a dense masked matmul (MLX on CPU) computes all of it (``d = c``),
so ``d`` is fitted, not fixed. The fit is least squares on relative error (rows weighted by
``1/t``, as MAPE is what is reported) with non-negative coefficients. Times are the minimum over
interleaved repeats: other processes only ever add time.

``fit`` measures on a grid of (cached, new) points and reports the error on held-out points
drawn between them. ``annotate`` turns a ``kv.simulate`` result into estimated seconds;
``sweep_seconds`` does it for many capacities; ``measure_tiers`` / ``crossover`` time restoring a
prefix from RAM and from disk against recomputing it.

Example:
    >>> cost = kv.cost.fit(m)
    >>> cost.mape_holdout < 0.15
    >>> kv.simulate(wl, capacity_tokens=4096, cost=cost).summary["est_ttft_saved_s"]
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
from dataclasses import dataclass, replace

import numpy as np
import polars as pl

from ..errors import KvlabError
from ..keys import CacheKey
from ..primitives import timing
from ..primitives.display import summary_html, table_html

TERMS = ("a", "b", "c", "d")
COLUMNS = ("est_prefill_s", "est_cold_prefill_s", "est_ttft_saved_s")


@dataclass(frozen=True, eq=False)
class CostModel:
    """A fitted prefill cost model (see module docstring) and the points it was fitted on.

    ``points``: one row per (cached, new) point: measured seconds (min over repeats), the median,
    the prediction and ``split`` (``fit`` or ``holdout``).
    """

    a: float
    b: float
    c: float
    d: float
    model: str
    points: pl.DataFrame

    def predict(self, cached, new):
        """Estimated prefill seconds for ``new`` tokens on ``cached`` ones (scalars or arrays).

        Example:
            >>> cost.predict(0, 1000) > cost.predict(900, 100)
            True
        """
        cached, new = np.asarray(cached, dtype=np.float64), np.asarray(new, dtype=np.float64)
        t = self.a + self.b * new + self.c * new * cached + self.d * new * new
        return float(t) if t.ndim == 0 else t

    def mape(self, split: str) -> float:
        """Mean absolute percentage error (as a fraction) on the ``fit`` or ``holdout`` points."""
        p = self.points.filter(pl.col("split") == split)
        return float(((p["predicted_s"] - p["seconds"]).abs() / p["seconds"]).mean()) if p.height else float("nan")

    @property
    def mape_fit(self) -> float:
        return self.mape("fit")

    @property
    def mape_holdout(self) -> float:
        return self.mape("holdout")

    @property
    def max_tokens(self) -> int:
        """The longest prompt (cached + new) measured; predictions beyond it extrapolate."""
        return int((self.points["cached"] + self.points["new"]).max())

    def residuals(self) -> pl.DataFrame:
        """The points with their residuals (seconds and relative)."""
        return self.points.with_columns((pl.col("predicted_s") - pl.col("seconds")).alias("residual_s"),
                                        ((pl.col("predicted_s") - pl.col("seconds")) / pl.col("seconds"))
                                        .alias("relative_error"))

    def annotate(self, result):
        """``annotate(result, self)``: what ``kv.simulate(..., cost=self)`` calls."""
        return annotate(result, self)

    def coefficients(self) -> dict:
        return {"a": self.a, "b": self.b, "c": self.c, "d": self.d}

    def __repr__(self) -> str:
        return (f"CostModel({self.model}: t = {self.a * 1e3:.3g} ms + {self.b * 1e6:.3g} µs·new + "
                f"{self.c * 1e9:.3g} ns·new·cached + {self.d * 1e9:.3g} ns·new²; held-out MAPE "
                f"{self.mape_holdout:.1%} on {self.points.filter(pl.col('split') == 'holdout').height} points)")

    def _repr_html_(self) -> str:
        return summary_html("CostModel", repr(self)[10:-1],
                            body=table_html(self.points.columns, self.points.rows()))


def fit(model, *, cached=(0, 256, 1024, 2048), new=(16, 64, 256, 1024), holdout: int = 6,
        repeats: int = 3, seed: int = 0) -> CostModel:
    """Measure prefill time at every (cached, new) grid point plus ``holdout`` random points
    between them, fit the cost model on the grid, report its error on the held-out points.

    Example:
        >>> cost = kv.cost.fit(kv.load("tiny"), cached=(0, 512), new=(16, 64, 256, 512, 1024))
        >>> round(cost.mape_holdout, 2)
    """
    grid = sorted({(int(c), int(n)) for c in cached for n in new})
    if len(grid) < 10 or any(n < 1 or c < 0 for c, n in grid):
        raise KvlabError(f"fit needs at least 10 (cached, new) points with cached >= 0 and new >= 1; "
                         f"got {len(grid)} from cached={cached!r} x new={new!r}")
    if holdout < 1:
        raise KvlabError(f"holdout must be >= 1 (the error is reported on held-out points), got {holdout!r}")
    rng = np.random.default_rng(seed)
    cs, ns = [c for c, _ in grid], [n for _, n in grid]
    held: set = set()
    while len(held) < holdout:
        p = (int(rng.integers(min(cs), max(cs) + 1)), int(rng.integers(min(ns), max(ns) + 1)))
        if p not in grid:
            held.add(p)
    frame = measure(model, grid + sorted(held), repeats=repeats, seed=seed)
    frame = frame.with_columns(pl.Series("split", ["fit"] * len(grid) + ["holdout"] * len(held)))
    coef = fit_coefficients(frame.filter(pl.col("split") == "fit"))
    cost = CostModel(*coef, getattr(model, "name", type(model).__name__), frame)
    predicted = cost.predict(frame["cached"].to_numpy(), frame["new"].to_numpy())
    return replace(cost, points=frame.with_columns(pl.Series("predicted_s", predicted)))


def measure(model, points, *, repeats: int = 3, seed: int = 0, agree: float = 0.05,
            min_total_s: float = 0.6) -> pl.DataFrame:
    """Prefill seconds of each (cached, new) point on this machine: min and median over the
    runs of interleaved passes, each visiting the points in a new random order.

    Noise from other processes only ever adds time, so the minimum is the estimate, and a point
    gets more runs until it is trustworthy: at least ``repeats``; more (up to ``3 * repeats``)
    while its two fastest differ by more than ``agree``; more (up to 40) while its runs add up to
    less than ``min_total_s`` (a 10 ms prefill needs many tries to meet an undisturbed moment).

    Example:
        >>> measure(kv.load("tiny"), [(0, 16), (256, 64)], repeats=2)["seconds"].len()
        2
    """
    from ..primitives.snapshots import prefill, restore, snapshot  # mlx: only to measure, not to fit

    if repeats < 1:
        raise KvlabError(f"repeats must be >= 1, got {repeats!r}")
    rng = np.random.default_rng(seed)
    longest = max(c + n for c, n in points)
    ids = [int(i) for i in rng.integers(0, model.vocab_size, longest)]
    snaps = {c: snapshot(prefill(model, ids[:c])[1]) for c in sorted({c for c, _ in points}) if c}
    prefill(model, ids[:8])  # warm up: the first call pays one-off setup
    runs = {p: [] for p in points}

    def wanted(p):
        r = sorted(runs[p])
        return (len(r) < max(repeats, 2) or (len(r) < 3 * repeats and r[1] > r[0] * (1 + agree))
                or (len(r) < 40 and sum(r) < min_total_s))

    todo = list(points)
    while todo:
        for i in rng.permutation(len(todo)):
            c, n = todo[i]
            cache = restore(snaps[c]) if c else None
            t = timing.timed()
            logits, cache = prefill(model, ids[c:c + n], cache)
            runs[todo[i]].append(t.done(logits, [layer.state for layer in cache]))
        todo = [p for p in points if wanted(p)]
    return pl.DataFrame({"cached": [c for c, _ in points], "new": [n for _, n in points],
                         "seconds": [min(runs[p]) for p in points],
                         "median_s": [statistics.median(runs[p]) for p in points],
                         "runs": [len(runs[p]) for p in points]})


def fit_coefficients(frame: pl.DataFrame) -> tuple[float, float, float, float]:
    """Non-negative (a, b, c, d) minimising the squared relative error over ``frame``'s points
    (columns cached, new, seconds): ``fit_nonneg`` with rows weighted by 1/seconds."""
    c, n, t = (frame[k].to_numpy().astype(np.float64) for k in ("cached", "new", "seconds"))
    X = np.stack([np.ones_like(n), n, n * c, n * n], axis=1)
    return tuple(float(v) for v in fit_nonneg(X, t, weights=1 / t))


def fit_nonneg(X: np.ndarray, y: np.ndarray, *, weights=None, free=(), required=()) -> np.ndarray:
    """Least squares ``y ~ X @ coef`` with every coefficient >= 0 except the ``free`` columns:
    each subset of the columns that includes ``required`` is solved and the feasible one with
    the smallest (``weights``-weighted) squared error is kept; zeros when none is feasible. The
    prefill-time fits of the cost model and of ``kvlab.serving.savings`` both use it.

    Example:
        >>> n = np.array([1.0, 2.0, 3.0])
        >>> fit_nonneg(np.stack([np.ones(3), n], axis=1), 5 + 2 * n).round(6).tolist()
        [5.0, 2.0]
    """
    X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if weights is not None:
        X, y = X * np.asarray(weights, dtype=np.float64)[:, None], y * weights
    scale = np.abs(X).max(axis=0)  # columns of very different sizes (1 vs new²): condition lstsq
    scale[scale == 0] = 1.0
    Xs, k = X / scale, X.shape[1]
    best = None
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            if not set(required) <= set(cols):
                continue
            x, *_ = np.linalg.lstsq(Xs[:, cols], y, rcond=None)
            if any(v < 0 and j not in free for j, v in zip(cols, x)):
                continue
            err = float(np.sum((Xs[:, cols] @ x - y) ** 2))
            if best is None or err < best[0]:
                full = np.zeros(k)
                full[list(cols)] = x
                best = (err, full)
    return best[1] / scale if best is not None else np.zeros(k)


def annotate(result, cost: CostModel):
    """``result`` (a ``kv.simulate`` SimResult) with estimated seconds: per request
    ``est_prefill_s`` (prefill of the tokens not hit, on the hit ones), ``est_cold_prefill_s``
    (the whole prompt, no cache) and ``est_ttft_saved_s`` (their difference: restoring a RAM hit
    is taken as free, snapshots being views); in ``summary`` their totals, ``est_saved_ratio``
    and ``est_extrapolated`` (the share of requests longer than any point the model was fitted on).

    Example:
        >>> r = kv.cost.annotate(kv.simulate(wl, capacity_tokens=4096), cost)
        >>> r.summary["est_ttft_saved_s"] <= r.summary["est_cold_prefill_s"]
        True
    """
    f = result.requests
    prompt, hit = f["prompt_tokens"].to_numpy(), f["hit_tokens"].to_numpy()
    est = np.asarray(cost.predict(hit, prompt - hit), dtype=np.float64).reshape(-1)
    cold = np.asarray(cost.predict(0, prompt), dtype=np.float64).reshape(-1)
    frame = f.with_columns(pl.Series(COLUMNS[0], est), pl.Series(COLUMNS[1], cold),
                           pl.Series(COLUMNS[2], cold - est))
    total_cold = float(cold.sum())
    summary = dict(result.summary, est_prefill_s=float(est.sum()), est_cold_prefill_s=total_cold,
                   est_ttft_saved_s=float((cold - est).sum()),
                   est_saved_ratio=float((cold - est).sum()) / total_cold if total_cold else 0.0,
                   est_extrapolated=float((prompt > cost.max_tokens).mean()) if len(prompt) else 0.0)
    return replace(result, requests=frame, summary=summary)


def sweep_seconds(source, cost: CostModel, capacities, policy: str = "lru", block_size: int | None = None,
                  *, passes: int = 1, tokenizer=None) -> pl.DataFrame:
    """A capacity sweep in seconds: per capacity, both hit rates and the estimated prefill
    seconds with and without the cache, and the TTFT saved (in total over the source).

    Example:
        >>> kv.cost.sweep_seconds(wl, cost, [1024, 4096, None])["est_ttft_saved_s"].to_list()
    """
    from ..sim.simulator import simulate

    rows = []
    for cap in capacities:
        r = annotate(simulate(source, policy, cap, block_size, passes=passes, tokenizer=tokenizer), cost)
        s = r.summary
        rows.append({"capacity_tokens": s["capacity_tokens"], "token_hit_rate": s["token_hit_rate"],
                     "request_hit_rate": s["request_hit_rate"], "hit_tokens": s["hit_tokens"],
                     "prompt_tokens": s["prompt_tokens"], **{k: s[k] for k in COLUMNS},
                     "est_saved_ratio": s["est_saved_ratio"]})
    return pl.DataFrame(rows, schema_overrides={"capacity_tokens": pl.Int64})


def measure_tiers(model, lengths=(256, 512, 1024), *, repeats: int = 3, folder=None, seed: int = 0) -> pl.DataFrame:
    """Seconds to get a usable cache of each prefix length four ways, interleaved over repeats:
    ``ram_restore`` (``kv.restore`` of a snapshot), ``disk_save`` (DiskStore write: digest,
    safetensors, atomic rename), ``disk_load`` (DiskStore load: read, digest and model check,
    restore) and ``recompute`` (prefill). One row per (length, method, repeat), with the bytes.
    Disk reads are as warm as the OS page cache leaves them (the file was just written).

    Example:
        >>> measure_tiers(kv.load("tiny"), (128,), repeats=1)["method"].unique().sort().to_list()
        ['disk_load', 'disk_save', 'ram_restore', 'recompute']
    """
    from ..primitives.snapshots import prefill, restore, snapshot
    from ..stores.disk import DiskStore

    rng = np.random.default_rng(seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvlab-tiers-", dir=folder) as tmp:
        for rep in range(repeats):
            disk = DiskStore(tmp, model=model)  # fresh each repeat: every save writes a new file
            for n in lengths:
                ids = [int(i) for i in rng.integers(0, model.vocab_size, n)]
                t = timing.timed()
                logits, cache = prefill(model, ids)
                times = {"recompute": t.done(logits, [layer.state for layer in cache])}
                snap = snapshot(cache, tokens=ids, model=model)
                t = timing.timed()
                times["ram_restore"] = t.done([c.state for c in restore(snap)])
                key = CacheKey(tuple(ids))
                t = timing.timed()
                disk.put(key, snap)
                times["disk_save"] = t.done()
                t = timing.timed()
                m = disk.best(key, n)
                times["disk_load"] = t.done([c.state for c in restore(m.snapshot)])
                rows += [{"prefix_tokens": n, "method": k, "repeat": rep, "seconds": v, "bytes": snap.nbytes}
                         for k, v in times.items()]
            for p in disk.folder.iterdir():
                p.unlink()
    return pl.DataFrame(rows)


def crossover(model=None, lengths=(256, 512, 1024), *, repeats: int = 3, times: pl.DataFrame | None = None) -> pl.DataFrame:
    """Restoring from RAM, restoring from disk and recomputing, by prefix length (medians over
    repeats of ``measure_tiers``, or of ``times`` if given), with disk MB/s and the cheapest way.

    Example:
        >>> kv.cost.crossover(m, (256, 1024))["fastest"].to_list()
        ['ram_restore', 'ram_restore']
    """
    times = measure_tiers(model, lengths, repeats=repeats) if times is None else times
    wide = (times.group_by("prefix_tokens", "method").agg(pl.col("seconds").median(), pl.col("bytes").first())
            .pivot(on="method", index=["prefix_tokens", "bytes"], values="seconds").sort("prefix_tokens"))
    methods = ["ram_restore", "disk_load", "recompute"]
    return wide.with_columns(
        (pl.col("bytes") / pl.col("disk_load") / 1e6).alias("disk_load_MBps"),
        (pl.col("bytes") / pl.col("disk_save") / 1e6).alias("disk_save_MBps"),
        (pl.col("disk_load") / pl.col("recompute")).alias("disk_load_vs_recompute"),
        pl.concat_list(methods).list.arg_min().replace_strict(dict(enumerate(methods))).alias("fastest"))
