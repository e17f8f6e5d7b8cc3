"""The cluster simulator: the compiled kernel against the plain-Python reference for every rule,
view and compiled policy; round_robin and the shared ceiling against code written twice; one
instance equal to today's single-cache replay; the JSON keys; the errors that name the fix."""

import json

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from sim_helpers import chained_traces, trace

import kvlab as kv
from kvlab.cli import main
from kvlab.cluster import ROUTER_NAMES, ROUTERS
from kvlab.cluster.simulate import JSON_KEYS, prepare, run, simulate_cluster
from kvlab.errors import KvlabError, TraceError

VIEWS = ["precise", "approximate", "stale:5"]


@pytest.fixture(scope="module")
def mooncake():
    return kv.traces.read().head(300)


def same(a, b):
    """Both replays' (instance, hits, TTFT, view match), TTFT to float rounding."""
    return all(np.allclose(x, y, rtol=1e-12, atol=1e-9) if x.dtype.kind == "f" else np.array_equal(x, y)
               for x, y in zip(a, b))


@pytest.mark.parametrize("router", [r for r in ROUTER_NAMES if r != "optimal"])
def test_kernel_equals_the_reference(mooncake, router):
    # catches a kernel whose view match, eviction order, stale-event timing, TTL expiry, queue or
    # load bookkeeping drifts from the plain replay (checked: match[i] = j + 1 fails here)
    for view in VIEWS:
        for policy in ("lru", "fifo"):
            spec = prepare(mooncake, 3, router, view, 2**18, policy, None, load=0.3)
            assert same(run(spec, policy), run(spec, policy, python=True)), (router, view, policy)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chained_traces(block_sizes=(2,), max_requests=30, max_blocks=8))
def test_kernel_equals_the_reference_on_random_traces(t):
    for router in ("sglang_cache_aware", "llmd_weighted", "session"):
        for view in VIEWS:
            spec = prepare(t, 3, router, view, 6, "lru", None)
            assert same(run(spec, "lru"), run(spec, "lru", python=True)), (router, view)


def test_round_robin_sends_request_i_to_instance_i_mod_n(mooncake):
    r = simulate_cluster(mooncake, 4, "round_robin", capacity_tokens=2**18)
    assert r.requests["instance"].to_list() == [i % 4 for i in range(300)]  # catches a counter off by one


def test_each_instance_is_a_single_cache_of_what_it_was_sent(mooncake):
    # round robin's instances see disjoint sub-traces: each one's hits are today's replay of its share
    r = simulate_cluster(mooncake, 3, "round_robin", capacity_tokens=2**17)
    f = r.requests
    for i in range(3):
        mine = f.filter(pl.col("instance") == i)["request"].to_list()
        alone = kv.simulate(kv.traces.Trace(mooncake.frame[mine], 512), "lru", 2**17)
        assert f.filter(pl.col("instance") == i)["hit_tokens"].to_list() == alone.requests["hit_tokens"].to_list()


@pytest.mark.parametrize("policy", ["lru", "fifo", "slru"])
def test_one_instance_is_todays_single_cache(mooncake, policy):
    # slru runs through the reference (no compiled cluster kernel): the same contract
    single = kv.simulate(mooncake, policy, 2**17)
    for router in ("round_robin", "sglang_cache_aware", "mooncake_ttft"):
        r = kv.simulate(mooncake, policy, 2**17, instances=1, router=router)
        assert r.requests["hit_tokens"].to_list() == single.requests["hit_tokens"].to_list()
        assert r.summary["token_hit_rate"] == single.summary["token_hit_rate"]


def test_shared_ceiling_is_one_cache_of_n_times_the_capacity(mooncake):
    # catches a ceiling computed at N x capacity in the wrong units, or from the per-instance caches
    r = simulate_cluster(mooncake, 4, "shared", capacity_tokens=2**17)
    big = kv.simulate(mooncake, "lru", 4 * 2**17)
    assert r.requests["hit_tokens"].to_list() == big.requests["hit_tokens"].to_list()
    assert r.summary["shared_cache_token_hit_rate"] == big.summary["token_hit_rate"]
    spec = prepare(mooncake, 4, "shared", "precise", 2**17, "lru", None)
    assert same(run(spec, "lru"), run(spec, "lru", python=True))  # least loaded, written twice
    best = simulate_cluster(mooncake, 4, "optimal", capacity_tokens=2**17)
    assert best.summary["token_hit_rate"] >= r.summary["token_hit_rate"]


