"""The load generator's pieces without a server: vLLM's metric definitions, the summary, arrivals,
caps, sessions (replies sent back), trace prompt synthesis, the correctness comparison and the
prefill-time fit."""

from __future__ import annotations

import asyncio
import time
from html import escape as html_escape
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest

import kvlab as kv
from kvlab.errors import RequestError, TraceError
from kvlab.serving import client, loadgen, metrics, savings, sessions, workload_params
from sse_events import sse_events


# --------------------------------------------------------------------------------- metrics

def test_request_metrics_follow_vllm_definitions():
    # send at 10.0 s; token chunks at 10.5, 10.6, 10.8, 11.2; 4 output tokens
    m = metrics.request_metrics(10.0, [10.5, 10.6, 10.8, 11.2], 4)
    assert m["ttft_ms"] == pytest.approx(500.0)
    assert m["e2el_ms"] == pytest.approx(1200.0)
    assert m["itl_ms"] == pytest.approx([100.0, 200.0, 400.0])
    assert m["tpot_ms"] == pytest.approx((1200.0 - 500.0) / 3)  # (E2EL - TTFT) / (n - 1)
    # a server that bundles tokens into fewer chunks: TPOT uses the token count, ITL the chunks
    m = metrics.request_metrics(0.0, [0.2, 1.0], 9)
    assert m["tpot_ms"] == pytest.approx(800.0 / 8) and m["itl_ms"] == pytest.approx([800.0])
    # one output token: no TPOT (vLLM leaves it out of the statistics)
    assert metrics.request_metrics(0.0, [0.3], 1)["tpot_ms"] is None
    assert metrics.request_metrics(0.0, [], None)["ttft_ms"] is None


def _rows():
    rows = []
    for i, (ttft, e2el, out, prompt, reused) in enumerate(
            [(100, 1000, 10, 600, 0), (50, 700, 5, 600, 512), (20, 30, 1, 600, 512),
             (80, 900, 10, 600, None)]):
        rows.append({"request": i, "session": i, "turn": 0, "ok": True, "ttft_ms": float(ttft),
                     "e2el_ms": float(e2el), "output_tokens": out, "prompt_tokens": prompt,
                     "reused_tokens": reused, "itl_ms": [10.0 * (i + 1)] * max(0, out - 1),
                     "tpot_ms": (e2el - ttft) / (out - 1) if out > 1 else None,
                     "prompt_tokens_expected": 600})
    rows.append({"request": 4, "session": 4, "turn": 0, "ok": False, "error": "HTTP 500",
                 "ttft_ms": 1.0, "e2el_ms": 1.0, "output_tokens": 99, "prompt_tokens": 5})
    return rows


def test_summary_counts_only_successful_requests_and_names_both_hit_rates():
    f = metrics.frame_of(_rows())
    s = metrics.summarise(f, duration_s=2.0)
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["request_throughput"] == pytest.approx(4 / 2.0)       # the failed one is not counted
    assert s["total_output_tokens"] == 26 and s["output_throughput"] == pytest.approx(26 / 2.0)
    assert s["ttft_ms_p50"] == pytest.approx(np.percentile([100, 50, 20, 80], 50))
    assert s["ttft_ms_p99"] == pytest.approx(np.percentile([100, 50, 20, 80], 99))
    assert s["e2el_ms_mean"] == pytest.approx(np.mean([1000, 700, 30, 900]))
    # TPOT leaves out the one-token request; ITL pools every gap of every request
    assert s["tpot_ms_p50"] == pytest.approx(np.median([900 / 9, 650 / 4, 820 / 9]))
    assert s["itl_ms_mean"] == pytest.approx(np.mean([10.0] * 9 + [20.0] * 4 + [40.0] * 9))
    # hit rates over the 3 requests whose server reported reuse: per token and per request
    assert s["reuse_known"] == 3 and s["reused_tokens"] == 1024
    assert s["token_hit_rate"] == pytest.approx(1024 / 1800)
    assert s["request_hit_rate"] == pytest.approx(2 / 3)
    assert s["prompt_token_mismatches"] == 0


