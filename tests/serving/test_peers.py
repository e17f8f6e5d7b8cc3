"""vllm-mlx 0.6.0 (the seeds' server, from .venv-peers) started by kvlab on the tiny model and
driven by `kvlab loadgen`: concurrent requests sharing a long prefix hit its prefix cache, and the
hit shows in time, not only in its counters. Stops what it starts."""

from __future__ import annotations

import json
import os
import statistics

import polars as pl
import pytest

import kvlab as kv
from kvlab.cli import main
from kvlab.serving import peers

pytestmark = [pytest.mark.model, pytest.mark.peers]

WARM_OVER_COLD = 0.5  # warm (prefix-hit) TTFT median at most half the cold one


def test_vllm_mlx_prefix_hit_is_visible_in_ttft(tiny, tmp_path, capsys):
    out = tmp_path / "vllm.parquet"
    with peers.start_vllm_mlx(tiny, "batched") as peer:
        assert peer.running and peer.url.startswith("http://127.0.0.1:")
        before = peer.cache_stats()["engine_cache"]
        # 10 requests, one shared 2048-token prefix with 64-token suffixes, two in flight at a time
        code = main(["loadgen", peer.url, "--workload", "prefix_repetition", "--tokenizer", "tiny",
                     "--concurrency", "2", "--num-requests", "10", "--prefix-len", "2048",
                     "--suffix-len", "64", "--output-len", "4", "--seed", "9", "--out", str(out),
                     "--json", "--no-progress"])
        assert code == 0
        after = peer.cache_stats()["engine_cache"]
        printed = json.loads(capsys.readouterr().out)
        # chat: vllm-mlx opens the stream with a role-only chunk before prefill; TTFT is the first
        # chunk with text, so with 2 output tokens it is most of the request's time
        chat = kv.generate_load(peer.url, "shared_system_prompt", concurrency=1, num_requests=2,
                            system_tokens=1500, max_tokens=2, progress=False)
        pid, home = peer.pid, peer.home
    assert not peer.running and not home.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    # its log's per-request lookups (what it reported, request by request) for the 10 load requests
    log = peer.cache_log().filter(pl.col("prompt_tokens") == 2112)
    assert log.height == 10 and log.filter(pl.col("hit")).height >= 8
    assert (log.filter(pl.col("hit"))["cached"] >= 2048).all()
    f = pl.read_parquet(out).sort("request")
    assert f["ok"].all() and (f["prompt_tokens"] == 2112).all()
    assert printed["completed"] == 10 and printed["prompt_token_mismatches"] == 0
    assert f["reused_tokens"].is_null().all()          # vllm-mlx's usage never reports cached tokens
    # its own counters: the 8 requests after the first two hit the 2048-token prefix
    assert after["hits"] - before["hits"] >= 8
    assert after["tokens_saved"] - before["tokens_saved"] >= 8 * 2048
    assert printed["server_delta"]["/v1/cache/stats:engine_cache.tokens_saved"] == \
        after["tokens_saved"] - before["tokens_saved"]
    # ... and in time: the first two prefilled all 2112 tokens, the rest only their suffix
    cold = statistics.median(f["ttft_ms"][:2].to_list())
    warm = statistics.median(f["ttft_ms"][2:].to_list())
    assert warm < WARM_OVER_COLD * cold, f"warm TTFT {warm:.0f} ms vs cold {cold:.0f} ms"
    c = chat.frame.row(0, named=True)
    assert chat.frame["ok"].all() and c["output_tokens"] == 2
    assert c["ttft_ms"] > 0.5 * c["e2el_ms"], c


def test_a_bad_mode_or_model_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(peers.PeerError, match="unknown vllm-mlx mode"):
        peers.start_vllm_mlx("tiny", "turbo")
    with pytest.raises(Exception, match="neither a known model name nor a local folder"):
        peers.start_mlx_lm(str(tmp_path / "nope"))
    assert not peers.live()


def test_the_peers_venv_is_made_once(monkeypatch):
    path = peers.ensure_peers_venv()  # made by scripts/setup.sh (or the first peer started)
    assert (path / ".kvlab-peers-installed").read_text().startswith(peers.VLLM_MLX)

    def no_pip(*a, **k):
        raise AssertionError(f"reinstalled: {a}")
    monkeypatch.setattr(peers.subprocess, "run", no_pip)
    assert peers.ensure_peers_venv() == path  # the stamp says it is there: nothing runs
    monkeypatch.setenv("KVLAB_PEERS_VENV", str(path))
    assert peers.peers_venv() == path


def test_a_keyed_kvlab_serve_is_asked_for_health_with_its_key(tmp_path):
    """A child ``kvlab serve --api-keys`` keys /health too: started with one of its keys it serves;
    started without, the launcher stops it at the first 401 and says to pass a key, rather than
    waiting out its timeout. Mutant caught: a probe that drops ``health_key`` (the first start
    fails) or one that treats 401 as "not up yet" (the second waits 120 s and reports a timeout)."""
    keys = tmp_path / "keys"
    keys.write_text("ka alice\n")
    tenants = ["--api-keys", keys, "--tenant-secret", tmp_path / "secret"]
    with peers.start_kvlab_serve("tiny", "radix", extra_args=tenants, health_key="ka") as server:
        assert server.running
    assert not server.running
    with pytest.raises(peers.PeerError, match="answered /health with 401: it keys every route; pass one"):
        peers.start_kvlab_serve("tiny", "radix", extra_args=tenants, timeout=120.0)