def test_queue_and_ttft_by_hand():
    # two 8-token requests on one instance at t=0: prefill 8 x 0.5 s each, FCFS
    t = kv.traces.Trace(pl.DataFrame({"timestamp": [0, 0], "input_length": [8, 8], "output_length": [2, 2],
                                      "hash_ids": [[0, 1], [5, 6]]}, schema=kv.traces.SCHEMA), 4)
    svc = kv.cluster.ServiceModel(b=0.5, decode_s=1.0)
    r = simulate_cluster(t, 1, "round_robin", service=svc)
    assert r.requests["ttft_s"].to_list() == [4.0, 8.0]  # catches decode occupying the prefill queue
    # the second starts after the first's prefill; at t=4.5 the first is still decoding (ends at 6)
    t2 = t.frame.with_columns(pl.Series("timestamp", [0, 4500]))
    r = simulate_cluster(kv.traces.Trace(t2, 4), 2, "least_loaded", service=svc)
    assert r.requests["instance"].to_list() == [0, 1]


def test_json_keys_and_cli(mooncake, tmp_path, capsys):
    path = mooncake.write(tmp_path / "t.jsonl")
    assert main(["simulate", str(path), "--instances", "2", "--router", "llmd_weighted", "--view", "approximate",
                 "--capacity-tokens", "131072", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert tuple(out) == JSON_KEYS
    assert out["instances"] == 2 and len(out["per_instance"]) == 2
    assert sum(p["requests"] for p in out["per_instance"]) == 300
    assert set(out["per_instance"][0]) == {"requests", "prompt_tokens", "hit_tokens"}
    r = simulate_cluster(mooncake, 2, "llmd_weighted", "approximate", 131072)
    assert out["token_hit_rate"] == r.summary["token_hit_rate"]


def test_errors_name_the_fix(mooncake):
    with pytest.raises(KvlabError, match="unknown router 'nope'; use one of random, round_robin.*optimal"):
        simulate_cluster(mooncake, 2, "nope")
    with pytest.raises(KvlabError, match="unknown view 'exact'; use one of precise, approximate, stale:D"):
        simulate_cluster(mooncake, 2, "llmd_weighted", "exact")
    with pytest.raises(KvlabError, match="stale:D needs D"):
        simulate_cluster(mooncake, 2, "llmd_weighted", "stale:soon")
    with pytest.raises(KvlabError, match="router='optimal'"):
        simulate_cluster(mooncake, 2, "round_robin", policy="belady")
    with pytest.raises(KvlabError, match="has no parameter 'x'; its parameters are: cache_threshold"):
        simulate_cluster(mooncake, 2, "sglang_cache_aware", router_params={"x": 1})
    with pytest.raises(KvlabError, match="pass instances=N"):
        kv.simulate(mooncake, router="round_robin")
    back = mooncake.frame.head(3).with_columns(pl.Series("timestamp", [0, 5, 2]))
    with pytest.raises(TraceError, match="row 2 arrives before row 1"):
        simulate_cluster(kv.traces.Trace(back, 512), 2)


def test_every_rule_has_a_source_and_tiling_shifts_ids(mooncake):
    assert all(info.source for info in ROUTERS.values())
    r = simulate_cluster(mooncake.head(50), 2, "round_robin", requests=120)
    assert r.summary["requests"] == 120
    # copies share nothing: the third copy's hit rate is the first copy's (a fresh cache each time,
    # the same instance pattern for an even copy length)
    f = r.requests["hit_tokens"].to_list()
    assert f[:50] == f[50:100]


def test_stale_view_sees_events_exactly_delay_seconds_old():
    # request 2 arrives 1 s after request 1: a view 1 s late has its blocks, 1.5 s late has not
    # (catches events applied at < t - delay instead of <=, or never)
    t = kv.traces.Trace(pl.DataFrame({"timestamp": [0, 1000], "input_length": [9, 9], "output_length": [1, 1],
                                      "hash_ids": [[0, 1, 2], [0, 1, 3]]}, schema=kv.traces.SCHEMA), 4)
    for view, seen in (("precise", 8), ("stale:1", 8), ("stale:1.5", 0)):
        for engine in ("numba", "python"):
            r = simulate_cluster(t, 2, "llmd_weighted", view, engine=engine)
            assert r.requests["view_match_tokens"].to_list() == [0, seen], (view, engine)
