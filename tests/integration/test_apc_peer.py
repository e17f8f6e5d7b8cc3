"""mlx-vlm's APC as a peer (issue 21 §3): its own server on loopback, APC on and off, each stopped
by pid; the tiny qwen2_vl (dense KV: APC's block mode, 16-token blocks).

What is asserted, exactly:
- the APC settings asked for are the ones the server reports (``/v1/settings``); APC off (run by
  ``kvlab peer mlx-vlm --no-prefix-cache``, which prints them and stops its server on SIGTERM)
  reports ``{"enabled": false}`` (mutant caught: the APC_* variables not passed to the server: APC stays
  off and start_mlx_vlm's read-back refuses it);
- after the ordered audit sequence (text, text again, image a, image a again, image b) APC's
  counters equal what its documented block rules give on kv.tokenise's ids, step by step, and
  the one disagreement between what it reports and what it reuses is measured exactly: the
  repeated image counts a hit of 80 matched tokens and restores 0 (its matched prefix holds the
  image's tokens, so it is dropped after the lookup counted it); APC-on answers equal APC-off
  answers (greedy, exact text: the tiny VLM runs float32 on CPU);
- image load through ``kv.generate_load`` reaches the server as images: its prompt counts equal
  kv.tokenise's for the same image messages, and APC's counters equal the rules' totals
  (mutant caught: image parts dropped from the load, text only: the prompt counts fall).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm")

import httpx  # noqa: E402

import kvlab as kv  # noqa: E402
from kvlab.bench.vlm_peers import measure  # noqa: E402
from kvlab.serving.apc_audit import apc_block_rules, audit_apc  # noqa: E402
from kvlab.serving.peers_vlm import start_mlx_vlm  # noqa: E402
from kvlab.serving.sessions import sessions_for  # noqa: E402

pytestmark = [pytest.mark.vlm, pytest.mark.model]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vlm():
    return kv.load_vlm("tiny")


@pytest.fixture(scope="module")
def servers():
    """APC on from start_mlx_vlm; APC off from ``kvlab peer mlx-vlm --no-prefix-cache`` (a child
    process started first, so both servers load at once); both stopped by pid."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    cli = subprocess.Popen([sys.executable, "-m", "kvlab.cli", "peer", "mlx-vlm", "--model", "tiny-vlm",
                            "--no-prefix-cache"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True, env=env, start_new_session=True)
    on = None
    try:
        on = start_mlx_vlm("tiny-vlm", block_size=16, checkpoint_interval_tokens=256)
        lines = []
        for line in cli.stdout:  # ends at EOF if the command exits
            lines.append(line)
            if "serving at" in line:
                break
        assert "serving at" in lines[-1], lines
        yield on, {"url": lines[-1].split("serving at ")[1].split()[0], "lines": lines, "process": cli}
    finally:
        if on is not None:
            on.stop()
            assert not on.running
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGTERM)
            cli.wait(60)


def _reset(server) -> None:
    r = httpx.post(f"{server.url}/v1/cache/reset", timeout=30)
    assert r.json() == {"enabled": True, "status": "cleared"}


def test_settings_are_recorded_as_the_server_reports_them(servers):
    on, off = servers
    rep = on.settings["reported"]
    assert on.settings["env"] == {"APC_ENABLED": "1", "APC_DISK_ENABLED": "0", "APC_BLOCK_SIZE": "16",
                                  "APC_CHECKPOINT_INTERVAL_TOKENS": "256"}
    assert (rep["apc_enabled"], rep["apc_disk_enabled"], rep["apc_block_size"],
            rep["apc_checkpoint_interval_tokens"], rep["apc_num_blocks"]) == (True, False, 16, 256, 2048)
    eff = on.settings["in_effect"]
    assert (eff["enabled"], eff["block_size"], eff["checkpoint_interval_tokens"], eff["exact_min_tokens"],
            eff["hash"], eff["memory_max_bytes"]) == (True, 16, 256, 16, "fast", on.cache_stats()["memory_max_bytes"])
    assert eff["memory_max_bytes"] > 0
    assert on.cache_stats()["block_size"] == 16 and on.url.startswith("http://127.0.0.1:") and on.running
    printed = next(x for x in off["lines"] if x.startswith("kvlab: APC settings"))
    assert "'apc_enabled': False" in printed and "'apc_disk_enabled': False" in printed
    assert off["url"].startswith("http://127.0.0.1:")
    assert httpx.get(f"{off['url']}/v1/cache/stats", timeout=10).json() == {"enabled": False}


