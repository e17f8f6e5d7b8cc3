"""11b_quantization under papermill (SmolLM2: quantized KV needs head_dim divisible by 32): stored
bytes equal the formula, KL falls as bits rise, reuse adds error on top of quantization."""

from __future__ import annotations

import polars as pl
import pytest
from notebook_helpers import execute

SMOL_TOL = 2e-3  # float32 reuse vs cold on SmolLM2


@pytest.mark.notebook
@pytest.mark.embedded
def test_11b_quantization(tmp_path):
    df, nb = execute("11b_quantization", tmp_path)
    sweep = df.filter(pl.col("section") == "sweep")
    assert sorted(sweep["kv_format"].to_list()) == ["float32", "q2g32", "q2g64", "q4g32", "q4g64", "q8g32", "q8g64"]
    assert (sweep["bytes_per_token"] == sweep["formula_bytes_per_token"].cast(float)).all()
    # SmolLM2: 30 layers x 3 kv heads x (keys + values) x (64*bits/32 words x 4 B + 2 x 64/group x 4 B)
    for row in sweep.filter(pl.col("bits").is_not_null()).iter_rows(named=True):
        b, g = row["bits"], row["group_size"]
        assert row["formula_bytes_per_token"] == 30 * 3 * 2 * (64 * b // 32 * 4 + 2 * (64 // g) * 4)
    assert sweep.filter(pl.col("kv_format") == "float32")["bytes_per_token"].item() == 30 * 3 * 2 * 64 * 4
    for g in (32, 64):
        kl = sweep.filter(pl.col("group_size") == g).sort("bits")["kl_mean"].to_list()
        assert kl[0] > kl[1] > kl[2] > 0, (g, kl)
    reuse = df.filter(pl.col("section") == "reuse")

    def value(case, bits, column):
        return reuse.filter((pl.col("case") == case) & (pl.col("bits") == bits))[column].item()

    for b in (4, 8):
        assert value("float reuse", b, "max_abs_vs_float") < SMOL_TOL
        assert value("quantized cold", b, "max_abs_vs_float") > SMOL_TOL
        assert value("quantized reuse", b, "max_abs_vs_quantized_cold") > SMOL_TOL
    assert value("quantized reuse", 4, "max_abs_vs_quantized_cold") > value("quantized reuse", 8, "max_abs_vs_quantized_cold")
