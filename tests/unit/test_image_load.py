"""Image load and the APC audit's arithmetic, without a server (issue 21 §3).

- the multimodal workload's turns send exactly the images they say: every data URL decodes to
  pixels whose hash (kvlab.vlm.image_hash) is the workload image's, in order, and nothing else
  (mutant caught: ``openai_images`` dropping image parts, i.e. text-only load);
- APC's block rules as kvlab models them give exact matched / reused / stored figures (mutants
  caught: a salt that ignores the image, and a matched prefix with image tokens counted as reused);
- the exact reusable prefix cuts at the first differing image (mutant: images ignored);
- start_mlx_vlm's settings: each becomes its APC_* variable; unknown or inert ones are refused.
"""

from __future__ import annotations

import pytest

pytest.importorskip("mlx_vlm")

import kvlab as kv  # noqa: E402
from kvlab.errors import RequestError  # noqa: E402
from kvlab.serving.apc_audit import ApcAudit, apc_block_rules, audit_sequence, reusable_prefix  # noqa: E402
from kvlab.serving.peer_venv import PeerError  # noqa: E402
from kvlab.serving.peers_vlm import apc_env  # noqa: E402
from kvlab.serving.sessions import openai_images, sessions_for  # noqa: E402
from kvlab.serving.workload_params import workload_kwargs  # noqa: E402
from kvlab.vlm import image_hash, load_image  # noqa: E402


def _sent(turn) -> list[str]:
    """The pixel hashes of the images a turn's messages carry, decoded from their data URLs."""
    out = []
    for m in turn.messages:
        if isinstance(m["content"], (list, tuple)):
            for p in m["content"]:
                if p.get("type") == "image_url":
                    url = p["image_url"]["url"]
                    assert url.startswith("data:image/png;base64,")
                    out.append(image_hash(load_image(url)))
    return out


def test_multimodal_turns_send_exactly_the_workload_images():
    wl = kv.workloads.multimodal(num_requests=6, seed=0, max_tokens=4)
    turns = [s.turns[0] for s in sessions_for("multimodal", users=6, seed=0, max_tokens=4)]
    assert [t.name for t in turns] == [r.name for r in wl] == [
        "text-1", "image-2-a", "text-3", "image-4-b", "text-5", "image-6-a"]
    want = [[image_hash(load_image(p["image"])) for p in r.messages[1]["content"] if isinstance(p, dict)
             and p.get("type") == "image"] if r.has_images else [] for r in wl]
    assert [_sent(t) for t in turns] == want == [list(t.images) for t in turns]
    a, b = want[1][0], want[3][0]
    assert want[5] == [a] and a != b  # image a repeats, b differs ...
    assert load_image(turns[1].messages[1]["content"][0]["image_url"]["url"]).size == (56, 56)
    assert load_image(turns[3].messages[1]["content"][0]["image_url"]["url"]).size == (56, 56)  # ... same size
    # the text parts and the system prompt go unchanged
    assert turns[1].messages[1]["content"][1] == {"type": "text", "text": "Describe this image in one sentence."}
    assert turns[1].messages[0] == wl[1].messages[0] and turns[0].messages == wl[0].messages


def test_traffic_text_and_images():
    text = [s.turns[0] for s in sessions_for("multimodal", users=4, traffic="text")]
    imgs = [s.turns[0] for s in sessions_for("multimodal", users=3, traffic="images", distinct_images=3)]
    assert [len(t.images) for t in text] == [0, 0, 0, 0]
    assert [len(set(_sent(t))) for t in imgs] == [1, 1, 1] and len({t.images for t in imgs}) == 3
    with pytest.raises(RequestError, match="traffic must be one of text, mixed, images"):
        kv.workloads.multimodal(traffic="video")


