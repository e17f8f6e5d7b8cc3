"""kv.generate_load against a real server on loopback: plain mlx_lm.server on the tiny model, started
and stopped by kvlab.serving.peers. Reuse counts are exact where mlx-lm's LRUPromptCache makes
them deterministic (requests sent one at a time)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

import kvlab as kv
from kvlab.cli import main
from kvlab.errors import KvlabError
from kvlab.serving import loadgen, metrics, peers

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def server(tiny):
    with peers.start_mlx_lm(tiny) as srv:
        yield srv
    assert not srv.running


def test_multi_turn_sends_the_servers_own_replies_back(server, tiny):
    r = kv.generate_load(server.url, "multi_turn", concurrency=2, num_requests=6, turns=3, max_tokens=24,
                     keep_text=True, seed=11, progress=False)
    f = r.frame
    assert f["ok"].all() and f.height == 6
    assert sorted(zip(f["session"], f["turn"])) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    ss = kv.serving.sessions.sessions_for("multi_turn", users=2, turns=3, max_tokens=24, seed=11)
    for s in ss:
        rows = f.filter(pl.col("session") == s.index).sort("turn")
        replies = rows["reply"].to_list()
        for k, turn in enumerate(s.turns):
            sent = turn.with_replies(replies[:k])
            # the server counted exactly the conversation with its own earlier replies in it
            assert rows["prompt_tokens"][k] == len(kv.tokenise(tiny, sent).ids)
            if k:
                canned = len(kv.tokenise(tiny, list(turn.messages)).ids)
                assert rows["prompt_tokens"][k] != canned  # the workload's canned replies were not sent
    assert (f["reused_source"] == "usage").all()
    assert f.filter(pl.col("turn") > 0)["reused_tokens"].min() > 0  # later turns reuse the earlier ones


def test_prefix_repetition_ids_round_trip_and_reuse_is_exact(server, tiny):
    r = kv.generate_load(server.url, "prefix_repetition", tokenizer=tiny, concurrency=1, num_requests=5,
                     prefix_len=512, suffix_len=64, output_len=4, seed=21, progress=False)
    f = r.frame
    assert f["ok"].all()
    assert (f["prompt_tokens"] == 576).all() and (f["prompt_tokens_expected"] == 576).all()
    assert f["reused_tokens"].to_list() == [0, 512, 512, 512, 512]
    s = r.summary
    assert s["prompt_token_mismatches"] == 0 and s["reused_tokens"] == 4 * 512
    assert s["token_hit_rate"] == pytest.approx(4 * 512 / (5 * 576))
    assert s["request_hit_rate"] == pytest.approx(4 / 5)
    assert (f["output_tokens"] == 4).all() and s["total_output_tokens"] == 20
    assert s["request_throughput"] == pytest.approx(5 / r.duration_s)
    for row in f.iter_rows(named=True):  # the frame's latencies agree with each other
        assert 0 < row["ttft_ms"] <= row["e2el_ms"]
        assert row["tpot_ms"] == pytest.approx((row["e2el_ms"] - row["ttft_ms"]) / 3)


def test_trace_replay_keeps_the_traces_prefix_sharing(server, tiny):
    frame = pl.DataFrame({"timestamp": [0, 1, 2, 3], "input_length": [1536, 1536, 300, 1800],
                          "output_length": [3, 3, 3, 3], "hash_ids": [[0, 1, 2], [0, 1, 3], [4], [0, 1, 2, 5]]},
                         schema=kv.traces.SCHEMA)
    r = kv.generate_load(server.url, kv.traces.Trace(frame, 512), tokenizer=tiny, block_tokens=64,
                     concurrency=1, progress=False)
    f = r.frame.sort("request")
    assert f["ok"].all()
    assert f["prompt_tokens"].to_list() == [192, 192, 38, 225] == f["prompt_tokens_expected"].to_list()
    # row 1 shares 2 blocks of 64 with row 0; row 2 nothing; row 3 all of row 0's 3 blocks
    assert f["reused_tokens"].to_list() == [0, 128, 0, 192]


def test_rate_arrivals_and_duration_cap(server):
    r = kv.generate_load(server.url, "shared_system_prompt", rate=20.0, duration=1.0, users=200,
                     system_tokens=672, max_tokens=2, seed=5, progress=False)
    f = r.frame
    # Only what the clock cannot change is asserted exactly: an arrival due near the cap may be
    # dropped when the event loop wakes late on a busy machine (asserted: not one due 250 ms before it).
    # Mutants caught: the cap ignored (all 200 arrivals sent), requests sent before their arrival,
    # arrivals not the planned Poisson process, a cap that stops at half the duration.
    planned = [a for a in loadgen._arrivals([None] * 200, 20.0, 5) if a < 1.0]
    well_before = sum(a < 0.75 for a in planned)
    assert well_before <= f.height <= len(planned)            # no arrival past the cap is ever sent
    assert (f["scheduled_s"] < 1.0).all()
    assert (f["start_s"] >= f["scheduled_s"] - 1e-3).all()   # never sent before its arrival
    assert sorted(f["scheduled_s"].to_list()) == pytest.approx(planned[: f.height], abs=1e-9)


def test_outputs_under_concurrency_equal_the_same_requests_alone_without_cache(server, tiny):
    kw = dict(users=6, system_tokens=672, max_tokens=12, record_tokens=True, seed=3, progress=False)
    together = kv.generate_load(server.url, "shared_system_prompt", concurrency=4, **kw)
    with peers.start_mlx_lm(tiny, prompt_cache_size=0) as off:
        alone = kv.generate_load(off.url, "shared_system_prompt", concurrency=1, **kw)
    assert together.frame["ok"].all() and alone.frame["ok"].all()
    assert (alone.frame["reused_tokens"] == 0).all()              # the reference really ran uncached
    assert together.frame["reused_tokens"].max() > 100            # and the concurrent run reused
    assert all(len(x) == 12 for x in together.frame["output_ids"].to_list())
    c = metrics.compare_outputs(together.frame, alone.frame)
    assert c.height == 6
    bad = c.filter(~pl.col("ok"))
    assert bad.height == 0, f"flips above the {metrics.GAP_TOL} top-2 gap: {bad.to_dicts()}"


def test_timeouts_fail_the_request_and_end_its_session(server):
    r = kv.generate_load(server.url, "multi_turn", concurrency=2, num_requests=6, turns=3,
                     timeout=0.001, warmup=False, progress=False)
    f = r.frame
    assert f.height == 2 and not f["ok"].any()                   # one failed turn ends each session
    assert all(e.startswith("timeout after") for e in f["error"].to_list())
    assert r.summary["completed"] == 0


def test_an_unreachable_server_is_a_clear_error():
    with pytest.raises(KvlabError, match="cannot connect"):
        kv.generate_load(f"http://127.0.0.1:{peers.free_port()}", "multi_turn", concurrency=1,
                     num_requests=1, progress=False)


def test_cli_load_prints_json_and_writes_parquet(server, tmp_path, capsys):
    out = tmp_path / "runs" / "load.parquet"
    code = main(["loadgen", server.url, "--workload", "shared_system_prompt", "--concurrency", "2",
                 "--num-requests", "4", "--max-tokens", "3", "--system-tokens", "672", "--out", str(out),
                 "--json", "--no-progress"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["completed"] == 4 and printed["label"] == "shared_system_prompt@c2"
    f = pl.read_parquet(out)
    assert f.height == 4 and set(metrics.SCHEMA) <= set(f.columns)
    assert f["output_tokens"].to_list() == [3, 3, 3, 3]


def test_cli_load_prints_definitions_and_aiperfs_figures_beside_its_own(server, tiny, tmp_path, capsys):
    # catches: itl_ms_*/tpot_ms_* printed without saying which is which; the finish chunk counted
    # as a token against a live mlx-lm server (8 gaps for 8 tokens); --compare-aiperf ignored
    export = Path(__file__).parents[1] / "data" / "aiperf" / "profile_export_aiperf.json"
    out = tmp_path / "load.parquet"
    code = main(["load", server.url, "--workload", "prefix_repetition", "--tokenizer", str(tiny.path),
                 "--concurrency", "2", "--num-requests", "4", "--prefix-len", "32", "--suffix-len", "32",
                 "--output-len", "8", "--out", str(out), "--no-progress", "--compare-aiperf", str(export)])
    assert code == 0
    text = capsys.readouterr().out
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "output_throughput", "request_throughput"):
        assert f"  {metrics.DEFINITIONS[name]}\n" in text
    ttft = next(line for line in text.splitlines() if line.strip().startswith("ttft_ms") and " p50 " in line)
    assert "946.5" in ttft and ttft.endswith("time_to_first_token.p50 (ms)")  # AIPerf's value, from the file
    f = pl.read_parquet(out)
    assert f["output_tokens"].to_list() == [8, 8, 8, 8] and (f["output_tokens_source"] == "usage").all()
    assert f["itl_ms"].list.len().to_list() == [7, 7, 7, 7]  # tokens - 1 gaps


def test_load_result_reprs(server):
    r = kv.generate_load(server.url, "shared_system_prompt", concurrency=1, num_requests=1, max_tokens=2,
                     progress=False)
    assert repr(r).startswith("LoadResult('shared_system_prompt@c1': 1/1 ok")
    assert "ttft_ms_p50" in r._repr_html_() and "\n" not in repr(r)
    assert r.summary_frame().height == 1


def test_bench_serving_table_side_by_side(tiny):
    from kvlab.bench import REGISTRY, serving

    assert REGISTRY["serving"] is serving and serving.NEEDS_MODEL
    t = serving.bench_serving(tiny, 2, concurrency=(1, 2), servers=[serving.PLAIN], requests=4,
                              prefix_len=256, suffix_len=32, output_len=4)
    assert [r[:2] for r in t.rows] == [(serving.PLAIN, 1), (serving.PLAIN, 2)]
    assert all(r[-2:] == ("1.00x", "1.00x") for r in t.rows)  # the reference against itself
    # 4 requests of 288 tokens, the 256-token prefix reused by the 3 after the first (concurrency 1)
    assert t.rows[0][6] == f"{3 * 256 / (4 * 288):.1%}"
    assert "kvlab bench --only serving" in t.command and "Target" in t.notes
    with pytest.raises(KvlabError, match="unknown server"):
        serving.bench_serving(tiny, 1, servers=["nginx"])
