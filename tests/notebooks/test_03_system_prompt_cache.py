"""03_system_prompt_cache under papermill: system store vs radix vs paged, and invalidation (seed 003)."""

from __future__ import annotations

import polars as pl
import pytest
from notebook_helpers import execute, finding


@pytest.mark.notebook
def test_03_system_prompt_cache(tmp_path):
    df, nb = execute("03_system_prompt_cache", tmp_path, users=3)
    prefix = df["system_prefix_tokens"][0]
    assert df["split_clean"].all() and prefix > 0

    def reused(store, request=None):
        f = df.filter(pl.col("store") == store)
        f = f.filter(pl.col("request") == request) if request else f.filter(
            pl.col("request").str.starts_with("user-") & (pl.col("index") > 1))
        return f["reused_tokens"].to_list()

    assert reused("system") == [prefix, prefix]  # exactly the system prefix, no more
    assert reused("system", "changed-system") == [0]  # invalidated
    assert reused("none") == [0, 0]
    assert all(r >= prefix for r in reused("radix"))  # radix also keeps the template tokens after it
    assert all(r % 16 == 0 and r > prefix - 16 for r in reused("paged"))  # whole blocks only
    assert df.filter(pl.col("index") == 1)["reused_tokens"].to_list() == [0, 0, 0, 0]
    text = finding(nb)
    assert f"share a {prefix}-token system prefix: none reused 0 tokens a request on average" in text
    assert f"system reused {prefix} tokens a request on average" in text
    assert "the same question reused 0 tokens (none), 0 tokens (system), " in text
