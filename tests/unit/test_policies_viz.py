"""kvlab.viz.misses.miss_reasons: missed tokens by reason per request and per capacity, the bars
summing to what the simulator counted."""

import plotly.graph_objects as go
import polars as pl
import pytest

import kvlab as kv
from kvlab.errors import VizError
from kvlab.policies import MISS_REASONS
from kvlab.viz.misses import miss_reasons


@pytest.fixture(scope="module")
def trace():
    return kv.traces.read().head(200)


def test_per_request(trace):
    r = kv.simulate(trace, "arc", 512 * 50)
    fig = miss_reasons(r)
    assert isinstance(fig, go.Figure) and fig.layout.barmode == "stack"
    assert [t.name for t in fig.data] == ["reused", *MISS_REASONS]
    assert fig.layout.meta["bars"] == 200
    assert fig.layout.meta["totals"] == {"reused": r.summary["hit_tokens"], **r.summary["miss_reasons"]}
    bar = {t.name: t.y[7] for t in fig.data}  # one request's bar adds up to its prompt
    assert sum(bar.values()) == r.requests["prompt_tokens"][7]
    assert fig.data[1].customdata[7] == "request 7, pass 1"
    assert miss_reasons(r.requests).layout.meta == fig.layout.meta


def test_per_capacity_and_shares(trace):
    f = kv.sweep(trace, "lru", [0, 512 * 20, None], reasons=True)
    fig = miss_reasons(f, share=True, show_reused=False)
    assert list(fig.data[0].x) == ["0", "10,240", "unbounded"]
    shares = [sum(t.y[i] for t in fig.data) for i in range(3)]
    prompt = f["prompt_tokens"][0]
    assert shares == pytest.approx([1 - h / prompt for h in f["hit_tokens"].to_list()])
    over = next(t for t in fig.data if t.name == "over_capacity")
    assert over.y[0] > 0 and over.y[2] == 0


def test_a_bar_per_result(trace):
    fig = miss_reasons({"10 blocks": kv.simulate(trace, "lru", 5120), "unbounded": kv.simulate(trace, "lru")})
    assert list(fig.data[0].x) == ["10 blocks", "unbounded"]
    evicted = next(t for t in fig.data if t.name == "evicted")
    assert evicted.y[1] == 0


def test_bad_input_says_what_to_pass(trace):
    with pytest.raises(VizError, match="reasons=True"):
        miss_reasons(kv.sweep(trace, "lru", [5120]))
    with pytest.raises(VizError, match="kv.simulate result"):
        miss_reasons(42)
    with pytest.raises(VizError, match="empty dict"):
        miss_reasons({})
    assert miss_reasons(pl.DataFrame({"first_seen": [3], "evicted": [1]})).layout.meta["totals"] == {
        "first_seen": 3, "evicted": 1}
