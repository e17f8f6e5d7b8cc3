"""kv.simulate / kv.sweep: exact hit counts on hand-made traces, the seeds' published numbers,
and the compiled kernels and the stack-distance sweep against the plain-Python replay."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim_helpers import chained_traces, hits, trace

import kvlab as kv
from kvlab.errors import BlockSizeError, BudgetError, KvlabError
from kvlab.bench.simulator import bench_simulator
from kvlab.cli import main
from kvlab.policies import MISS_REASONS
from kvlab.policies import POLICIES as POLICY_TABLE
from kvlab.sim.dispatch import replay_kernel
from kvlab.sim.simulator import prepare_replay, replay_python


def single(block, n=5):
    """A one-full-block request (block size 4) with a unique partial tail id."""
    return (n, [block, 1000 + single.counter.__next__()])


single.counter = iter(range(10**6))

ENGINES = ["numba", "python"]


# --- exact semantics on hand-made traces -----------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_last_token_is_always_computed(engine):
    # 8 tokens = 2 full blocks, but only blocks inside the first 7 tokens can hit
    r = kv.simulate(trace([(8, [0, 1]), (8, [0, 1])]), block_size=4, engine=engine)
    assert hits(r) == [0, 1]
    assert r.requests["hit_tokens"].to_list() == [0, 4]
    # 9 tokens: two full blocks inside the first 8
    r = kv.simulate(trace([(9, [0, 1, 2]), (9, [0, 1, 3])]), engine=engine)
    assert hits(r) == [0, 2]
    assert r.summary["hit_tokens"] == 8 and r.summary["prompt_tokens"] == 18


@pytest.mark.parametrize("engine", ENGINES)
def test_only_the_leading_run_counts(engine):
    # block 2 is resident in request 3 but sits after a miss (9), so it cannot be used
    r = kv.simulate(trace([(13, [0, 1, 2, 3]), (13, [0, 9, 2, 4])]), engine=engine)
    assert hits(r) == [0, 1]


@pytest.mark.parametrize("engine", ENGINES)
def test_partial_blocks_are_never_cached(engine):
    # request 1 has 6 tokens: block 1 is partial there, so a later request cannot hit it
    r = kv.simulate(trace([(6, [0, 1]), (9, [0, 1, 2])]), engine=engine)
    assert hits(r) == [0, 1]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu"])
def test_a_request_tail_is_evicted_before_its_head(engine, policy):
    # capacity 2 blocks; a 3-block request keeps blocks 0 and 1 (its head), not 1 and 2
    t = trace([(13, [0, 1, 2, 3]), (13, [0, 1, 2, 4])])
    r = kv.simulate(t, policy, capacity_tokens=8, engine=engine)
    assert hits(r) == [0, 2]
    assert r.summary["evictions"] == 1 + 1


@pytest.mark.parametrize("engine", ENGINES)
def test_lru_fifo_lfu_differ_on_a_crafted_sequence(engine):
    # capacity 2 blocks; single-block requests A B A C B A
    a, b, c = 10, 20, 30
    seq = [single(x) for x in (a, b, a, c, b, a)]
    got = {p: hits(kv.simulate(trace(seq), p, capacity_tokens=8, engine=engine))
           for p in ("lru", "fifo", "lfu")}
    # LRU: C evicts B, then B evicts A      -> only the first repeat of A hits
    # FIFO: C evicts A (oldest), B stays    -> A@3 and B@5 hit
    # LFU: C evicts B (count 1 < A's 2), B evicts C, A survives -> A@3 and A@6 hit
    assert got == {"lru": [0, 0, 1, 0, 0, 0], "fifo": [0, 0, 1, 0, 1, 0], "lfu": [0, 0, 1, 0, 0, 1]}
    inf = kv.simulate(trace(seq), "infinite", engine=engine)
    assert hits(inf) == [0, 0, 1, 0, 1, 1] and inf.summary["evictions"] == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_capacity_is_whole_blocks(engine):
    t = trace([single(1), single(1)])
    assert hits(kv.simulate(t, "lru", capacity_tokens=3, engine=engine)) == [0, 0]   # 3 // 4 = 0
    assert hits(kv.simulate(t, "lru", capacity_tokens=4, engine=engine)) == [0, 1]
    assert hits(kv.simulate(t, "lru", capacity_tokens=0, engine=engine)) == [0, 0]


def test_summary_names_both_hit_rates():
    r = kv.simulate(trace([(9, [0, 1, 2]), (9, [0, 1, 3]), (9, [5, 6, 7])]))
    s = r.summary
    assert s["token_hit_rate"] == pytest.approx(8 / 27)
    assert s["request_hit_rate"] == pytest.approx(1 / 3)
    assert {"hit_tokens", "prompt_tokens", "requests", "evictions", "hit_blocks"} <= set(s)
    assert r.requests.columns == ["request", "pass", "prompt_tokens", "hit_blocks", "hit_tokens", "hit",
                                  *MISS_REASONS, "evicted_by"]
    assert r.requests["hit"].to_list() == [False, True, False]
    assert "token hit 29.6%" in repr(r) and "\n" not in repr(r)
    assert "<table>" in r._repr_html_()


def test_passes_replay_into_the_same_cache():
    r = kv.simulate(trace([(9, [0, 1, 2]), (9, [3, 4, 5])]), passes=3)
    assert r.requests["pass"].to_list() == [1, 1, 2, 2, 3, 3]
    assert r.requests["request"].to_list() == [0, 1, 0, 1, 0, 1]
    assert r.by_pass()["hit_tokens"].to_list() == [0, 16, 16]


# --- the seeds' published numbers --------------------------------------------------------------


def seed004():
    return kv.workloads.prefix_repetition(prefix_len=512, suffix_len=128, num_prompts=50,
                                          num_prefixes=1, output_len=100)


def test_seed004_prefix_repetition_cold_and_warm_pass():
    # vllm-metal#283: cold 78.4% (25088/32000), warm 97.5% (31200/32000), block size 16
    r = kv.simulate(seed004(), "lru", None, block_size=16, passes=2)
    p = r.by_pass()
    assert p["prompt_tokens"].to_list() == [32000, 32000]
    assert p["hit_tokens"].to_list() == [49 * 512, 50 * 39 * 16] == [25088, 31200]
    assert [round(x, 3) for x in p["token_hit_rate"].to_list()] == [0.784, 0.975]


def test_seed004_through_the_cli(capsys):
    argv = ["simulate", "--workload", "prefix_repetition", "--prefix-len", "512", "--suffix-len", "128",
            "--num-prompts", "50", "--block-size", "16", "--passes", "2", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(p["hit_tokens"], p["prompt_tokens"]) for p in data["by_pass"]] == [(25088, 32000), (31200, 32000)]
    assert data["hit_tokens"] == 25088 + 31200 and data["block_size"] == 16


def test_cli_text_output_and_sweep(tmp_path, capsys):
    t = kv.traces.from_requests([list(range(40)), list(range(40)), list(range(30))], 4, block_size=8)
    path = t.write(tmp_path / "t.jsonl")
    base = ["simulate", str(path), "--block-size", "8"]
    assert main(base + ["--policy", "fifo", "--capacity-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "token_hit_rate" in out and "(16/110 tokens)" in out
    assert main(base + ["--sweep", "0,16,inf", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["sweep"]
    assert [r["capacity_tokens"] for r in rows] == [0, 16, None]
    assert [r["hit_tokens"] for r in rows] == [0, 16 + 16, 32 + 24]
    assert main(base + ["--capacity-tokens", "lots"]) == 2
    assert "not a number of tokens" in capsys.readouterr().err


def test_mooncake_synthetic_trace_unbounded_cache_ratio():
    try:
        path = kv.traces.locate()
    except kv.TraceError as e:
        pytest.skip(f"Mooncake synthetic trace not available ({e})")
    r = kv.simulate(kv.traces.read(path), "infinite")
    # Mooncake FAST'25 Table 2 publishes a 66% cache ratio for this synthetic workload with unbounded
    # capacity. kvlab's exact replay (full 512-token blocks only, the trailing partial block never
    # cached) gives 39,802,880 of 61,194,628 prompt tokens (65.04%) and 1,761 of 3,993 requests hit:
    # pinned exactly, so any change to the replay shows.
    s = r.summary
    assert (s["requests"], s["prompt_tokens"], s["hit_tokens"], s["hit_blocks"]) == (
        3993, 61_194_628, 39_802_880, 77_740)
    assert round(s["request_hit_rate"] * s["requests"]) == 1761
    assert s["hit_tokens"] == s["hit_blocks"] * 512
    assert kv.simulate(path, "lru").summary["hit_tokens"] == r.summary["hit_tokens"]


# --- sweep == replay, compiled == reference ------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chained_traces(), st.lists(st.integers(0, 40), min_size=1, max_size=6))
def test_lru_sweep_equals_per_capacity_plain_replay(t, caps_blocks):
    caps = [c * t.block_size for c in caps_blocks] + [None]
    frame = kv.sweep(t, "lru", caps)
    rep = prepare_replay(t, None, 1, None)
    for row, c in zip(frame.iter_rows(named=True), caps):
        ref, _ = replay_python(rep, "lru", None if c is None else c // t.block_size)
        assert row["capacity_tokens"] == c
        assert row["hit_tokens"] == int(ref.sum()) * t.block_size
        assert row["request_hit_rate"] == pytest.approx(float((ref > 0).mean()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chained_traces(), st.integers(0, 30), st.sampled_from(["lru", "fifo", "lfu", "infinite"]))
def test_compiled_replay_equals_plain_replay(t, cap_blocks, policy):
    rep = prepare_replay(t, None, 2, None)
    cap = None if policy == "infinite" else cap_blocks
    fast, ev_fast = replay_kernel(rep, policy, cap)
    ref, ev_ref = replay_python(rep, policy, cap)
    assert fast.tolist() == ref.tolist() and ev_fast == ev_ref


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chained_traces(), st.lists(st.integers(0, 30), min_size=2, max_size=5),
       st.sampled_from(["fifo", "lfu"]))
def test_fifo_lfu_sweep_equals_simulate(t, caps_blocks, policy):
    caps = [c * t.block_size for c in caps_blocks]
    frame = kv.sweep(t, policy, caps)
    assert frame["hit_tokens"].to_list() == [
        kv.simulate(t, policy, c, engine="python").summary["hit_tokens"] for c in caps]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chained_traces())
def test_lru_hits_never_fall_as_capacity_grows(t):
    caps = [c * t.block_size for c in range(0, 30)] + [None]
    frame = kv.sweep(t, "lru", caps)
    tokens = frame["hit_tokens"].to_list()
    assert tokens == sorted(tokens)
    # inclusion: every request, not just the total, is monotone for LRU
    per = np.stack([hits(kv.simulate(t, "lru", c)) for c in caps], axis=1)
    assert (np.diff(per, axis=1) >= 0).all()


def test_sweep_keeps_the_given_order_and_matches_simulate():
    t = trace([(13, [0, 1, 2, 3]), (13, [0, 1, 2, 4]), (9, [0, 1, 5]), (13, [0, 1, 2, 6])])
    frame = kv.sweep(t, "lru", [None, 4, 12, 0, "inf"])
    assert frame.columns[:3] == ["capacity_tokens", "token_hit_rate", "request_hit_rate"]
    assert frame["capacity_tokens"].to_list() == [None, 4, 12, 0, None]
    want = [kv.simulate(t, "lru", c).summary["hit_tokens"] for c in [None, 4, 12, 0, None]]
    assert frame["hit_tokens"].to_list() == want == [32, 12, 32, 0, 32]


# --- workloads and errors ------------------------------------------------------------------


def test_workloads_of_token_ids_and_raw_sequences():
    seqs = [list(range(40)), list(range(40)), list(range(20)) + [7] * 20]
    r = kv.simulate(seqs, block_size=8)
    assert hits(r) == [0, 4, 2]
    assert r.block_size == 8
    assert kv.simulate(seqs).block_size == kv.simulator.WORKLOAD_BLOCK_SIZE == 16


def test_salted_requests_do_not_share_blocks():
    from kvlab.workloads import Request, Workload

    ids = tuple(range(64))
    wl = Workload("salts", (Request(ids=ids, name="a", salt="alice"), Request(ids=ids, name="b", salt="bob"),
                            Request(ids=ids, name="c", salt="alice")))
    assert hits(kv.simulate(wl, block_size=16)) == [0, 0, 3]


def test_chat_workloads_need_a_tokenizer():
    with pytest.raises(kv.RequestError, match="tokenizer"):
        kv.simulate(kv.workloads.multi_turn())


def test_errors_say_what_to_do():
    t = trace([(9, [0, 1, 2])])
    with pytest.raises(KvlabError, match="unknown policy 'clock'"):
        kv.simulate(t, "clock")
    with pytest.raises(BudgetError, match="int >= 0"):
        kv.simulate(t, "lru", -5)
    with pytest.raises(BudgetError, match="never evicts"):
        kv.simulate(t, "infinite", 100)
    with pytest.raises(BlockSizeError, match="block_size must be 4 or None"):
        kv.simulate(t, block_size=16)
    with pytest.raises(BudgetError, match="at least one capacity"):
        kv.sweep(t, "lru", [])
    with pytest.raises(BudgetError, match="no capacity to sweep"):
        kv.sweep(t, "infinite", [4])
    with pytest.raises(kv.TraceError, match="cannot simulate a int"):
        kv.simulate(42)


def test_bench_simulator_reports_speedup_and_throughput():
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(0, 3, size=int(rng.integers(20, 200)))) for _ in range(60)]
    t = kv.traces.from_requests(seqs, 1, block_size=8)
    b = bench_simulator(t, n_requests=200, n_capacities=4, repeats=2)
    assert b["identical"] and b["requests"] == 200 and len(b["capacities_tokens"]) == 4
    assert {"median", "min", "max", "n"} <= set(b["speedup"])
    assert b["blocks_per_s"]["sweep"]["median"] > 0


# --- every policy through the CLI; the sweep's ceiling ---------------------------------------


@pytest.mark.parametrize("policy", ["infinite", *POLICY_TABLE])
def test_cli_accepts_every_policy(policy, tmp_path, capsys):
    t = kv.traces.from_requests([list(range(40)), list(range(40)), list(range(30)), list(range(60))], 4,
                                block_size=8)
    path = t.write(tmp_path / "t.jsonl")
    cap = "inf" if policy == "infinite" else "16"
    assert main(["simulate", str(path), "--block-size", "8", "--policy", policy, "--capacity-tokens", cap,
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    want = kv.simulate(t, policy, None if policy == "infinite" else 16)
    assert data["policy"] == policy and data["hit_tokens"] == want.summary["hit_tokens"]
    assert sum(data["miss_reasons"].values()) == data["prompt_tokens"] - data["hit_tokens"]


def test_cli_sweep_reports_the_belady_ceiling(tmp_path, capsys):
    t = kv.traces.from_requests([list(range(40)), list(range(100, 140)), list(range(40)), list(range(30))], 4,
                                block_size=8)
    path = t.write(tmp_path / "t.jsonl")
    assert main(["simulate", str(path), "--block-size", "8", "--policy", "fifo", "--sweep", "16,40,inf",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ceiling"] == "belady"
    rows = data["sweep"]
    best = kv.sweep(t, "belady", [16, 40, None])["hit_tokens"].to_list()
    assert [r["belady_hit_tokens"] for r in rows] == best
    assert all(r["hit_tokens"] <= r["belady_hit_tokens"] for r in rows)
    assert main(["simulate", str(path), "--block-size", "8", "--sweep", "16,inf"]) == 0
    out = capsys.readouterr().out
    assert "belady_*: the offline optimum at each capacity" in out and "gap_to_be" in out
    with pytest.raises(SystemExit):  # argparse: invalid choice
        main(["simulate", str(path), "--policy", "clock"])
    assert "invalid choice: 'clock'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["--workload", "multi_turn", "--prefix-len", "64"], "--prefix-len"),
    (["--workload", "agentic_loop", "--output-len", "8"], "--output-len"),
    (["TRACE", "--num-prefixes", "3"], "--num-prefixes"),
    (["TRACE", "--num-prompts", "3"], "--num-prompts"),
])
def test_cli_refuses_flags_the_source_ignores(tmp_path, capsys, argv, flag):
    # a flag that changes nothing for this source is an error naming it, never silently dropped
    # (mutant: --prefix-len defaulting to 256 again and read only for prefix_repetition)
    path = kv.traces.from_requests([list(range(40))], 1, block_size=8).write(tmp_path / "t.jsonl")
    argv = [str(path) if a == "TRACE" else a for a in argv]
    assert main(["simulate", *argv]) != 0
    err = capsys.readouterr().err
    assert f"{flag} does not apply to" in err and "prefix_repetition" in err
