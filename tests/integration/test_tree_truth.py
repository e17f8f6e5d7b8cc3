"""The store's tree tells the truth (issue 23, point 4), on the tiny model through the Engine:
hits and recency go to the nodes that served the tokens (never the root), a paged store's block
chains read as the same prefix tree a RadixStore draws for the same traffic, and `%kvlab tree`
draws that tree in text on a paged store too."""

from __future__ import annotations

import polars as pl
import pytest
from IPython.core.interactiveshell import InteractiveShell

import kvlab as kv
from kvlab.stores.shared_radix import SharedRadixStore

pytestmark = pytest.mark.model

SYSTEM = "You are a careful assistant. " * 60
QUESTIONS = ("What does app.py do when the config file is missing, and which test checks it?",
             "Which function in the parser reads the headers, and what does it return on error?")
A, B = ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS)
SHARED = 369  # tokens A and B share: the system prompt and the user turn's template start
LENGTHS = (392, 391)  # A's and B's prompt tokens
BLOCK = 9  # divides SHARED: 41 blocks


def served(model, store, requests=(A, B, A)) -> tuple[list, pl.DataFrame]:
    engine = kv.Engine(model, store)
    return [engine.run(r, max_tokens=2) for r in requests], store.tree_frame()


def spans(tree: pl.DataFrame) -> list[tuple]:
    return sorted(zip(tree["start"], tree["depth"], tree["hits"]))


@pytest.mark.parametrize("make", [lambda: kv.RadixStore(budget_bytes=64 << 20),
                                  lambda: SharedRadixStore(budget_bytes=64 << 20)],
                         ids=["radix", "shared-radix"])
def test_hits_go_to_the_nodes_that_served_them(tiny, make):
    results, tree = served(tiny, make())
    assert [r.prompt_tokens for r in results] == [*LENGTHS, LENGTHS[0]]
    assert [r.reused_tokens for r in results] == [0, SHARED, LENGTHS[0] - 1]
    # the root serves no token: 0 hits; the shared node served B and A again; A's own tail
    # served the repeat of A (all but its last token); B's tail was never reused
    assert spans(tree) == [(0, 0, 0), (0, SHARED, 2), (SHARED, LENGTHS[1], 0), (SHARED, LENGTHS[0], 1)]
    by_span = {(s, d): t for s, d, t in zip(tree["start"], tree["depth"], tree["last_used"])}
    assert by_span[(0, 0)] == 0 and by_span[(0, SHARED)] == by_span[(SHARED, LENGTHS[0])] > 0


def test_the_shared_node_is_hit_after_one_reuse(tiny):
    _, tree = served(tiny, kv.RadixStore(budget_bytes=64 << 20), (A, B))
    assert spans(tree) == [(0, 0, 0), (0, SHARED, 1), (SHARED, LENGTHS[1], 0), (SHARED, LENGTHS[0], 0)]


def test_a_paged_store_reads_as_the_same_prefix_tree(tiny):
    _, radix = served(tiny, kv.RadixStore(budget_bytes=64 << 20))
    store = kv.PagedStore(block_size=BLOCK, budget_bytes=64 << 20)
    _, paged = served(tiny, store)
    assert store.blocks_frame().height == 41 + 2 + 2  # the shared run and two 2-block tails
    assert paged.height == radix.height == 4
    # the same spans, each tail rounded down to whole blocks (only full blocks are cached)
    down = [(s, s + (d - s) // BLOCK * BLOCK, h) for s, d, h in spans(radix)]
    assert spans(paged) == down == [(0, 0, 0), (0, SHARED, 2), (SHARED, SHARED + 18, 0), (SHARED, SHARED + 18, 1)]
    assert sorted(paged["blocks"]) == [0, 2, 2, 41]
    assert paged["bytes"].sum() == store.nbytes


def test_kvlab_tree_on_a_paged_store_draws_the_tree(tiny):
    existed = InteractiveShell.initialized()
    shell = InteractiveShell.instance()
    try:
        shell.run_cell("%load_ext kvlab").raise_error()
        shell.user_ns["m"] = tiny
        shell.run_line_magic("kvlab", "load m --store paged")
        shell.run_line_magic("kvlab", "run shared_system_prompt --users 2 --system-tokens 120 --max-tokens 1")
        store = kv.magics.state(shell).engine.store
        view = shell.run_line_magic("kvlab", "tree")
        text = shell.display_formatter.format(view)[0]["text/plain"]
        nodes = store.tree_frame().height
        rows = text.splitlines()[1:]  # after the store's repr
        assert len(rows) == nodes < store.blocks_frame().height
        assert rows[0] == "root" and all("blocks, hits" in r for r in rows[1:])
        assert "hash" not in text
    finally:
        shell.run_line_magic("kvlab", "load m")
        if not existed:
            InteractiveShell.clear_instance()


def test_the_inspector_shows_the_reuse_in_readable_units(tiny):
    pytest.importorskip("ipywidgets")
    from kvlab.viz.tree import NEVER_HIT

    engine = kv.Engine(tiny, kv.RadixStore(budget_bytes=256 << 20))
    ins = kv.Inspector(engine)
    for r in (A, B):
        engine.run(r, max_tokens=2)
    ice = ins.figs["tree"].data[0]
    tree = engine.store.tree_frame()
    shared = str(tree.filter(pl.col("depth") == SHARED)["id"][0])
    i = list(ice.ids).index(shared)
    assert ice.marker.colors[i] == 1 and ice.marker.cmin == 0 and ice.marker.colorscale[0][1] == NEVER_HIT
    assert ice.marker.colors[list(ice.ids).index("0")] == 0  # the root served nothing
    assert ins.budget_text.value == "256.0 MiB" and ins.budget.readout is False
    ins.budget.value = 6030  # MiB: the slider's own readout said "6.03e+3"
    assert ins.budget_text.value == "5.9 GiB"
    mem = ins.figs["memory"].layout
    peak = engine.store.nbytes
    assert mem.yaxis.range[1] == peak * 1.1 and "far above this axis" in mem.annotations[0].text
