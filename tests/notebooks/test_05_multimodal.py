"""05_multimodal under papermill: identical ids with different images replay the wrong KV under
ids-only keys; image-aware keys reuse only the text before the image and match a cold run."""

from __future__ import annotations

import polars as pl
import pytest
from notebook_helpers import execute, finding

from kvlab.primitives.tolerance import tolerance

pytestmark = [pytest.mark.notebook, pytest.mark.vlm]

LOGIT_TOL = tolerance("float32")  # the notebook's default: the tiny VLM is float32, cached vs cold (1e-4)
WRONG_KV_MIN = 0.1  # another image's KV moves the tiny VLM's logits by far more than this


def test_05_multimodal(tmp_path):
    df, nb = execute("05_multimodal", tmp_path, pairs=2)
    assert df.height == 2 * (2 * 2) + 2 * 3 + 2  # stores x (keyings x pairs) + text turns + text-then-image
    assert df["reuse_as_expected"].all()  # every reuse is what its keys allow, to the token
    assert not df.filter(pl.col("keys") == "ids-only")["matches_cold"].any()  # the wrong KV, every time
    assert df.filter(pl.col("keys") == "image-aware")["matches_cold"].all()
    images = df.filter(pl.col("experiment") == "different images")
    for store in ("radix", "paged"):
        ids_only = images.filter((pl.col("store") == store) & (pl.col("keys") == "ids-only"))
        aware = images.filter((pl.col("store") == store) & (pl.col("keys") == "image-aware"))
        assert ids_only.height == aware.height == 2
        # ids-only keys take all but the last token, the other picture's KV with them: wrong logits
        last = (ids_only["prompt_tokens"] - 1) // 16 * 16 if store == "paged" else ids_only["prompt_tokens"] - 1
        assert ids_only["reused_tokens"].to_list() == last.to_list()
        assert (ids_only["verify_diff"] > WRONG_KV_MIN).all() and not ids_only["matches_cold"].any()
        # image keys stop at the first placeholder and match a cold run
        assert (aware["reused_tokens"] < ids_only["reused_tokens"]).all()
        assert (aware["reused_tokens"] > 0).all()
        assert (aware["verify_diff"] <= LOGIT_TOL).all() and aware["same_output"].all()
    text = df.filter(pl.col("experiment") == "text only")
    assert (text["verify_diff"] <= LOGIT_TOL).all()
    for store in ("radix", "paged"):
        reused = text.filter(pl.col("store") == store)["reused_tokens"].to_list()
        assert reused[0] == 0 and all(r > 0 for r in reused[1:]), (store, reused)
    then_image = df.filter(pl.col("experiment") == "text then image")
    assert then_image["reused_tokens"].to_list() == then_image["expected_reused"].to_list()
    assert (then_image["reused_tokens"] > 0).all() and then_image["matches_cold"].all()
    text = finding(nb)
    assert "ids-only keys reused" in text and "matched a cold run on 0 of 4 requests" in text
    aware = df.filter(pl.col("keys") == "image-aware").height
    assert f"every image-aware request matched cold on {aware} of {aware}" in text
    assert f"Reuse was exactly what the keys allow on {df.height} of {df.height} requests." in text
