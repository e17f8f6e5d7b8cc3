"""--record: one whole JSON line per finished request; kv.traces.read reads it, kv.simulate
replays it to the hit rate the server measured (up to block rounding), kv.Engine replays it, and
SIGTERM loses no finished request."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import polars as pl
import pytest

import kvlab as kv
from kvlab.serving.record import read_records, workload

pytestmark = [pytest.mark.serving, pytest.mark.model]
ROOT = Path(__file__).resolve().parents[2]
USERS = ["What is a prime?", "What is a prefix cache?", "Why is the sky blue?", "Name a river.",
         "What is two plus two?", "Who wrote Hamlet?", "What is a prime?"]


def _run(server, system_prompt):
    for u in USERS:  # one at a time: what is resident at each lookup is then what a replay sees
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "system", "content": system_prompt}, {"role": "user", "content": u}],
            "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200


@pytest.mark.parametrize("store", ["radix", "paged"])
def test_recording_replays_to_the_measured_hit_rate(start, tmp_path, system_prompt, tiny, store):
    path = tmp_path / "runs" / f"{store}.jsonl"
    server = start(store, record=path, record_text=True, block_size=16)
    _run(server, system_prompt)
    server.stop()
    recs = read_records(path)
    results = server.results
    assert len(recs) == len(USERS) == len(results)
    assert [r["input_length"] for r in recs] == [r.prompt_tokens for r in results]
    assert [r["reused_tokens"] for r in recs] == [r.reused_tokens for r in results]
    assert [r["output_ids"] for r in recs] == [list(r.output_ids) for r in results]
    assert all(r["status"] == "ok" and r["store"] == store and r["ttft_s"] <= r["e2e_s"] for r in recs)

    for rec in recs:  # kvlab's chained block hashes of the prompt (full blocks, then the partial one)
        full = [int.from_bytes(h[:8], "little") & (2**63 - 1) for h in kv.block_hashes(rec["prompt_ids"], 16)]
        assert rec["kvlab_hash_ids"][:len(full)] == full
        assert len(rec["kvlab_hash_ids"]) == -(-rec["input_length"] // 16)

    mooncake = kv.traces.read(path)  # the Mooncake fields; kvlab's extra fields are ignored
    assert mooncake.block_size == 512 and len(mooncake) == len(USERS)
    assert mooncake.frame["hash_ids"].list.len().to_list() == [-(-r["input_length"] // 512) for r in recs]

    # replay at the server's block size, policy and capacity (bytes / KV bytes per token)
    trace = kv.traces.read(path, block_size=16, hash_field="kvlab_hash_ids")
    stored = server.events.filter(pl.col("event").is_in(["insert", "block_stored"]))
    capacity = server.budget_bytes // (stored["bytes"].sum() // stored["tokens"].sum())
    sim = kv.simulate(trace, "lru", capacity_tokens=capacity)
    assert sim.summary["evictions"] == 0 and server.stats()["evictions"] == 0
    reused = [r["reused_tokens"] for r in recs]
    # the documented rounding: the simulator reuses whole 16-token blocks, the radix store tokens;
    # the paged store reuses whole blocks too, so it matches exactly
    expected = [16 * (n // 16) for n in reused]
    if store == "paged":
        assert reused == expected
    assert sim.requests["hit_tokens"].to_list() == expected
    measured = sum(reused) / sum(r["input_length"] for r in recs)
    assert measured - sim.summary["token_hit_rate"] < 16 * sum(n > 0 for n in reused) / sum(
        r["input_length"] for r in recs) + 1e-12
    n = recs[-1]["input_length"]  # the repeated question: all but the last token (paged: in blocks)
    assert reused[-1] == (16 * ((n - 1) // 16) if store == "paged" else n - 1)

    # the same requests through an Engine: same reuse per request, same greedy tokens
    engine = kv.Engine(tiny, kv.make_store(store, block_size=16))
    engine.run_all(workload(path))
    assert [r.reused_tokens for r in engine.results] == reused
    assert [list(r.output_ids) for r in engine.results] == [r["output_ids"] for r in recs]


def test_lines_have_no_text_unless_asked(start, tmp_path):
    path = tmp_path / "r.jsonl"
    server = start("radix", record=path)
    httpx.post(server.url + "/v1/chat/completions", timeout=60,
               json={"messages": [{"role": "user", "content": "private words"}], "max_tokens": 2})
    server.stop()
    line = path.read_text()
    assert "private" not in line and "prompt_ids" not in line and "output_ids" not in line
    rec = json.loads(line)
    assert rec["input_length"] > 0 and rec["kvlab_block_size"] == 16 and rec["normalise"] is False
    with pytest.raises(kv.KvlabError, match="record-text"):
        workload(path)


def test_sigterm_loses_no_finished_request(tmp_path):
    path = tmp_path / "cli.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVLAB_API_KEY": ""}
    proc = subprocess.Popen([sys.executable, "-m", "kvlab.cli", "serve", "--model", "tiny", "--port", "0",
                             "--record", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, line + proc.stderr.read()
        url = line.split()[2]
        done = 0
        for i in range(5):
            r = httpx.post(url + "/v1/chat/completions", timeout=60,
                           json={"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 3})
            assert r.status_code == 200
            done += 1
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    assert "stopped after 5 requests" in err
    lines = path.read_text().splitlines()
    assert len(lines) == done == 5
    assert [json.loads(x)["request"] for x in lines] == [1, 2, 3, 4, 5]
