"""08_assemble_an_engine under papermill: a prefix cache built from the primitives alone reuses
exactly what kv.Engine with kv.PagedStore reuses, request by request, with the same logits."""

from __future__ import annotations

import polars as pl
import pytest
from notebook_helpers import NOTEBOOKS, execute, finding

SAME_LOGITS = 1e-5  # float32: the two paths restore the same KV and run the same prefill
BLOCK = 16


@pytest.mark.notebook
def test_08_assemble_an_engine(tmp_path):
    df, nb = execute("08_assemble_an_engine", tmp_path, users=3)
    assert df["kind"].to_list() == ["first", "shared system prompt", "shared system prompt", "exact repeat",
                                    "block-aligned ids", "follow-up"]
    assert df["model"][0] == "tiny" and df["block_size"][0] == BLOCK and df["tolerance"][0] <= SAME_LOGITS
    # the assembled cache and kv.Engine + kv.PagedStore agree on every request
    assert df["reused_tokens"].to_list() == df["engine_reused_tokens"].to_list()
    assert (df["max_logit_diff_vs_engine"] < SAME_LOGITS).all()
    assert (df["max_logit_diff_vs_cold"] < 1e-4).all()
    assert df["same_reuse"].all() and df["same_logits"].all()  # under the notebook's own tolerance
    assert df["reused_tokens"].sum() > 0  # the workload shares full blocks
    rows = {k: g for (k,), g in df.group_by("kind")}
    first = rows["first"].row(0, named=True)
    assert first["reused_tokens"] == 0
    # whole blocks only, and the last token is always recomputed
    assert (df["reused_tokens"] % BLOCK == 0).all() and (df["reused_tokens"] < df["prompt_tokens"]).all()
    assert (rows["shared system prompt"]["reused_tokens"] > 300).all()  # the system prompt's blocks
    repeat = rows["exact repeat"].row(0, named=True)
    assert repeat["prompt_tokens"] == first["prompt_tokens"]
    assert repeat["reused_tokens"] == (first["prompt_tokens"] - 1) // BLOCK * BLOCK
    aligned = rows["block-aligned ids"].row(0, named=True)
    assert aligned["prompt_tokens"] % BLOCK == 0 and aligned["reused_tokens"] == aligned["prompt_tokens"] - BLOCK
    second = df.filter(pl.col("request") == 2).row(0, named=True)
    follow = rows["follow-up"].row(0, named=True)
    assert follow["reused_tokens"] >= second["prompt_tokens"] // BLOCK * BLOCK  # the whole earlier turn
    text = finding(nb)
    assert f"reused {df['reused_tokens'].sum()} of {df['prompt_tokens'].sum()} prompt tokens over 6 requests" in text
    assert "kv.PagedStore reused the same on 6 of 6" in text
    assert f"(6 of 6 under the {df['tolerance'][0]:g} tolerance)" in text


def test_08_is_well_under_a_hundred_lines_of_code():
    import jupytext

    nb = jupytext.read(NOTEBOOKS / "08_assemble_an_engine.py")
    code = [line for c in nb.cells if c.cell_type == "code" for line in c.source.splitlines()
            if line.strip() and not line.strip().startswith("#")]
    assert len(code) < 90, len(code)
