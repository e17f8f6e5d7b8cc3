"""The tree and memory views scale to their data (issue 23, point 4), with no model: node hit
records across splits and merges, a paged store's blocks collapsed into runs, the icicle's
never-hit colour and the memory axis against a far budget."""

from __future__ import annotations

import polars as pl

from kvlab import viz
from kvlab.stores import node_hits
from kvlab.stores.block_tree import tree_of
from kvlab.viz.tree import NEVER_HIT


def test_a_split_keeps_each_hit_where_it_served():
    s = node_hits.credit(node_hits.credit(node_hits.credit({}, 10, 1), 4, 2), 7, 3)
    assert node_hits.hits(s) == 3 and node_hits.last_hit(s) == 3
    head, tail = node_hits.split(s, 5)
    assert head == {5: [2, 3], 4: [1, 2]}  # reach 10 and 7 both covered the whole head
    assert tail == {5: [1, 1], 2: [1, 3]}
    assert (node_hits.hits(head), node_hits.hits(tail), node_hits.last_hit(tail)) == (3, 2, 3)
    assert node_hits.join(head, 5, tail) == s  # merging back gives the same record
    assert node_hits.split({}, 3) == ({}, {})


def test_a_merge_keeps_the_hits_that_stopped_at_the_head():
    head = node_hits.credit(node_hits.credit({}, 4, 1), 4, 2)  # two lookups through all 4
    tail = node_hits.credit({}, 3, 2)  # one of them went on 3 tokens into the child
    assert node_hits.join(head, 4, tail) == {4: [1, 2], 7: [1, 2]}


def blocks(rows):
    return pl.DataFrame(rows, schema={"block": pl.Int64, "hash": pl.Utf8, "parent": pl.Utf8,
                                      "token_ids": pl.List(pl.Int64), "bytes": pl.Int64,
                                      "hits": pl.Int64, "last_used": pl.Int64})


def test_block_chains_collapse_into_runs():
    frame = blocks([
        {"block": 1, "hash": "a", "parent": None, "token_ids": [0, 1], "bytes": 10, "hits": 2, "last_used": 9},
        {"block": 2, "hash": "b", "parent": "a", "token_ids": [2, 3], "bytes": 10, "hits": 2, "last_used": 9},
        {"block": 3, "hash": "c", "parent": "b", "token_ids": [4, 5], "bytes": 10, "hits": 1, "last_used": 8},
        {"block": 4, "hash": "d", "parent": "b", "token_ids": [6, 7], "bytes": 10, "hits": 0, "last_used": 3},
        {"block": 5, "hash": "e", "parent": "d", "token_ids": [8, 9], "bytes": 10, "hits": 0, "last_used": 4},
        {"block": 6, "hash": "f", "parent": "gone", "token_ids": [1, 1], "bytes": 10, "hits": 0, "last_used": 1},
    ])
    tree = tree_of(frame)
    assert tree.select("id", "parent", "start", "depth", "tokens", "hits", "last_used", "bytes", "blocks").rows() == [
        (0, None, 0, 0, 0, 0, 0, 0, 0),
        (1, 0, 0, 4, 4, 2, 9, 20, 2),   # a -> b: one run, parting ways after it
        (3, 1, 4, 6, 2, 1, 8, 10, 1),
        (4, 1, 4, 8, 4, 0, 4, 20, 2),   # d -> e
        (6, 0, None, None, 2, 0, 1, 10, 1),  # its parent left: position unknown
    ]
    assert tree["edge_ids"].to_list()[1] == [0, 1, 2, 3]
    assert tree_of(blocks([])).height == 1


def test_the_icicle_greys_only_never_hit_nodes():
    frame = pl.DataFrame({"id": [0, 1, 2, 3], "parent": [None, 0, 1, 1], "tokens": [0, 476, 12, 11],
                          "hits": [0, 1, 0, 0], "last_used": [0, 4, 0, 0]},
                         schema_overrides={"parent": pl.Int64})
    marker = viz.prefix_tree(frame).data[0].marker
    assert list(marker.colors) == [0, 1, 0, 0]
    assert (marker.cmin, marker.cmax) == (0, 1)
    scale = [list(x) for x in marker.colorscale]
    assert scale[0] == [0.0, NEVER_HIT] and scale[-1][0] == 1.0 and scale[-1][1] != NEVER_HIT
    # a node hit once is past the grey stop however many hits the busiest node has
    busy = frame.with_columns(pl.Series("hits", [0, 40, 1, 0]))
    marker = viz.prefix_tree(busy).data[0].marker
    assert marker.cmax == 40 and 1 / 40 > scale[1][0] > 0


def events(nbytes):
    return pl.DataFrame({"event": ["insert"] * len(nbytes), "bytes": nbytes,
                         "t": [float(i) for i in range(len(nbytes))], "entry": [str(i) for i in range(len(nbytes))],
                         "detail": ["prompt"] * len(nbytes), "request": list(range(1, len(nbytes) + 1))})


def test_the_memory_axis_fits_the_data_not_a_far_budget():
    mib = 2**20
    peak = 1_363_148  # 1.3 MiB in two inserts, under a 256 MiB budget
    fig = viz.memory_over_time(events([peak - 400_000, 400_000]), budget_bytes=256 * mib)
    top = fig.layout.yaxis.range[1]
    assert 0 < top <= 2 * peak and top == peak * 1.1
    assert not fig.layout.shapes  # no budget line
    assert fig.layout.annotations[0].text == "budget 256.0 MiB (197x the peak): far above this axis"
    assert list(fig.layout.yaxis.ticktext) == ["0 B", "256.0 KiB", "512.0 KiB", "768.0 KiB", "1.0 MiB", "1.2 MiB"]
    assert list(fig.layout.yaxis.tickvals) == [k * 256 * 1024 for k in range(6)]
    near = viz.memory_over_time(events([peak]), budget_bytes=1_900_000)  # within 1.5x: drawn
    assert near.layout.shapes[0].y0 == 1_900_000 and near.layout.yaxis.range[1] == 1_900_000 * 1.05
    assert near.layout.yaxis.range[1] <= 2 * peak
