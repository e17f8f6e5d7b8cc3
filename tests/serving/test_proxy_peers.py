"""kvlab proxy in front of plain mlx_lm.server (no kvlab code inside it) and vllm-mlx (from
.venv-peers) on the tiny model: a two-turn chat through the proxy records the cached tokens
mlx_lm.server itself reported (vllm-mlx reports none: the rows say unknown), and the proxy's
client-side token ids agree with each server's prompt counts. Stops what it starts."""

from __future__ import annotations

import json

import httpx
import pytest

import kvlab as kv
from kvlab.primitives.tokens import common_prefix_len
from kvlab.serving import peers
from kvlab.serving.record import read_records

pytestmark = [pytest.mark.model, pytest.mark.peers]
CHAT = "/v1/chat/completions"


def test_two_turns_through_the_proxy_record_what_mlx_lm_server_reported(tiny, tmp_path, system_prompt):
    path = tmp_path / "mlx_lm.jsonl"
    with peers.start_mlx_lm(tiny) as srv:
        pid = srv.pid
        with kv.proxy(srv.url, tokenizer=tiny, record=path) as p:
            msgs = [{"role": "system", "content": system_prompt},
                    {"role": "user", "content": "What is a prefix cache?"}]
            first = httpx.post(p.url + CHAT, timeout=120, json={
                "model": "default_model", "messages": msgs, "max_tokens": 6, "temperature": 0}).json()
            msgs += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Say it shorter."}]
            with httpx.stream("POST", p.url + CHAT, timeout=120, json={
                    "model": "default_model", "messages": msgs, "max_tokens": 6, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}) as r:
                assert r.status_code == 200
                data = [json.loads(line[6:]) for line in r.iter_lines()
                        if line.startswith("data: ") and line != "data: [DONE]"]
            rows = p.wait(2)
    assert not srv.running and pid not in [s.pid for s in peers.live()]
    second = data[-1]["usage"]
    usages = [first["usage"], second]
    reported = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    # mlx_lm.server's LRU prompt cache served the first turn's prompt to the second
    assert reported[1] > 0
    # mutant: reading cached tokens from the wrong field (or not from the stream's last chunk)
    assert [r["reused_tokens"] for r in rows] == reported
    assert [r["prompt_tokens"] for r in rows] == [u["prompt_tokens"] for u in usages]
    assert rows[1]["extends"] == 1
    ids = [kv.tokenise(tiny, msgs[:2]).ids, kv.tokenise(tiny, msgs).ids]
    assert rows[1]["common_prefix"] == common_prefix_len(*ids)

    recs = read_records(path)
    assert [r["reused_tokens"] for r in recs] == reported
    assert [r["upstream"] for r in recs] == [srv.url] * 2
    trace = kv.traces.read(path)
    assert trace.frame["input_length"].to_list() == [len(x) for x in ids]


def test_vllm_mlx_behind_the_proxy_reports_no_cached_tokens_and_the_rows_say_unknown(tiny, system_prompt):
    with peers.start_vllm_mlx(tiny, "batched") as srv, kv.proxy(srv.url, tokenizer=tiny) as p:
        model = httpx.get(p.url + "/v1/models", timeout=30).json()["data"][0]["id"]  # forwarded GET
        msgs = [{"role": "system", "content": system_prompt}, {"role": "user", "content": "Hi"}]
        for turn in range(2):
            body = {"model": model, "messages": list(msgs), "max_tokens": 4, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", p.url + CHAT, timeout=120, json=body) as r:
                assert r.status_code == 200
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            reply = "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e["choices"])
            msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "More."}]
        rows = p.wait(2)
        log = srv.cache_log()
    # its usage never carries cached tokens: the rows say unknown (None), not 0
    assert [r["reused_tokens"] for r in rows] == [None, None]
    assert [r["prompt_tokens"] for r in rows] == [r["upstream_prompt_tokens"] for r in rows]
    assert rows[1]["extends"] == 1 and rows[1]["common_prefix"] > 0
    # its own log saw both turns, with the prompt lengths the proxy tokenised on the client side
    assert log["prompt_tokens"].to_list() == [r["prompt_tokens"] for r in rows]
