"""kv.Inspector, headless, on the tiny model: the FigureWidgets follow the engine, controls driven
through traitlets and through a frontend-style comm message, and the budget replay agrees with a
real store run at that budget (kvlab.experiments.replay runs that store's own code)."""

import dataclasses

import polars as pl
import pytest

import kvlab as kv

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

pytestmark = pytest.mark.model

SYSTEM = ("x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch={};\n"
          "You are a careful assistant. Answer briefly and cite the file you read.\n")


def chat(cch: str, question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM.format(cch)}, {"role": "user", "content": question}]


# request 3 repeats request 1: an exact hit if request 1's entry is still resident
REQUESTS = [chat("eb6c6", "What does tests/test_app.py check?"),
            chat("eb6c6", "Which function in app.py parses the config file?"),
            chat("eb6c6", "What does tests/test_app.py check?")]


def run(engine, requests=REQUESTS):
    return [engine.run(r, max_tokens=3) for r in requests]


def test_inspector_follows_the_engine(tiny):
    engine = kv.Engine(tiny, kv.RadixStore(budget_bytes=64 << 20))
    ins = kv.Inspector(engine)
    s0 = ins.state()
    assert s0["requests"] == 0 and s0["tree"]["tokens"] == 0 and s0["table_rows"] == 0
    assert s0["simulated"] is None and ins.request.options == ()

    run(engine, REQUESTS[:2])
    tree_before = list(ins.figs["tree"].data[0].values)
    hits_before = list(ins.figs["tree"].data[0].marker.colors)
    run(engine, REQUESTS[2:])
    s = ins.state()
    tree = engine.store.tree_frame()
    # request 3 adds no node, it only changes hits: the drawing must be today's tree, node for
    # node (a tree drawn once and left stale would still show hits_before)
    drawn = ins.figs["tree"].data[0]
    assert tree["hits"].to_list() != hits_before
    assert list(drawn.ids) == [str(i) for i in tree["id"].to_list()]
    assert list(drawn.marker.colors) == tree["hits"].to_list()
    ins.color.value = "recency"
    assert list(ins.figs["tree"].data[0].marker.colors) == tree["last_used"].to_list()
    ins.color.value = "hits"
    assert s["requests"] == 3 and s["table_rows"] == 3 and s["error"] is None
    assert s["tree"]["tokens"] == tree["tokens"].sum() == sum(ins.figs["tree"].data[0].values)
    assert s["tree"]["nodes"] == tree.height
    assert list(ins.figs["tree"].data[0].values) != tree_before or tree_before == list(tree["tokens"])
    total = next(t for t in ins.figs["memory"].data if t.name == "total")
    store_events = engine.events.filter(pl.col("event").is_in(["insert", "evict"]))
    assert len(total.y) == store_events.height and total.y[-1] == engine.store.nbytes
    assert [row[0] for row in ins._rows] == [1, 2, 3]
    assert [row[1] for row in ins._rows] == [r.match for r in engine.results] == ["miss", "lcp", "exact"]
    assert ins.table.value.count("<tr>") == 4 and "3 requests" in ins.table.value
    # the dropdown follows the newest request; #3 repeats #1 exactly
    assert [v for _, v in ins.request.options] == [1, 2, 3] and s["selected"] == 3
    assert s["against"] == 1 and s["divergence"]["token_index"] is None
    assert s["divergence"]["common"] == engine.results[0].prompt_tokens
    assert s["live"]["token_hit_rate"] == engine.stats()["token_hit_rate"]
    assert "Inspector(3 requests" in repr(ins) and "\n" not in repr(ins)
    assert "kvlab Inspector" in ins._repr_html_()


def test_selecting_a_request_updates_the_divergence_panel(tiny):
    engine = kv.Engine(tiny, kv.RadixStore(budget_bytes=64 << 20))
    ins = kv.Inspector(engine)
    results = run(engine)
    before = list(ins.figs["divergence"].data[0].z[1])

    ins.request.value = 2  # as the frontend would, through the trait
    d = kv.diverge(list(results[0].prompt_ids), list(results[1].prompt_ids))
    s = ins.state()
    assert s["selected"] == 2 and s["against"] == 1
    assert s["divergence"]["token_index"] == d.token_index == results[1].reused_tokens
    first = next(t for t in ins.figs["divergence"].data if t.name == "first difference")
    assert list(first.x) == [d.token_index] * 2
    assert list(ins.figs["divergence"].data[0].z[1]) != before
    assert "#2" in ins.reuse.value and f"first difference at token {d.token_index}" in ins.reuse.value

    # a comm message from the browser: the Dropdown's frontend state is its index
    ins.request._handle_msg({"content": {"data": {"method": "update", "state": {"index": 0}}},
                             "buffers": []})
    s = ins.state()
    assert s["selected"] == 1 and s["against"] is None
    assert "nothing was cached before it" in ins.figs["divergence"].layout.title.text

    ins.request.value = 3
    ins.against.value = "previous request"
    assert ins.state()["against"] == 2
    ins.against.value = "entry it reused"
    assert ins.state()["against"] == 1 and "stored the entry it reused" in ins.reuse.value