def test_a_load_run_as_one_results_row():
    r = loadgen.LoadResult(metrics.frame_of(_rows()), 2.0, {"label": "x"})
    row = r.row(section="s", concurrency=4)
    assert list(row)[:2] == ["section", "concurrency"] and list(row)[2:] == list(loadgen.ROW_FIELDS)
    assert (row["completed"], row["reused_tokens"]) == (4, 1024)
    assert row["token_hit_rate"] == pytest.approx(1024 / 1800) == r.summary["token_hit_rate"]


def test_compare_outputs_reports_first_difference_and_gap():
    def frame(ids_list, gaps_list):
        return metrics.frame_of([{"request": i, "session": i, "turn": 0, "ok": True, "name": f"r{i}",
                                  "output_ids": ids, "top2_gap": gaps}
                                 for i, (ids, gaps) in enumerate(zip(ids_list, gaps_list))])
    ref = frame([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [[1.0, 0.5, 0.2], [1.0, 0.0004, 0.3], [1.0, 2.0, 3.0]])
    got = frame([[1, 2, 3], [4, 9, 9], [7, 1, 1]], [[1.0] * 3] * 3)
    c = metrics.compare_outputs(got, ref).sort("session")
    assert c["equal"].to_list() == [True, False, False]
    assert c["first_diff"].to_list() == [None, 1, 1]
    assert c["gap"].to_list() == [None, 0.0004, 2.0]
    assert c["ok"].to_list() == [True, True, False]  # a near-tie flip passes, a 2.0 gap fails


# --------------------------------------------------------------------------------- chunks, definitions

STREAM = Path(__file__).parents[1] / "data" / "streams" / "mlx_lm_chat_8_tokens.sse"


def _chunks(events):
    from openai.types.chat import ChatCompletionChunk

    async def gen():
        for e in events:
            yield ChatCompletionChunk.construct(**e)  # what the SDK does: no validation (mlx-lm sends
            # its usage chunk as "chat.completion")
    return gen()


def test_the_closing_finish_reason_chunk_is_not_a_token():
    # catches: a chunk with only finish_reason counted as a token (9 times, 8 gaps for 8 tokens)
    events = sse_events(STREAM.read_bytes())  # recorded from kvlab serve (mlx-lm's server), max_tokens 8
    closing = events[-2]["choices"][0]
    assert closing["finish_reason"] == "length" and "content" not in closing["delta"]
    out = asyncio.run(client.read_stream(_chunks(events), "chat"))
    assert out["usage"]["completion_tokens"] == 8 and out["finish_reason"] == "length"
    assert len(out["times"]) == 8
    m = metrics.request_metrics(0.0, out["times"], out["usage"]["completion_tokens"])
    assert len(m["itl_ms"]) == 8 - 1  # exactly tokens - 1 gaps
    assert out["text"] == "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])


def test_reasoning_and_tool_call_deltas_are_tokens_role_only_chunks_are_not():
    # catches: only text content counted (a reasoning model's thinking would have no TTFT)
    base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    deltas = [{"role": "assistant"}, {"reasoning": "hm"}, {"content": "Hi"},
              {"tool_calls": [{"index": 0, "id": "c", "type": "function",
                               "function": {"name": "f", "arguments": "{}"}}]}, {}]
    events = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": "stop" if i == 4 else None}]}
              for i, d in enumerate(deltas)]
    out = asyncio.run(client.read_stream(_chunks(events), "chat"))
    assert len(out["times"]) == 3 and out["text"] == "Hi" and out["finish_reason"] == "stop"


class _Canned(client.Sender):
    """A Sender whose HTTP call returns a canned streamed reply: content chunks at 0.5, 0.6, 0.8 s."""

    async def _send(self, turn, replies, t_send):
        return {"text": "abc", "usage": self.usage, "times": [t_send + 0.5, t_send + 0.6, t_send + 0.8],
                "finish_reason": "stop"}