def test_audit_reports_hits_it_does_not_reuse_and_answers_match_apc_off(servers, vlm):
    on, off = servers
    _reset(on)
    audit = audit_apc(on, off["url"], vlm, max_tokens=6)
    f = audit.frame
    col = lambda c: f[c].to_list()  # noqa: E731
    assert col("step") == ["text", "text-repeat", "image-a", "image-a-repeat", "image-b"]
    assert col("prompt_tokens") == col("prompt_tokens_kvlab") == [94, 94, 84, 84, 84]
    # exact shared prefix: text again all but the last token; image a after text: the system
    # prompt and the user header (66); image a again: 83; image b after a: up to its image (67)
    assert col("reusable_tokens") == [0, 93, 66, 83, 67]
    # what APC's rules give (dense block mode, one image salt a request) ...
    assert col("apc_matched") == [0, 80, 0, 80, 0]
    assert col("apc_reused") == [0, 80, 0, 0, 0]
    assert col("apc_stored") == [80, 0, 80, 0, 80]
    # ... is what its counters say, step by step
    assert col("matched_tokens") == col("apc_matched")
    assert col("restored_tokens") == col("apc_reused") == col("cached_tokens")
    assert col("stored_tokens") == col("apc_stored")
    assert col("lookups_hit") == [0, 1, 0, 1, 0] and col("lookups_miss") == [1, 0, 1, 0, 1]
    # the disagreement: a hit of 80 matched tokens counted for the repeated image, 0 reused
    bad = audit.disagreements()
    assert bad["step"].to_list() == ["image-a-repeat"]
    assert (bad["matched_tokens"][0], bad["restored_tokens"][0], bad["cached_tokens"][0]) == (80, 0, 0)
    assert col("same_reply") == [True] * 5 and all(col("reply"))
    assert col("other_image_same_ids") == [False, False, False, False, True]
    assert "image-b: same token ids as an earlier request with another image, and APC reused 0 tokens, none " \
           "past the image: it never replays the wrong image's KV (pitfall 2)" in audit.findings()
    said = [x for x in audit.findings() if x.startswith("image-a-repeat: APC's stats count")]
    assert said == ["image-a-repeat: APC's stats count a hit of 80 matched tokens but it restored 0 (usage "
                    "cached_tokens 0): its matched_tokens and token_hit_rate count tokens it did not reuse"]


def test_image_load_reaches_the_server_as_images(servers, vlm):
    on, _ = servers
    _reset(on)
    r = kv.generate_load(on.url, "multimodal", concurrency=1, num_requests=6, output_len=4, progress=False,
                         warmup=False)
    assert r.frame["ok"].to_list() == [True] * 6
    turns = [s.turns[0] for s in sessions_for("multimodal", users=6, max_tokens=4)]
    toks = [kv.tokenise(vlm, list(t.messages)) for t in turns]
    assert [len(t.images) for t in toks] == [0, 1, 0, 1, 0, 1]
    assert r.frame["prompt_tokens"].to_list() == [len(t.ids) for t in toks] == [94, 84, 92, 84, 89, 84]
    rules = apc_block_rules([(t.ids, tuple(i.hash for i in t.images)) for t in toks], 16, {vlm.image_token_id})
    d = r.server_delta()
    assert d["/v1/cache/stats:matched_tokens"] == sum(x["matched"] for x in rules) == 208
    assert d["/v1/cache/stats:restored_tokens"] == sum(x["reused"] for x in rules) == 128
    assert r.frame["reused_tokens"].to_list() == [x["reused"] for x in rules] == [0, 0, 64, 0, 64, 0]


def test_bench_arms_apc_on_and_off_on_mixed_traffic(servers):
    """The vlm_peers bench section's figures for its two APC arms (the kvlab serve arm needs a
    kvlab serve that takes VLMs). A block of the tiny VLM's KV is 4 layers x (K, V) x 2 heads x
    16 dims x 16 tokens x 4 bytes = 16 KiB; the warm-up request ("Hi") stores one block and the six
    requests 17 more (272 stored tokens)."""
    on, off = servers
    _reset(on)
    apc = measure(on.url, "APC mixed", "mixed", num_requests=6, output_len=4)
    assert (apc["prompt_tokens"], apc["reused_tokens"], apc["matched_tokens"], apc["restored_tokens"]) == (
        527, 128, 208, 128)
    assert apc["bytes_held"] == 18 * 4 * 2 * 2 * 16 * 16 * 4 == 294912
    plain = measure(off["url"], "APC off mixed", "mixed", num_requests=6, output_len=4)
    assert (plain["prompt_tokens"], plain["reused_tokens"], plain["matched_tokens"], plain["bytes_held"]) == (
        527, 0, None, 0)
    assert apc["ttft_ms_p50"] > 0 and plain["ttft_ms_p99"] >= plain["ttft_ms_p50"] > 0


def test_kvlab_peer_stops_its_server_on_sigterm(servers):
    """Last in this module: stops the APC-off server the others used."""
    _, off = servers
    proc = off["process"]
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)
    assert proc.returncode == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{off['url']}/health", timeout=5)


@pytest.mark.parametrize("arch, repeats", [("qwen3_5", [0, 93, 0, 83, 0]), ("gemma4", [0, 93, 0, 88, 0])])
def test_on_hybrid_and_sliding_apc_checkpoints_exact_repeats_and_its_counters_agree(arch, repeats):
    # tiny qwen3_5 (GatedDeltaNet + attention) and tiny gemma4 (sliding window + shared KV, images
    # seen whole): APC's exact-prompt checkpoints serve an identical request again, images included
    # (n - 1 tokens), never another image; matched == restored == usage on every step, answers
    # equal APC off, the prompt is kvlab's token for token. The dense block rules do not apply (no
    # predicted columns), so nothing disagrees. Mutant: applying the dense rules to these caches
    # -> false disagreements (qwen3_5: text-repeat 93 vs 80, image-a-repeat 83 vs 80).
    model = kv.load(f"tiny-vlm:{arch}")
    with start_mlx_vlm(model) as on, start_mlx_vlm(model, apc=False) as off:
        audit = audit_apc(on, off, model, max_tokens=6)
    f = audit.frame
    assert f["prompt_tokens"].to_list() == f["prompt_tokens_kvlab"].to_list()
    assert f["reusable_tokens"].to_list() == [0, 93, 66, repeats[3], 67]
    assert f["restored_tokens"].to_list() == f["matched_tokens"].to_list() == f["cached_tokens"].to_list() \
        == repeats
    assert f["apc_matched"].null_count() == f.height
    assert audit.disagreements().height == 0 and f["same_reply"].all()
