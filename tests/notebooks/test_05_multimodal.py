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


CORE = ("different images", "text only", "text then image")
FAMILIES = ["tiny", "tiny-vlm:qwen3_5", "tiny-vlm:gemma4"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return execute("05_multimodal", tmp_path_factory.mktemp("nb05"), pairs=2, families=FAMILIES, ttft_repeats=2,
                   peer_models=["tiny-vlm"], peer_traffic=["mixed"], peer_requests=6)


def test_05_multimodal(run):
    saved, nb = run
    df = saved.filter(pl.col("experiment").is_in(CORE))
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


def test_05_seed_000_table_per_family(run):
    # seed 000: text-only requests sharing a system prompt, cold vs cached, on every family's tiny VLM
    saved, nb = run
    ttft = saved.filter(pl.col("experiment") == "text-only TTFT")
    assert ttft["model"].to_list() == [m for m in FAMILIES for _ in range(2)]
    assert ttft["matches_cold"].all() and (ttft["verify_diff"] <= LOGIT_TOL).all()
    dense = ttft.filter(pl.col("arch") == "qwen2_vl")
    # a dense cache reuses the whole shared prefix (the system prompt and the user turn's opening)
    assert dense["reused_tokens"].to_list() == dense["shared_prefix_tokens"].to_list()
    assert (dense["shared_prefix_tokens"] > dense["system_ends_at"]).all()
    # hybrid (GatedDeltaNet) and sliding-window caches restore only where a checkpoint was taken:
    # the end of the system message (mutant: a trimmed recurrent state would reuse the whole prefix)
    others = ttft.filter(pl.col("arch") != "qwen2_vl")
    assert others["reused_tokens"].to_list() == others["system_ends_at"].to_list()
    assert sorted(set(others["arch"])) == ["gemma4", "qwen3_5"]
    text = finding(nb)
    for arch in ("qwen2_vl", "qwen3_5", "gemma4"):
        rows = ttft.filter(pl.col("arch") == arch)
        speedup = rows["cold_ttft_ms"].median() / rows["cached_ttft_ms"].median()
        assert f"{arch} {speedup:.2f}x" in text  # the Finding quotes this run's medians, per family
    assert f"{ttft.height} of {ttft.height} cached requests matched a cold prefill" in text


def test_05_wrong_image_on_every_family(run):
    saved, nb = run
    wrong = saved.filter(pl.col("experiment") == "wrong image per family")
    ids_only = wrong.filter(pl.col("keys") == "ids-only")
    aware = wrong.filter(pl.col("keys") == "image-aware")
    assert ids_only["arch"].to_list() == aware["arch"].to_list() == ["qwen2_vl", "qwen3_5", "gemma4"]
    # ids-only keys replay the other picture's KV: all but the last token, and wrong logits
    assert (ids_only["reused_tokens"] == ids_only["prompt_tokens"] - 1).all()
    assert (ids_only["verify_diff"] > WRONG_KV_MIN).all() and not ids_only["matches_cold"].any()
    # image keys never reuse past the image's first placeholder, and match a cold run
    assert (aware["reused_tokens"] <= aware["image_starts_at"]).all()
    assert aware["matches_cold"].all() and (aware["verify_diff"] <= LOGIT_TOL).all()
    assert "image-aware keys reused past the image on 0 and matched cold on 3 of 3" in finding(nb)


def test_05_peers(run):
    # mlx-vlm's APC (on, off) and kvlab serve on the same mixed load; the APC audit's one disagreement
    saved, nb = run
    peers = saved.filter(pl.col("experiment") == "peers")
    assert sorted(peers["server"]) == ["kvlab serve", "mlx-vlm APC", "mlx-vlm APC off"]
    by = {r["server"]: r for r in peers.iter_rows(named=True)}
    assert by["mlx-vlm APC off"]["reused_tokens"] == 0 and by["mlx-vlm APC off"]["bytes_held"] == 0
    # APC's lookups count image prefixes they then drop: matched 208, restored (reused) 128
    assert (by["mlx-vlm APC"]["matched_tokens"], by["mlx-vlm APC"]["restored_tokens"]) == (208, 128)
    assert by["mlx-vlm APC"]["reused_tokens"] == 128
    assert by["kvlab serve"]["reused_tokens"] > by["mlx-vlm APC"]["reused_tokens"]
    assert len({r["prompt_tokens"] for r in by.values()}) == 1  # the same requests to every server
    text = finding(nb)
    best = peers.sort("ttft_ms_p50").row(0, named=True)["server"]
    most = peers.sort("reused_tokens", descending=True).row(0, named=True)
    assert f"mixed traffic {best} had the lowest TTFT p50" in text
    assert f"{most['server']} reused the most ({most['reused_tokens']} of {most['prompt_tokens']}" in text
    assert "APC audit: 1 of 5 steps disagree: image-a-repeat: APC's stats count a hit of 80 matched tokens" in text
