"""07_snapshot_pitfalls under papermill: aliasing, stale tails, non-trimmable caches."""

from __future__ import annotations

import polars as pl
import pytest
from notebook_helpers import LOGIT_TOL, execute, finding


@pytest.mark.notebook
def test_07_snapshot_pitfalls(tmp_path):
    df, nb = execute("07_snapshot_pitfalls", tmp_path)

    def value(pitfall, approach, metric):
        return df.filter((pl.col("pitfall") == pitfall) & (pl.col("approach") == approach)
                         & (pl.col("metric") == metric))["value"].item()

    layers = value("aliasing", "both", "layers")
    assert value("aliasing", "naive", "layers_changed") == layers > 0  # the naive snapshot changed
    assert value("aliasing", "kvlab", "layers_changed") == 0          # kv.snapshot did not
    assert value("stale_tail", "both", "stale_tail_max_abs") > 0
    assert value("stale_tail", "naive", "tokens_seen") == 256 and value("stale_tail", "kvlab", "tokens_seen") == 64
    assert value("stale_tail", "naive", "max_logit_diff") > 0.1
    assert value("stale_tail", "kvlab", "max_logit_diff") < LOGIT_TOL
    assert value("non_trimmable", "naive", "tokens_trimmed") == 0   # mlx-lm trims nothing, silently
    assert value("non_trimmable", "kvlab", "trim_raised") == 1      # kv.trim raises NotTrimmableError
    assert value("non_trimmable", "naive", "engine_reused_tokens") == 0
    assert value("non_trimmable", "kvlab", "engine_reused_tokens") > 0
    text = finding(nb)
    assert f"changed in {layers:.0f} of {layers:.0f} layers after a trim and an append; kv.snapshot in 0." in text
    assert "took 256 tokens instead of 64" in text and "kv.trim raised NotTrimmableError" in text