def test_load_parameters_of_the_multimodal_workload():
    assert workload_kwargs("multimodal", {"output_len": 4, "traffic": "text", "system_tokens": 80}) == {
        "max_tokens": 4, "traffic": "text", "system_tokens": 80}
    with pytest.raises(RequestError, match="prefix_len does not apply to the multimodal workload"):
        workload_kwargs("multimodal", {"prefix_len": 64})
    with pytest.raises(RequestError, match="colour is not a parameter of the multimodal workload"):
        workload_kwargs("multimodal", {"colour": "red"})


def test_openai_images_converts_array_parts_and_leaves_text():
    msgs = ({"role": "user", "content": "hi"},)
    assert openai_images(msgs) == (msgs, ())
    import numpy as np

    arr = np.zeros((28, 28, 3), np.uint8)
    arr[3, 5] = (1, 2, 3)
    out, hashes = openai_images(({"role": "user", "content": [{"type": "image", "image": arr}]},))
    assert hashes == (image_hash(load_image(arr)),) and _sent(kv.serving.sessions.Turn("t", 1, messages=out)) == list(hashes)


def test_apc_block_rules_exact_figures():
    img = 7
    sys_ids = tuple(range(100, 120))                      # 20 shared tokens
    text = sys_ids + tuple(range(200, 250))               # 70 tokens
    image = sys_ids + (img,) * 4 + tuple(range(300, 340))  # 64 tokens, image tokens at 20:24
    seq = [(text, ()), (text, ()), (image, ("a",)), (image, ("a",)), (image, ("b",))]
    rules = apc_block_rules(seq, 16, {img})
    # ids[:-1] is probed: text 69 tokens -> 4 blocks; image 63 -> 3 blocks (its 4th is stored, never probed)
    assert [r["matched"] for r in rules] == [0, 64, 0, 48, 0]  # text and image never share: one salt a request
    assert [r["reused"] for r in rules] == [0, 64, 0, 0, 0]    # tokens 0-47 hold the image: dropped
    assert [r["stored"] for r in rules] == [64, 0, 64, 0, 64]
    assert [r["hit"] for r in rules] == [False, True, False, True, False]


def test_apc_block_rules_drop_a_prefix_with_image_tokens_only():
    img = 7
    early = (1,) * 10 + (img,) * 4 + (2,) * 30  # image inside the first block
    late = (1,) * 40 + (img,) * 4 + (2,) * 3    # image after the last full block of ids[:-1]
    rules = apc_block_rules([(early, ("a",)), (early, ("a",)), (late, ("a",)), (late, ("a",))], 16, {img})
    assert [(r["matched"], r["reused"]) for r in rules] == [(0, 0), (32, 0), (0, 0), (32, 32)]


def test_reusable_prefix_cuts_at_the_first_different_image():
    ids = [1, 2, 9, 9, 3, 4]
    assert reusable_prefix(ids, [("a", 2)], [(ids, [("a", 2)])]) == 5        # n - 1
    assert reusable_prefix(ids, [("b", 2)], [(ids, [("a", 2)])]) == 2        # same ids, other image
    assert reusable_prefix(ids, [("b", 2)], [([1, 2, 5], [])]) == 2
    assert reusable_prefix(ids, [("b", 2)], [([1, 7], []), (ids, [("a", 2)])]) == 2


def test_audit_sequence_is_the_documented_order():
    seq = audit_sequence()
    assert [s for s, _ in seq] == ["text", "text-repeat", "image-a", "image-a-repeat", "image-b"]
    assert seq[0][1] == seq[1][1] and seq[2][1] == seq[3][1] and seq[2][1] != seq[4][1]
    hashes = [openai_images(m)[1] for _, m in seq]
    assert hashes[0] == () and hashes[2] == hashes[3] != hashes[4] and len(hashes[4]) == 1


