"""What a server really saves, measured rather than reported.

A server's own counters say how many prompt tokens its cache "saved"; kvlab checks them against
time. Serve prompts of several lengths with the cache *off*, one at a time, and fit
``TTFT(n) = a + b*n + c*n^2`` (milliseconds; least squares with b, c >= 0: the cost
model's ``fit_nonneg``). A cached request of ``n`` tokens with
TTFT ``t`` then really prefilled about ``TTFT^-1(t)`` tokens, so it reused
``n - TTFT^-1(t)`` (clamped to ``[0, n]``). Run the cached requests one at a time too (queueing
behind other requests would read as prefill). The fit's residual (``rmse_ms``) divided by its
slope is the resolution in tokens.

Example:
    >>> cold = kv.generate_load(off.url, calibration_workload(m), tokenizer=m, concurrency=1)
    >>> fit = fit_prefill(cold.frame)
    >>> on = kv.generate_load(srv.url, repeat_workload(m), tokenizer=m, concurrency=1)
    >>> infer_reuse(on.frame, fit).select("name", "reused_tokens", "reused_inferred")
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from ..errors import RequestError
from ..experiments.cost import fit_nonneg
from ..request import Request, Workload
from .sessions import block_ids, safe_ids
from ..primitives.display import summary_html


@dataclass(frozen=True)
class PrefillFit:
    """``ttft_ms(n) = a + b*n + c*n^2`` fitted on cache-off requests (``coef = (a, b, c)``)."""

    coef: tuple[float, float, float]
    rmse_ms: float
    points: int
    max_tokens: int

    def ttft_ms(self, n) -> np.ndarray:
        a, b, c = self.coef
        n = np.asarray(n, dtype=float)
        return a + b * n + c * n * n

    def prefilled(self, ttft_ms) -> np.ndarray:
        """Tokens a request with this TTFT prefilled (the fit inverted; 0 below the intercept)."""
        a, b, c = self.coef
        t = np.asarray(ttft_ms, dtype=float)
        if abs(c) < 1e-12:
            n = (t - a) / b
        else:
            disc = np.maximum(b * b + 4 * c * (t - a), 0.0)
            n = (-b + np.sqrt(disc)) / (2 * c)
        return np.maximum(n, 0.0)

    @property
    def resolution_tokens(self) -> float:
        """The fit's residual in tokens at its mid-range slope."""
        a, b, c = self.coef
        slope = b + c * self.max_tokens  # d ttft / d n at n = max/2
        return self.rmse_ms / slope if slope > 0 else float("inf")

    def __repr__(self) -> str:
        a, b, c = self.coef
        return (f"PrefillFit(ttft = {a:.1f} + {b:.4f}*n + {c:.2e}*n^2 ms, rmse {self.rmse_ms:.1f} ms "
                f"~ {self.resolution_tokens:.0f} tokens, {self.points} points)")

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def fit_prefill(frame: pl.DataFrame) -> PrefillFit:
    """Fit TTFT against prompt tokens over the successful rows of a cache-off load run.

    Example:
        >>> fit_prefill(cold.frame).ttft_ms(1024) > fit_prefill(cold.frame).ttft_ms(128)
        True
    """
    ok = frame.filter(pl.col("ok") & pl.col("ttft_ms").is_not_null() & pl.col("prompt_tokens").is_not_null())
    n = ok["prompt_tokens"].to_numpy().astype(float)
    t = ok["ttft_ms"].to_numpy().astype(float)
    if len(np.unique(n)) < 3:
        raise RequestError(f"fitting prefill time needs cache-off requests of at least 3 different "
                           f"prompt lengths, got {sorted(set(n.astype(int).tolist()))}; run "
                           "calibration_workload(...) against the server with its cache off")
    # the cost model's fit on cached = 0; the intercept may go negative, the per-token terms not
    A = np.stack([np.ones_like(n), n, n * n], axis=1)
    coef = fit_nonneg(A, t, free=(0,), required=(0,))
    if coef[1] + 2 * coef[2] * n.max() <= 0:
        raise RequestError("prefill time does not grow with prompt length in this run (is the "
                           "cache really off, and were requests sent one at a time?)")
    rmse = float(np.sqrt(np.mean((A @ coef - t) ** 2)))
    return PrefillFit(tuple(float(x) for x in coef), rmse, len(n), int(n.max()))


def infer_reuse(frame: pl.DataFrame, fit: PrefillFit) -> pl.DataFrame:
    """``frame`` with ``prefilled_est`` and ``reused_inferred`` (tokens) from each row's TTFT.

    Example:
        >>> infer_reuse(on.frame, fit)["reused_inferred"].sum()
        799
    """
    n = frame["prompt_tokens"].fill_null(0).to_numpy().astype(float)
    t = frame["ttft_ms"].fill_null(np.nan).to_numpy().astype(float)
    pre = np.minimum(fit.prefilled(np.nan_to_num(t, nan=0.0)), n)
    known = ~np.isnan(t) & frame["ok"].to_numpy()
    return frame.with_columns(
        pl.Series("prefilled_est", np.where(known, np.round(pre), np.nan)).fill_nan(None).cast(pl.Int64),
        pl.Series("reused_inferred", np.where(known, np.round(n - pre), np.nan)).fill_nan(None).cast(pl.Int64))


