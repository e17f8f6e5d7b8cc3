"""01_multi_turn under papermill: prompt + output keys reuse the previous answer (seed 001), and the
finding names the keying that wins and whether the seed's speedup reproduces."""

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

    # the winner and every figure recomputed from the results table (mutants: the verdict typed as
    # prompt-only; the TTFT ratio inverted; "reproduces" typed whatever the ratio)
    text = finding(nb)
    rows = turns.filter(pl.col("turn") > 1)
    po, pr = (rows.filter(pl.col("keying") == k) for k in ("prompt+output", "prompt"))
    po_r, pr_r = po["reused_tokens"].sum(), pr["reused_tokens"].sum()
    po_n, pr_n = po["prompt_tokens"].sum(), pr["prompt_tokens"].sum()
    assert text.startswith(f"**Key on prompt + output**: over turns 2-3 on tiny, prompt + output keys reused {po_r} of "
                           f"{po_n} prompt tokens ({po_r / po_n:.0%}) and prompt-only keys {pr_r} of {pr_n} "
                           f"({pr_r / pr_n:.0%}): {po_r - pr_r} tokens more with prompt + output keys, the previous answers")
    assert (f"Prompt + output keys prefilled {po['prefilled_tokens'].sum()} tokens instead of "
            f"{pr['prefilled_tokens'].sum()}") in text
    ratio = pr["ttft_ms"].median() / po["ttft_ms"].median()
    assert (f"the median TTFT of those turns was {po['ttft_ms'].median():.1f} ms against {pr['ttft_ms'].median():.1f} ms "
            f"({ratio:.2f}x {'faster' if ratio > 1 else 'slower'}).") in text
    assert "Seed 001's multi-turn speedup (3.45 s -> 1.75 s, 2.0x) " in text
    assert ("reproduces here." if ratio >= 3.45 / 1.75 else
            f"does not reproduce here ({ratio:.2f}x): the seed's 'before' had no working reuse at all, while here "
            f"prompt-only keys already reuse {pr_r / pr_n:.0%} of each prompt") in text
    assert (f"An exact repeat of {repeat['prompt_tokens']} tokens reused {repeat['reused_tokens']}: the last token is "
            "always recomputed, as seed 001's first fix requires.") in text
    # the figure's axes in words (mutant: "reused tokens" / "turn" column-style titles)
    fig = next(o.data["application/vnd.plotly.v1+json"] for c in nb.cells if c.cell_type == "code"
               and "go.Bar(" in c.source for o in c.outputs if "application/vnd.plotly.v1+json" in o.get("data", {}))
    assert fig["layout"]["xaxis"]["title"]["text"] == "chat turn"
    assert fig["layout"]["yaxis"]["title"]["text"] == "tokens reused from the cache"
    assert [tr["y"] for tr in fig["data"]] == [wide["prompt"].to_list(), wide["prompt+output"].to_list()]
