"""The disk tier against recomputing: DiskStore save and load in MB/s and as a ratio to a prefill
of the same prefix (and a RAM restore), side by side in one run; plus the prefill cost model's
held-out error."""

from __future__ import annotations

import polars as pl

from .settings import Settings
from .table import Table, median_range, ms, spread

NEEDS_MODEL = True
LENGTHS = (256, 1024, 2048)
FIT_CACHED = (0, 256, 512, 1024)
FIT_NEW = (16, 64, 128, 256)


def bench_tiers(model, repeats: int, lengths=LENGTHS, *, fit_cached=FIT_CACHED, fit_new=FIT_NEW) -> Table:
    """Per prefix length: disk save and load (MB/s, ms), recompute and RAM restore (ms), and
    disk load / recompute; medians and spread over ``repeats``. The notes give the cost model's
    held-out MAPE (``kv.cost.fit`` on a 4x4 grid plus 6 held-out points).

    Example:
        >>> bench_tiers(kv.load("tiny"), 2, lengths=(256,), fit_cached=(0, 256), fit_new=(16, 32, 64, 128, 256)).rows[0][0]
        256
    """
    from ..experiments.cost import fit, measure_tiers

    times = measure_tiers(model, lengths, repeats=max(repeats, 3))
    rows, ratios = [], {}
    for n in lengths:
        f = times.filter(pl.col("prefix_tokens") == n)
        nbytes = f["bytes"][0]
        s = {k: f.filter(pl.col("method") == k)["seconds"].to_list() for k in
             ("disk_save", "disk_load", "recompute", "ram_restore")}
        mbps = {k: spread([nbytes / t / 1e6 for t in s[k]]) for k in ("disk_save", "disk_load")}
        ratio = spread([a / b for a, b in zip(s["disk_load"], s["recompute"])])
        ratios[n] = ratio["median"]
        rows.append((n, f"{nbytes / 2**20:.1f}", median_range(mbps["disk_save"]), median_range(mbps["disk_load"]),
                     ms(spread(s["disk_load"])), ms(spread(s["recompute"])), median_range(spread(s["ram_restore"]), 1e6),
                     median_range(ratio)))
    cost = fit(model, cached=fit_cached, new=fit_new, holdout=6, repeats=max(repeats, 3))
    return Table(f"disk tier vs recompute, model {model.name}",
                 f"kvlab bench --only tiers --model {model.name} --repeats {repeats}",
                 ("prefix tokens", "MiB", "save MB/s median (min-max)", "load MB/s median (min-max)",
                  "disk load ms median ± pstdev (min-max)", "recompute ms", "RAM restore µs median (min-max)",
                  "disk load / recompute"), tuple(rows),
                 "Save: digest, safetensors write, atomic rename (kv.DiskStore.put). Load: read, digest "
                 "and model check, restore (kv.DiskStore.best). Reads come from a just-written file "
                 "(warm OS page cache). Recompute: prefill of the same prefix. "
                 f"Prefill cost model (kv.cost.fit, {len(fit_cached) * len(fit_new)} fit points, 6 held out): "
                 f"held-out MAPE {cost.mape_holdout:.1%}, fit MAPE {cost.mape_fit:.1%}; {cost!r}.",
                 values={"mape_holdout": cost.mape_holdout, "mape_fit": cost.mape_fit,
                         "disk_load_vs_recompute": ratios, "model": model.name})


def table(s: Settings) -> Table:
    return bench_tiers(s.model, s.repeats)
