"""01_multi_turn under papermill: prompt + output keys reuse the previous answer (seed 001)."""

from __future__ import annotations

import polars as pl
import pytest
from notebook_helpers import execute, finding


@pytest.mark.notebook
def test_01_multi_turn(tmp_path):
    df, nb = execute("01_multi_turn", tmp_path, turns=3)
    turns = df.filter(pl.col("scenario") == "turn")
    wide = turns.pivot(on="keying", index="turn", values="reused_tokens").sort("turn")
    assert wide["turn"].to_list() == [1, 2, 3]
    assert wide["prompt"][0] == wide["prompt+output"][0] == 0
    later = wide.filter(pl.col("turn") > 1)
    # prompt + output keys reuse the previous answer too; prompt keys stop at the previous prompt
    assert (later["prompt+output"] > later["prompt"]).all()
    prompts = turns.filter(pl.col("keying") == "prompt").sort("turn")["prompt_tokens"].to_list()
    assert later["prompt"].to_list() == prompts[:-1]
    repeat = df.filter(pl.col("scenario") == "repeat").row(0, named=True)
    assert repeat["match"] == "exact" and repeat["reused_tokens"] == repeat["prompt_tokens"] - 1
    text = finding(nb)
    assert f"prompt + output keys reused {later['prompt+output'].sum()} of " in text
    assert f"prompt-only keys {later['prompt'].sum()} of " in text
    assert f"An exact repeat of {repeat['prompt_tokens']} tokens reused {repeat['reused_tokens']}" in text