def test_budget_slider_replays_like_a_real_store(tiny):
    engine = kv.Engine(tiny, kv.RadixStore(budget_bytes=64 << 20))
    ins = kv.Inspector(engine)
    results = run(engine)
    live = [r.reused_tokens for r in results]
    assert results[2].match == "exact"

    # at the store's own budget the replay reproduces the live reuse, token for token
    s = ins.state()
    assert s["replay"] == "entries" and s["simulated"]["reused_tokens"] == live
    assert s["simulated"]["token_hit_rate"] == pytest.approx(engine.stats()["token_hit_rate"])

    entry_bytes = engine.events.filter(pl.col("event") == "insert")["bytes"].to_list()
    # room for one entry only: request 2's entry pushes request 1's out, so request 3 only
    # shares the system prompt; check against a real store at that budget
    one = max(entry_bytes)
    ins.budget.value = one / 2**20
    sim_one = ins.state()["simulated"]
    real = kv.Engine(tiny, kv.RadixStore(budget_bytes=one))
    assert sim_one["reused_tokens"] == [r.reused_tokens for r in run(real)]
    assert 0 < sim_one["token_hit_rate"] < s["simulated"]["token_hit_rate"]
    assert f"{sim_one['token_hit_rate']:.1%}" in ins.sim_label.value

    # below one entry nothing can be kept: 0 reuse (a real RadixStore refuses such a budget)
    ins.budget.value = min(entry_bytes) / 2 / 2**20
    low = ins.state()["simulated"]
    assert low["token_hit_rate"] == 0.0 and low["reused_tokens"] == [0, 0, 0]
    with pytest.raises(kv.BudgetError):
        run(kv.Engine(tiny, kv.RadixStore(budget_bytes=min(entry_bytes) // 2)))
    # the memory figure's budget line moved with the slider; the budget tab's curve is drawn
    # when the tab is opened, with a marker at the slider
    assert ins.figs["memory"].layout.meta["budget_bytes"] == ins.state()["memory"]["budget_bytes"]
    assert len(ins.figs["budget"].data) == 0
    ins.tabs.selected_index = 5
    marker = next(t for t in ins.figs["budget"].data if t.name == "slider")
    assert marker.x[0] == pytest.approx(ins.budget.value) and marker.y[0] == 0.0
    curve = ins.figs["budget"].data[0]
    assert min(curve.y) == 0.0 and max(curve.y) == pytest.approx(s["simulated"]["token_hit_rate"])

    # the block replay runs a PagedStore, which refuses a request whose blocks exceed the whole
    # budget (as a live one does): half an entry keeps nothing, one entry keeps blocks, exactly
    # as a real PagedStore at that budget; below one 16-token block nothing hits
    ins.mode.value = "blocks"
    assert ins.state()["simulated"]["token_hit_rate"] == 0.0
    with pytest.raises(kv.BudgetError):
        run(kv.Engine(tiny, kv.PagedStore(16, budget_bytes=min(entry_bytes) // 2)))
    ins.budget.value = one / 2**20
    paged_one = ins.state()["simulated"]
    assert paged_one["token_hit_rate"] > 0
    assert paged_one["reused_tokens"] == [r.reused_tokens
                                          for r in run(kv.Engine(tiny, kv.PagedStore(16, budget_bytes=one)))]
    ins.budget.value = (16 * ins.bytes_per_token() - 1) / 2**20
    assert ins.state()["simulated"]["token_hit_rate"] == 0.0
    ins.budget.value = 1024.0
    blocks = ins.state()["simulated"]["reused_tokens"]
    assert blocks == [0, 16 * ((results[1].reused_tokens) // 16), 16 * ((results[2].prompt_tokens - 1) // 16)]


def test_inspector_on_a_paged_store(tiny):
    store = kv.PagedStore(block_size=16, budget_bytes=64 << 20)
    engine = kv.Engine(tiny, store)
    ins = kv.Inspector(engine)
    results = run(engine)
    s = ins.state()
    assert s["replay"] == "blocks" and s["error"] is None
    assert s["simulated"]["reused_tokens"] == [r.reused_tokens for r in results]
    blocks = store.blocks_frame()
    # the tree is the block chains collapsed into runs (kvlab.stores.block_tree), not a block per level
    assert s["tree"]["nodes"] == store.tree_frame().height < blocks.height
    assert s["tree"]["tokens"] == 16 * blocks.height
    total = next(t for t in ins.figs["memory"].data if t.name == "total")
    assert total.y[-1] == store.nbytes
    assert s["blocks"]["hit"] == sum(r.reused_tokens // 16 for r in results)
    ins.against.value = "entry it reused"
    assert ins.state()["against"] == 1


def test_a_drawing_error_does_not_stop_the_engine(tiny, monkeypatch):
    engine = kv.Engine(tiny, kv.RadixStore(budget_bytes=64 << 20))
    ins = kv.Inspector(engine)

    def broken():
        raise ValueError("boom")

    monkeypatch.setattr(ins, "_draw_tree", broken)
    with pytest.warns(UserWarning, match="could not draw: ValueError: boom"):
        result = engine.run(REQUESTS[0], max_tokens=2)
    assert result.request_id == 1 and ins.last_error == "ValueError: boom"
    assert "boom" in ins.error.value
    monkeypatch.undo()
    engine.run(REQUESTS[1], max_tokens=2)
    assert ins.last_error is None and ins.error.value == ""


def test_inspector_without_a_store(tiny):
    engine = kv.Engine(tiny, None)
    ins = kv.Inspector(engine)
    engine.run(REQUESTS[0], max_tokens=2)
    s = ins.state()
    assert s["requests"] == 1 and s["table_rows"] == 1 and s["error"] is None
    assert s["simulated"] is None and "no entry has been stored" in ins.sim_label.value
    assert "no store" in ins.figs["tree"].layout.title.text


def drawn_misses(ins) -> dict:
    """The misses tab's bars, per trace name, as the browser would draw them."""
    return {t.name: [int(v) for v in t.y] for t in ins.figs["misses"].data}


def test_misses_panel_follows_the_engine(tiny):
    # room for one entry: request 3 finds request 1's tokens evicted by request 2
    one = kv.Engine(tiny, kv.RadixStore())
    one.run(REQUESTS[0], max_tokens=3)
    budget = int(1.5 * one.events.filter(pl.col("event") == "insert")["bytes"][0])
    engine = kv.Engine(tiny, kv.RadixStore(budget_bytes=budget))
    ins = kv.Inspector(engine)
    assert ins.state()["misses"] == {name: [] for name in ("reused", *kv.policies.ALL_REASONS)}
    run(engine, REQUESTS[:1])
    first = drawn_misses(ins)
    assert first["first_seen"] == [engine.results[0].miss_reasons["first_seen"]] and first["reused"] == [0]
    run(engine, REQUESTS[1:] + [chat("00000", "What does tests/test_app.py check?")])
    drawn = drawn_misses(ins)
    results = engine.results
    assert drawn["reused"] == [r.reused_tokens for r in results]
    for reason in kv.policies.ALL_REASONS:
        assert drawn[reason] == [r.miss_reasons[reason] for r in results], reason
    # the bars show the eviction, the divergence and the changed header (cch) line
    assert drawn["evicted"][2] > 0 and results[2].evicted_by == 2
    assert drawn["diverged"][1] > 0 and drawn["diverged"][3] > 0
    assert [sum(col[i] for col in drawn.values()) for i in range(4)] == [r.prompt_tokens for r in results]
    assert list(ins.figs["misses"].data[0].x) == ["#1", "#2", "#3", "#4"]
    assert ins.figs["misses"].layout.meta["totals"] == {"reused": sum(drawn["reused"]),
                                                         **engine.stats()["miss_reasons"]}
    assert ins.tabs.get_title(6) == "misses" and ins.state()["error"] is None


def test_misses_panel_says_when_results_carry_no_reasons(tiny):
    from kvlab.viz.panels import misses_figure

    engine = kv.Engine(tiny, kv.RadixStore())
    run(engine, REQUESTS[:1])
    # a server on mlx-lm's own LRUPromptCache records no reasons: the tab says so
    bare = [dataclasses.replace(r, miss_reasons={}) for r in engine.results]
    fig = misses_figure(bare)
    assert len(fig.data) == 0 and "not recorded by this server's cache" in fig.layout.title.text
    assert misses_figure(engine.results).layout.meta["totals"]["first_seen"] == \
        engine.results[0].miss_reasons["first_seen"]