def test_output_tokens_come_from_usage_else_from_content_chunks():
    # catches: a server without usage leaves output_tokens null (0 tokens/s in the summary)
    turn = sessions.sessions_for("multi_turn", users=1, turns=1)[0].turns[0]
    send = _Canned(None, "m")
    send.usage = None
    row, _ = asyncio.run(send(turn, [], 0.0))
    assert (row["output_tokens"], row["output_tokens_source"]) == (3, "chunks")
    assert row["tpot_ms"] == pytest.approx(150.0) and row["itl_ms"] == pytest.approx([100.0, 200.0])
    send.usage = {"completion_tokens": 5, "prompt_tokens": 9}
    row, _ = asyncio.run(send(turn, [], 0.0))
    assert (row["output_tokens"], row["output_tokens_source"]) == (5, "usage")
    assert row["tpot_ms"] == pytest.approx(300.0 / 4)
    s = metrics.summarise(metrics.frame_of([{**row, "request": 0}]), 1.0)
    assert s["output_tokens_source"] == "usage" and s["output_throughput"] == 5.0


def test_sender_repr():
    # catches: __repr__/_repr_html_ defined outside the class (dead code after a return)
    send = client.Sender(None, "default_model", timeout=30.0)
    assert repr(send) == "Sender('default_model', streamed, timeout=30s)"
    assert send._repr_html_() == "<code>Sender(&#x27;default_model&#x27;, streamed, timeout=30s)</code>"
    assert repr(client.Sender(None, "m", record_tokens=True)) == "Sender('m', logprobs, timeout=120s)"


def test_every_printed_latency_carries_its_definition():
    # catches: a figure shown without its definition, or TPOT/ITL definitions swapped
    assert metrics.legend(["ttft_ms_p50", "itl_ms_p50", "completed", "itl_ms_mean"]) == [
        metrics.DEFINITIONS["ttft_ms"], metrics.DEFINITIONS["itl_ms"]]
    assert metrics.DEFINITIONS["tpot_ms"].startswith("TPOT: per request (E2EL - TTFT) / (output_tokens - 1)")
    assert "AIPerf: inter_token_latency" in metrics.DEFINITIONS["tpot_ms"]
    assert "AIPerf: inter_chunk_latency" in metrics.DEFINITIONS["itl_ms"]
    r = loadgen.LoadResult(metrics.frame_of(_rows()), 2.0, {"label": "x"})
    html = r._repr_html_()
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "output_throughput", "request_throughput"):
        assert html_escape(metrics.DEFINITIONS[name]) in html
    assert len(metrics.legend(r.summary)) == len(metrics.DEFINITIONS)


# --------------------------------------------------------------------------------- arrivals, caps

def test_poisson_arrivals_are_seeded_with_the_requested_rate():
    ss = [sessions.Session(i, ()) for i in range(4000)]
    a = loadgen._arrivals(ss, 5.0, seed=3)
    assert a == loadgen._arrivals(ss, 5.0, seed=3) and a != loadgen._arrivals(ss, 5.0, seed=4)
    gaps = np.diff(a)
    assert a[0] == 0.0 and (gaps >= 0).all()
    assert np.mean(gaps) == pytest.approx(1 / 5.0, rel=0.05)
    assert np.std(gaps) == pytest.approx(1 / 5.0, rel=0.08)  # exponential: std == mean


def test_budget_stops_at_the_count_and_at_the_duration():
    b = loadgen._Budget(3, None, time.perf_counter())
    assert [b.take() for _ in range(5)] == [0, 1, 2, None, None]
    b = loadgen._Budget(100, 0.05, time.perf_counter())
    assert b.take() == 0
    time.sleep(0.06)
    assert b.take() is None


@pytest.mark.parametrize("kw, msg", [
    (dict(), "concurrency=N"), (dict(concurrency=0), "positive int"), (dict(rate=-1.0), "positive number"),
    (dict(concurrency=2, duration=float("inf")), "positive number"),
    (dict(concurrency=2, num_requests=2.5), "positive int")])
def test_bad_arguments_say_what_to_pass(kw, msg):
    with pytest.raises(RequestError, match=msg):
        kv.generate_load("http://127.0.0.1:9", "multi_turn", progress=False, **kw)


def test_url_must_be_http():
    with pytest.raises(RequestError, match="http://"):
        kv.generate_load("127.0.0.1:8080", "multi_turn", concurrency=1)


# --------------------------------------------------------------------------------- sessions