def repeats_prefilled_again(frame: pl.DataFrame) -> int:
    """How many exact repeats of a ``repeat_workload`` run (rows named "... again k") took at
    least half the TTFT of its first, cold request ``A``: prompts the server prefilled again
    although it had just seen them. Each repeat is compared with a request of the same run
    seconds before it, so unlike ``infer_reuse`` (a fit from another run) machine load that
    changes between runs cannot move it; a reused repeat takes a few tokens' time, far below half.

    Example:
        >>> repeats_prefilled_again(on.frame)  # vllm-mlx batched: every repeat prefilled again
        6
    """
    cold = frame.filter(pl.col("name") == "A")
    if cold.height != 1 or cold["ttft_ms"][0] is None:
        raise RequestError("repeats_prefilled_again takes the frame of a repeat_workload(...) run with its "
                           "first request 'A' answered")
    again = frame.filter(pl.col("name").str.contains(" again ") & pl.col("ok"))
    return int((again["ttft_ms"] >= cold["ttft_ms"][0] / 2).sum())


def calibration_workload(tokenizer, lengths=(128, 256, 512, 1024, 2048), *, repeats: int = 2,
                         seed: int = 0) -> Workload:
    """Token-id prompts of the given lengths sharing nothing (each its own random safe tokens), for
    a cache-off run to fit prefill time on; one output token each.

    Example:
        >>> [len(r.ids) for r in calibration_workload(m, (64, 128), repeats=1)]
        [64, 128]
    """
    safe = safe_ids(tokenizer)
    reqs = [Request(ids=tuple(block_ids(1_000_003 * (seed + 1) + 1_000 * k + i, n, safe)),
                    max_tokens=1, name=f"cold-{n}-{k}")
            for k in range(repeats) for i, n in enumerate(lengths)]
    return Workload("calibration", tuple(reqs), dict(lengths=tuple(lengths), repeats=repeats, seed=seed),
                    "unrelated prompts of several lengths, for a prefill-time fit")


def repeat_workload(tokenizer, prefix: int = 1024, extension: int = 256, *, repeats: int = 2,
                    seed: int = 0) -> Workload:
    """Exact repeats and extensions of one prompt, in order: ``A`` (cold), ``A`` again
    ``repeats`` times (exact hits), ``A+B`` (a real prefix hit on A), then ``A+B`` again
    ``repeats`` times. A cache that counts exact hits as saved while prefilling them again
    shows up here as reported >> inferred.

    Example:
        >>> [r.name for r in repeat_workload(m, 64, 16, repeats=1)]
        ['A', 'A again 1', 'A+B', 'A+B again 1']
    """
    safe = safe_ids(tokenizer)
    a = block_ids(7_000_001 + seed, prefix, safe)
    ab = a + block_ids(7_000_002 + seed, extension, safe)
    reqs = [Request(ids=tuple(a), max_tokens=1, name="A")]
    reqs += [Request(ids=tuple(a), max_tokens=1, name=f"A again {k + 1}") for k in range(repeats)]
    reqs += [Request(ids=tuple(ab), max_tokens=1, name="A+B")]
    reqs += [Request(ids=tuple(ab), max_tokens=1, name=f"A+B again {k + 1}") for k in range(repeats)]
    return Workload("repeats", tuple(reqs), dict(prefix=prefix, extension=extension, repeats=repeats,
                                                 seed=seed), "exact repeats and a prefix extension")


def audit(result, fit: PrefillFit, *, counter: str | None = None) -> dict:
    """Reported against measured savings for one load run: the server's counter (``counter``, a
    key of ``result.server_delta()``; default: vllm-mlx's ``tokens_saved``, else the usage's
    cached tokens summed) beside the reuse inferred from TTFT.

    Example:
        >>> audit(on, fit)
        {'reported': 4030, 'inferred': 799, 'source': '/v1/cache/stats:engine_cache.tokens_saved', ...}
    """
    frame = infer_reuse(result.frame, fit)
    delta = result.server_delta()
    key = counter or next((k for k in delta if k.endswith("tokens_saved")), None)
    if key is not None:
        reported, source = int(delta[key]), key
    elif frame["reused_tokens"].is_not_null().any():
        reported, source = int(frame["reused_tokens"].sum()), "usage cached_tokens"
    else:
        reported, source = None, None
    inferred = int(frame["reused_inferred"].fill_null(0).sum())
    prompt = int(frame["prompt_tokens"].fill_null(0).sum())
    return {"reported": reported, "inferred": inferred, "source": source, "prompt_tokens": prompt,
            "resolution_tokens_per_request": round(fit.resolution_tokens, 1),
            "requests": frame.height}
