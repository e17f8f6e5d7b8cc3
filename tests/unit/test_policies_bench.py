"""kvlab bench --only policies: every policy's compiled sweep beside its plain-Python replays, with
identical hits (a small run; the numbers in the report come from the full 12k-request one)."""

from kvlab import bench
from kvlab.bench.policies import bench_policies, bench_policies_table
from kvlab.policies import POLICIES


def test_policies_section_is_registered_and_model_free():
    assert bench.REGISTRY["policies"].NEEDS_MODEL is False


def test_every_policy_is_timed_and_identical():
    b = bench_policies(n_requests=250, n_capacities=4, repeats=2)
    assert b["requests"] == 250 and len(b["capacities_blocks"]) == 4
    assert list(b["policies"]) == list(POLICIES)
    for name, v in b["policies"].items():
        assert v["identical"], name
        assert v["compiled_seconds"]["n"] == 2 and v["python_seconds"]["n"] == 1
        assert v["speedup"]["median"] > 0 and v["sweep_api_seconds"]["min"] > 0


def test_table_rows():
    t = bench_policies_table(1, n_requests=120, n_capacities=3, policies=["lru", "belady"])
    assert t.columns[0] == "policy" and [r[0] for r in t.rows] == ["lru", "belady"]
    assert all(r[-1] is True for r in t.rows)
    assert "kvlab bench --only policies" in t.markdown()