def test_chat_sessions_send_the_real_replies_back():
    ss = sessions.sessions_for("multi_turn", users=2, turns=3)
    assert [len(s.turns) for s in ss] == [3, 3]
    assert ss[0].turns[0].messages != ss[1].turns[0].messages  # each user its own seed
    third = ss[0].turns[2].with_replies(["first reply", "second reply"])
    assert [m["content"] for m in third if m["role"] == "assistant"] == ["first reply", "second reply"]
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant", "user"]
    # everything but the assistant messages is the workload's own
    canned = ss[0].turns[2].messages
    assert [m for m in third if m["role"] != "assistant"] == [m for m in canned if m["role"] != "assistant"]
    with pytest.raises(RequestError, match="earlier replies"):
        ss[0].turns[2].with_replies(["only one"])


def test_a_workloads_standalone_requests_go_as_recorded_with_their_tools():
    from kvlab.workloads import CAUSES

    wl = CAUSES["tools_reordered"].generate(turns=3)
    ss = sessions.sessions_for(wl)
    assert [len(s.turns) for s in ss] == [1, 1, 1]  # one request each, in the workload's order
    third = ss[2].turns[0]
    # the canned history (assistant tool calls included) is what the request measures
    assert third.with_replies([]) == [dict(m) for m in wl[2].messages]
    assert third.tools == wl[2].tools and [t["function"]["name"] for t in third.tools] == \
        [t["function"]["name"] for t in wl[2].tools]
    stub = SimpleNamespace(chat=SimpleNamespace(completions=None), completions=None)  # no network
    send = client.Sender(stub, "m")
    _, kw = send._args(third, [])
    assert kw["tools"] == list(wl[2].tools) and kw["messages"] == [dict(m) for m in wl[2].messages]


def test_single_turn_workloads_and_their_errors(qwen_tokenizer):
    ss = sessions.sessions_for("shared_system_prompt", users=3)
    assert [len(s.turns) for s in ss] == [1, 1, 1]
    with pytest.raises(RequestError, match="tokenizer"):
        sessions.sessions_for("prefix_repetition", users=2)
    ss = sessions.sessions_for("prefix_repetition", users=4, tokenizer=qwen_tokenizer, prefix_len=64,
                               suffix_len=16, output_len=4)
    hf = kv.tokens.hf_tokenizer(qwen_tokenizer)
    for s in ss:
        t = s.turns[0]
        assert t.endpoint == "completions" and len(t.ids) == 80
        assert hf.encode(t.prompt, add_special_tokens=False) == list(t.ids)
    with pytest.raises(RequestError, match="unknown workload"):
        sessions.sessions_for("nope")


def test_prefix_repetition_prompts_round_trip_whole(qwen_tokenizer):
    # seed 2: 3 of 16 prompts whose prefix and suffix merge where they meet when re-encoded
    hf = kv.tokens.hf_tokenizer(qwen_tokenizer)
    raw = kv.workloads.prefix_repetition(prefix_len=512, suffix_len=128, num_prompts=16, num_prefixes=1,
                                         seed=2, tokenizer=qwen_tokenizer)
    merged = [r for r in raw if hf.encode(hf.decode(list(r.ids)), add_special_tokens=False) != list(r.ids)]
    assert len(merged) == 3
    ss = sessions.sessions_for("prefix_repetition", users=16, tokenizer=qwen_tokenizer, seed=2,
                               prefix_len=512, suffix_len=128)
    turns = [s.turns[0] for s in ss]
    for t, r in zip(turns, raw):
        assert hf.encode(t.prompt, add_special_tokens=False) == list(t.ids) and len(t.ids) == 640
        assert t.ids[:512] == r.ids[:512]                          # the prefix is never touched
        assert (t.ids == r.ids) == (r not in merged)               # only the merged ones changed


