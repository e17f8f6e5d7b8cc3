"""Traces for the simulator and policy tests: one from hand-written (input_length, hash_ids) rows,
the hit blocks of a result, and random traces whose requests extend, repeat or branch off earlier
ones (chained ids, Mooncake-style lengths)."""

from __future__ import annotations

import math

import polars as pl
from hypothesis import strategies as st

import kvlab as kv


def trace(rows, block_size=4, priority=None):
    """rows: (input_length, hash_ids) pairs -> Trace; ``priority``: one int per row."""
    frame = pl.DataFrame({"timestamp": list(range(len(rows))), "input_length": [n for n, _ in rows],
                          "output_length": [1] * len(rows), "hash_ids": [list(h) for _, h in rows]},
                         schema=kv.traces.SCHEMA)
    if priority is not None:
        frame = frame.with_columns(pl.Series("priority", priority))
    return kv.traces.Trace(frame, block_size)


def hits(result):
    return result.requests["hit_blocks"].to_list()


@st.composite
def chained_traces(draw, block_sizes=(1, 2, 4), max_requests=25, max_blocks=10, out_of_chain=False,
                   priorities=False):
    """Up to ``max_requests`` requests of up to ``max_blocks`` blocks, each new or the head of an
    earlier one extended; ``out_of_chain``: now and then an id reused out of its chain (a
    hand-made trace may); ``priorities``: a random priority per request."""
    bs = draw(st.sampled_from(block_sizes))
    rows, next_id = [], 0
    for _ in range(draw(st.integers(1, max_requests))):
        n = draw(st.integers(1, max_blocks * bs))
        m = math.ceil(n / bs)
        ids = []
        if rows and draw(st.booleans()):
            parent = rows[draw(st.integers(0, len(rows) - 1))][1]
            ids = parent[: draw(st.integers(0, min(m, len(parent))))]
        ids = ids + list(range(next_id, next_id + m - len(ids)))
        if out_of_chain and draw(st.integers(0, 9)) == 0 and len(ids) > 1:
            ids[draw(st.integers(1, len(ids) - 1))] = draw(st.integers(0, max(0, next_id - 1)))
            ids = list(dict.fromkeys(ids)) + list(range(next_id + m, next_id + m + m - len(set(ids))))
            ids = ids[:m]
        next_id += 2 * m
        rows.append((n, ids))
    prio = draw(st.lists(st.integers(0, 3), min_size=len(rows), max_size=len(rows))) if priorities else None
    return trace(rows, bs, prio)