def test_apc_env_sets_each_setting_and_refuses_unknown_or_inert_ones():
    assert apc_env(True, False, {"checkpoint_interval_tokens": 256, "block_size": 32}) == {
        "APC_ENABLED": "1", "APC_DISK_ENABLED": "0", "APC_CHECKPOINT_INTERVAL_TOKENS": "256",
        "APC_BLOCK_SIZE": "32"}
    assert apc_env(False, False, {}) == {"APC_ENABLED": "0", "APC_DISK_ENABLED": "0"}
    with pytest.raises(PeerError, match=r"unknown mlx-vlm APC setting\(s\) \['blocksize'\]"):
        apc_env(True, False, {"blocksize": 16})
    with pytest.raises(PeerError, match="given with apc=False"):
        apc_env(False, False, {"block_size": 16})


def test_apc_audit_repr_and_disagreements():
    import polars as pl

    rows = [{"step": "a", "prompt_tokens": 10, "prompt_tokens_kvlab": 10, "reusable_tokens": 9, "lookups_hit": 1,
             "lookups_miss": 0, "matched_tokens": 8, "restored_tokens": 0, "stored_tokens": 0, "cached_tokens": 0,
             "apc_matched": 8, "apc_hit": True, "apc_reused": 0, "apc_stored": 0, "same_reply": True,
             "other_image_same_ids": False}]
    audit = ApcAudit(pl.DataFrame(rows), {"apc_block_size": 8})
    assert repr(audit) == "ApcAudit(1 steps, 1 disagreeing, block_size=8)"
    assert "<table" in audit._repr_html_() and "restored 0" in audit._repr_html_()
    assert audit.findings()[0].startswith("a: APC's stats count a hit of 8 matched tokens but it restored 0")


def test_vlm_folder_names_and_refusals(tmp_path):
    from kvlab.serving.peers_vlm import vlm_folder
    from kvlab.vlm import ensure_tiny_arch, ensure_tiny_vlm

    assert vlm_folder("tiny-vlm") == vlm_folder("tiny-vlm:qwen2_vl") == vlm_folder("tiny") == ensure_tiny_vlm()
    assert vlm_folder("tiny-vlm:qwen3_5") == ensure_tiny_arch("qwen3_5")
    assert vlm_folder("tiny-vlm:gemma4") == ensure_tiny_arch("gemma4")
    with pytest.raises(PeerError, match=r"'tiny-vlm:mamba': kvlab builds no tiny mamba VLM; pass one of "
                                        r"tiny-vlm:qwen2_vl tiny-vlm:qwen3_5 tiny-vlm:gemma4"):
        vlm_folder("tiny-vlm:mamba")
    with pytest.raises(PeerError, match="neither tiny-vlm\\[:<model_type>\\] nor an mlx-vlm folder"):
        vlm_folder(tmp_path)


def test_an_image_turn_says_how_many_images_it_sends():
    turn = sessions_for("multimodal", users=2, max_tokens=3)[1].turns[0]
    assert repr(turn) == "Turn('image-2-a' chat messages=2 images=1 max_tokens=3)"
    assert "images=1" in turn._repr_html_()


def test_kvlab_load_multimodal_flags_are_checked_before_anything_is_sent(capsys):
    from kvlab.cli import main

    base = ["loadgen", "http://127.0.0.1:9", "--concurrency", "1", "--num-requests", "1", "--no-progress",
            "--workload", "multimodal"]
    assert main([*base, "--traffic", "text", "--turns", "2"]) == 2
    assert capsys.readouterr().err.startswith(
        "kvlab: error: --turns does not apply to the multimodal workload; it applies to multi_turn, agentic_loop.")
    assert main(["loadgen", "http://127.0.0.1:9", "--concurrency", "1", "--num-requests", "1", "--no-progress",
                 "--workload", "multi_turn", "--distinct-images", "3"]) == 2
    assert capsys.readouterr().err == ("kvlab: error: --distinct-images is not a parameter of the multi_turn "
                                       "workload; it takes turns, system_tokens, user_tokens, reply_tokens, max_tokens\n")