def test_trace_prompts_keep_the_trace_reuse_structure(qwen_tokenizer):
    frame = pl.DataFrame({"timestamp": [0, 500, 1500, 2000], "input_length": [1200, 1400, 300, 1536],
                          "output_length": [5, 6, 7, 8], "hash_ids": [[0, 1, 2], [0, 1, 3], [4], [0, 1, 2]]},
                         schema=kv.traces.SCHEMA)
    trace = kv.traces.Trace(frame, 512)
    ss = sessions.trace_sessions(trace, qwen_tokenizer, block_tokens=32, time_scale=0.5)
    ids = [s.turns[0].ids for s in ss]
    assert [len(x) for x in ids] == [75, 88, 19, 96]            # ceil(len * 32 / 512)
    assert [s.at_s for s in ss] == [0.0, 0.25, 0.75, 1.0]       # ms * time_scale -> s
    assert [s.turns[0].max_tokens for s in ss] == [5, 6, 7, 8]
    assert ids[0][:64] == ids[1][:64] and ids[0][64] != ids[1][64]  # two shared blocks, then not
    assert ids[3][:75] == ids[0]                                  # same hash ids, longer cut
    assert ids[2][:8] != ids[0][:8]                               # another block
    hf = kv.tokens.hf_tokenizer(qwen_tokenizer)
    for s in ss:
        assert hf.encode(s.turns[0].prompt, add_special_tokens=False) == list(s.turns[0].ids)
    with pytest.raises(TraceError, match="max_prompt_tokens"):
        sessions.trace_sessions(trace, qwen_tokenizer, block_tokens=32, max_prompt_tokens=90)
    with pytest.raises(TraceError, match="tokenizer"):
        sessions.trace_sessions(trace, None)


# --------------------------------------------------------------------------------- savings

def test_prefill_fit_recovers_a_known_curve_and_inverts_it():
    n = np.array([16, 128, 512, 1024, 2048] * 2)
    t = 20.0 + 0.5 * n + 1e-4 * n * n
    frame = pl.DataFrame({"ok": [True] * 10, "ttft_ms": t, "prompt_tokens": n})
    fit = savings.fit_prefill(frame)
    assert fit.coef == pytest.approx((20.0, 0.5, 1e-4), rel=1e-6)
    assert fit.prefilled(fit.ttft_ms(700)) == pytest.approx(700)
    on = pl.DataFrame({"ok": [True, True, True], "ttft_ms": [float(fit.ttft_ms(1024)), 25.0, float(fit.ttft_ms(300))],
                       "prompt_tokens": [1024, 1024, 1280]})
    got = savings.infer_reuse(on, fit)
    assert got["reused_inferred"].to_list() == [0, 1014, 980]
    with pytest.raises(RequestError, match="3 different"):
        savings.fit_prefill(frame.filter(pl.col("prompt_tokens") < 200))


def test_repeats_prefilled_again_compares_each_repeat_with_the_cold_first_request():
    # mutants: comparing with the fastest row (A+B, a prefix hit) counts a reused repeat; a strict
    # "> A" (not half) misses a repeat prefilled slightly faster than A; counting A itself gives 3
    frame = pl.DataFrame({"name": ["A", "A again 1", "A again 2", "A+B", "A+B again 1"],
                          "ok": [True] * 5, "ttft_ms": [400.0, 390.0, 30.0, 120.0, 520.0]})
    assert savings.repeats_prefilled_again(frame) == 2
    with pytest.raises(RequestError, match="repeat_workload"):
        savings.repeats_prefilled_again(frame.filter(pl.col("name") != "A"))


# --------------------------------------------------------------------------------- workload parameters

def _planned(workload, **params):
    sessions_, _ = loadgen._plan(workload, 1, None, None, None, 2, 60.0, tokenizer=None, seed=0,
                                 params=params)
    return [t.max_tokens for s in sessions_ for t in s.turns]


@pytest.mark.parametrize("workload", ["multi_turn", "agentic_loop", "shared_system_prompt"])
def test_output_len_sets_every_chat_requests_max_tokens(workload):
    # issue 22: multi_turn --output-len 5 generated 128. Mutant caught: output_len not turned into
    # the chat generators' max_tokens (they keep 128 / 256)
    n = {"multi_turn": 6, "agentic_loop": 8, "shared_system_prompt": 2}[workload]
    assert _planned(workload, output_len=5) == [5] * n
    assert _planned(workload, max_tokens=7) == [7] * n            # the old name, same thing


def test_output_len_and_lengths_apply_to_prefix_repetition_and_fixed(qwen_tokenizer):
    ss = sessions.sessions_for("prefix_repetition", users=2, tokenizer=qwen_tokenizer,
                               **workload_params.workload_kwargs("prefix_repetition",
                                                                 {"output_len": 9, "prefix_len": 32,
                                                                  "suffix_len": 8}))
    assert [(s.turns[0].max_tokens, len(s.turns[0].ids)) for s in ss] == [(9, 40), (9, 40)]
    kw = workload_params.workload_kwargs("fixed", {"output_len": 4, "input_len": 80, "system_tokens": 20})
    ss = sessions.sessions_for("fixed", users=3, tokenizer=qwen_tokenizer, seed=0, **kw)
    turns = [s.turns[0] for s in ss]
    # the rendered ids go with each chat turn, so the run checks the server's prompt count
    assert [(t.endpoint, t.max_tokens, len(t.ids)) for t in turns] == [("chat", 4, 80)] * 3
    assert turns[0].ids == tuple(kv.workloads.rendered_ids(qwen_tokenizer, turns[0].messages))


def test_library_parameters_are_checked_like_the_flags(qwen_tokenizer):
    check = workload_params.workload_kwargs
    with pytest.raises(RequestError) as e:
        check("multi_turn", {"prefix_len": 64})
    assert str(e.value) == ("prefix_len does not apply to the multi_turn workload; it applies to "
                            "prefix_repetition. Drop it or choose one of those workloads")
    with pytest.raises(RequestError) as e:
        check("multi_turn", {"output_len": 5, "max_tokens": 5})
    assert str(e.value) == "output_len and max_tokens are the same thing; give one"
    with pytest.raises(RequestError) as e:
        check("shared_system_prompt", {"user_tokens": 5})
    assert str(e.value) == ("user_tokens is not a parameter of the shared_system_prompt workload; it "
                            "takes system_tokens, tools, question_tokens, max_tokens")
    with pytest.raises(RequestError) as e:
        check("fixed", {"input_len": 64, "num_requests": 3})
    assert str(e.value) == ("num_requests is set by the load run for fixed: pass users= (how many "
                            "sessions or requests) and seed= to the run instead")
    with pytest.raises(RequestError) as e:
        check(kv.workloads.multi_turn(), {"output_len": 3})
    assert str(e.value).startswith("output_len does not apply to a kv.Workload (its requests are already made)")
    # more tools raise the floor: the check follows the generator's own tools
    with pytest.raises(RequestError, match=r"system_tokens 700 is below what shared_system_prompt can "
                                           r"make: its instructions and 6 tool schemas alone are about"):
        check("shared_system_prompt", {"system_tokens": 700, "tools": 6})
    assert check("shared_system_prompt", {"system_tokens": 672}) == {"system_tokens": 672}
    assert check("shared_system_prompt", {"system_tokens": 100, "tools": 0}) == {"system_tokens": 100, "tools": 0}
    assert check("data/trace.jsonl", {"time_scale": 2.0, "turns": None}) == {"time_scale": 2.0}
    # through generate_load: refused before any connection is tried
    with pytest.raises(RequestError, match="^turns does not apply to the prefix_repetition workload"):
        kv.generate_load("http://127.0.0.1:9", "prefix_repetition", concurrency=1, turns=2,
                         tokenizer=qwen_tokenizer, progress=False)


def test_a_server_that_lists_no_model_is_an_error_not_default_model():
    # mutant caught: the old fallback to mlx-lm's "default_model" when the list is empty
    import asyncio

    import httpx

    def run(status, body):
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))

        async def go():
            async with httpx.AsyncClient(transport=transport) as http:
                return await client.model_name(http, "http://127.0.0.1:8123")
        return asyncio.run(go())

    assert run(200, b'{"object": "list", "data": [{"id": "tiny", "object": "model"}]}') == "tiny"
    for status, body in ((200, b""), (200, b'{"object": "list", "data": []}'), (404, b"{}")):
        with pytest.raises(kv.errors.KvlabError) as e:
            run(status, body)
        assert str(e.value) == (f"http://127.0.0.1:8123/v1/models listed no model (HTTP {status}, "
                                f"{len(body)} bytes); pass the model name the server answers to "
                                "(--model / model=)")
