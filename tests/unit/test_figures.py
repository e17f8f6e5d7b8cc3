"""kv.viz figures from hand-made frames and Tokens (no model): the trace data carries the values."""

import subprocess
import sys
import textwrap

import polars as pl
import pytest

import kvlab as kv

pytest.importorskip("plotly")

from kvlab import viz  # noqa: E402
from kvlab.stores.base import Capabilities, StoreBase  # noqa: E402
from kvlab.viz import VizError  # noqa: E402
from kvlab.primitives.tokens import from_ids  # noqa: E402
from kvlab.viz.blocks import block_states, request_rows  # noqa: E402
from kvlab.viz.common import COLORS, ROLES  # noqa: E402


class FakeTokenizer:
    """Enough of a Hugging Face tokenizer for decoding: one string per id."""

    def __init__(self, vocab: dict[int, str]):
        self.vocab = vocab
        self.ids = {v: k for k, v in vocab.items()}

    def decode(self, ids):
        return "".join(self.vocab[int(i)] for i in ids)

    def batch_decode(self, seqs):
        return [self.decode(s) for s in seqs]

    def convert_tokens_to_ids(self, token):
        return self.ids.get(token)

    def __len__(self):  # the vocabulary size that ids are checked against
        return len(self.vocab)


TEXT_A = ["<|im_start|>", "system", "\n", "cch", "=", "eb6c6", ";", " Be", " brief", "<|im_end|>",
          "\n", "<|im_start|>", "user", "\n", "Hi", "<|im_end|>"]
VOCAB = list(dict.fromkeys(TEXT_A + ["a1b2c"]))
TOK = FakeTokenizer(dict(enumerate(VOCAB)))
A = [VOCAB.index(p) for p in TEXT_A]
B = [VOCAB.index("a1b2c") if i == 5 else t for i, t in enumerate(A)]  # cch=a1b2c


# ------------------------------------------------------------------------------------ imports

def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def test_import_kvlab_does_not_import_plotly_or_ipywidgets():
    out = _run("""
        import sys, kvlab
        print(sorted(m for m in ("plotly", "ipywidgets", "anywidget") if m in sys.modules))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("missing, attr", [("plotly", "viz"), ("ipywidgets", "Inspector")])
def test_missing_extra_says_how_to_install(missing, attr):
    out = _run(f"""
        import sys
        sys.modules[{missing!r}] = None  # as if it were not installed
        import kvlab as kv
        try:
            getattr(kv, {attr!r})
        except kv.KvlabError as e:
            print(type(e).__name__, "|", e)
    """)
    assert out.returncode == 0, out.stderr
    name, message = out.stdout.split(" | ", 1)
    assert name == "MissingExtraError"
    assert missing in message and 'pip install "kvlab[notebooks]"' in message


# -------------------------------------------------------------------------------- prefix tree

def radix_frame() -> pl.DataFrame:
    # root -> 6 (tokens 0:3) -> {1 (3:5, entry), 4 (3:4, entry)}; 7 (0:2 "<|im_start|>system")
    return pl.DataFrame({
        "id": [0, 6, 1, 4, 7], "parent": [None, 0, 6, 6, 0], "start": [0, 0, 3, 3, 0],
        "depth": [0, 3, 5, 4, 2], "tokens": [0, 3, 2, 1, 2],
        "edge_ids": [[], [3, 4, 5], [6, 7], [11], [0, 1]],
        "entry": [None, None, 2, 5, 8], "hits": [4, 3, 1, 0, 2], "last_used": [9, 9, 5, 7, 8],
        "bytes": [0, 0, 5120, 4096, 2048]}, schema_overrides={"parent": pl.Int64, "entry": pl.Int64})


def test_prefix_tree_icicle_from_a_known_radix_frame():
    fig = viz.prefix_tree(radix_frame(), TOK)
    ice = fig.data[0]
    assert ice.type == "icicle" and ice.branchvalues == "remainder"
    assert list(ice.ids) == ["0", "6", "1", "4", "7"]
    assert list(ice.parents) == ["", "0", "6", "6", "0"]
    assert list(ice.values) == [0, 3, 2, 1, 2]
    assert sum(ice.values) == 8  # every token in the tree once
    assert list(ice.labels) == ["root", "cch=eb6c6", "; Be", "Hi", "&lt;|im_start|&gt;system"]
    assert list(ice.marker.colors) == [4, 3, 1, 0, 2]
    hover = ice.customdata[2]
    assert hover[0] == "; Be" and hover[1] == 5120 and hover[2] == 5 and hover[7] == 2


def test_prefix_tree_recency_and_no_tokenizer():
    fig = viz.prefix_tree(radix_frame(), color="recency")
    assert list(fig.data[0].marker.colors) == [9, 9, 5, 7, 8]
    assert fig.data[0].labels[2] == "#1 · 2 tok"
    with pytest.raises(VizError, match="color must be"):
        viz.prefix_tree(radix_frame(), color="bytes")


def test_prefix_tree_from_paged_blocks_frame_adds_one_root():
    class Paged(StoreBase):  # a store that declares a blocks view, drawn as PagedStore's is
        name, nbytes, entries = "paged-like", 0, 0
        capabilities = Capabilities(block_size=2, views=("blocks",))

        def lookup(self, key, tokens, *, limit):
            raise NotImplementedError

        def insert(self, key, tokens, snap, *, kind="prompt"):
            raise NotImplementedError

        def blocks_frame(self):
            return pl.DataFrame({"block": [1, 2, 3], "hash": ["a", "b", "c"],
                                 "parent": [None, "a", None], "token_ids": [[0, 1], [2, 3], [0, 10]],
                                 "bytes": [10, 10, 10], "hits": [1, 0, 0], "last_used": [3, 2, 1]})

    ice = viz.prefix_tree(Paged(), TOK).data[0]
    assert list(ice.ids) == ["a", "b", "c", "root"]
    assert list(ice.parents) == ["root", "a", "root", ""]
    assert list(ice.values) == [2, 2, 2, 0]
    assert [c[5] for c in ice.customdata[:3]] == [0, 2, 0]  # chain positions


def test_prefix_tree_rejects_other_things():
    with pytest.raises(VizError, match="tree_frame"):
        viz.prefix_tree(42)
    with pytest.raises(VizError, match="missing"):
        viz.prefix_tree(pl.DataFrame({"id": [1]}))


# ---------------------------------------------------------------------------- memory over time

def events() -> pl.DataFrame:
    rows = [(1, "lookup", 10, 0, None, 0.1, "miss"), (1, "insert", 10, 1000, "1", 0.2, "prompt"),
            (2, "insert", 20, 2000, "2", 0.3, "checkpoint"), (2, "evict", 10, 1000, "1", 0.35, "lru"),
            (3, "hit", 5, 0, "2", 0.38, "prefix"), (3, "insert", 5, 500, "3", 0.4, "prompt"),
            (3, "block_stored", 16, 300, "h1", 0.5, "prompt"),
            (3, "block_removed", 16, 300, "h1", 0.6, "lru")]
    return pl.DataFrame(rows, schema=["request", "event", "tokens", "bytes", "entry", "t", "detail"],
                        orient="row")


def test_memory_over_time_total_is_cumulative_bytes():
    fig = viz.memory_over_time(events(), budget_bytes=4000)
    by_name = {t.name: t for t in fig.data}
    total = by_name["total"]
    assert list(total.x) == [0.2, 0.3, 0.35, 0.4, 0.5, 0.6]
    assert list(total.y) == [1000, 3000, 2000, 2500, 2800, 2500]
    # stacked by the kind each entry was inserted as (the evict row's detail is the reason)
    assert list(by_name["prompt"].y) == [1000, 1000, 0, 500, 800, 500]
    assert list(by_name["checkpoint"].y) == [0, 2000, 2000, 2000, 2000, 2000]
    assert [a + b for a, b in zip(by_name["prompt"].y, by_name["checkpoint"].y)] == list(total.y)
    ev = by_name["evictions"]
    assert list(ev.x) == [0.35, 0.6] and list(ev.y) == [2000, 2500]
    assert fig.layout.shapes[0].y0 == 4000 and fig.layout.meta["budget_bytes"] == 4000


def test_memory_over_time_by_entry_and_empty():
    fig = viz.memory_over_time(events(), by="entry")
    names = [t.name for t in fig.data]
    assert names[:4] == ["entry 1", "entry 2", "entry 3", "entry h1"]
    assert list(fig.data[0].y) == [1000, 1000, 0, 0, 0, 0]
    empty = viz.memory_over_time(events().filter(pl.col("event") == "lookup"))
    assert len(empty.data) == 0 and "no store events" in empty.layout.annotations[0].text
    with pytest.raises(VizError, match="by must be"):
        viz.memory_over_time(events(), by="request")


# ---------------------------------------------------------------------------------- divergence

def test_from_ids_finds_chatml_messages():
    t = from_ids(A, TOK, chatml_spans=True)
    assert [(s.role, s.token_start, s.token_end) for s in t.spans] == [("system", 0, 11), ("user", 11, 16)]
    assert t.piece(5) == "eb6c6" and t.text.startswith("<|im_start|>system\ncch=eb6c6;")


def test_divergence_marks_the_exact_differing_token_and_the_volatile_field():
    fig = viz.divergence(A, B, TOK)
    assert fig.layout.meta["token_index"] == 5 and fig.layout.meta["common"] == 5
    first = next(t for t in fig.data if t.name == "first difference")
    assert list(first.x) == [5, 5]
    box = [s for s in fig.layout.shapes if s.line.color == COLORS["diverge"]]
    assert [(s.x0, s.x1) for s in box] == [(4.5, 5.5)]
    # cch's value is volatile in both prompts, boxed in orange on each row
    assert [tuple(v) for v in fig.layout.meta["volatile"]] == [(5, 6, "cch", 0), (5, 6, "cch", 1)]
    # message boundaries: the user message starts at token 11 on both rows
    lines = [(s.x0, s.y0, s.y1) for s in fig.layout.shapes if s.type == "line"]
    assert lines == [(10.5, -0.5, 0.5), (10.5, 0.5, 1.5)]
    heat = fig.data[0]
    roles = ROLES
    assert heat.z[0][0] == roles.index("system") and heat.z[1][12] == roles.index("user")
    assert "eb6c6" in heat.text[0][5] and "a1b2c" in heat.text[1][5]
    assert "message 0 (system)" in fig.layout.title.text


def test_divergence_of_identical_prefix_and_raw_ids():
    same = viz.divergence(A, A, TOK)
    assert same.layout.meta["token_index"] is None
    assert not any(t.name == "first difference" for t in same.data)
    assert same.layout.title.text.startswith("identical")
    prefix = viz.divergence(A[:7], A, TOK)
    assert prefix.layout.meta["common"] == 7 and "prefix" in prefix.layout.title.text
    raw = viz.divergence([1, 2, 3, 4], [1, 2, 9], volatile=False)
    assert raw.layout.meta["token_index"] == 2 and raw.data[0].text[1][2].endswith("&lt;9&gt;")
    assert raw.data[0].z[1][3] is None  # b is shorter
    with pytest.raises(VizError, match="model"):
        viz.divergence("some text", "other text")


def test_divergence_accepts_tokens_and_explicit_fields():
    ta, tb = from_ids(A, TOK, chatml_spans=True), from_ids(B, TOK, chatml_spans=True)
    fig = viz.divergence(ta, tb, volatile=[(3, 7, "header")])
    assert fig.layout.meta["token_index"] == 5
    assert [tuple(v) for v in fig.layout.meta["volatile"]] == [(3, 7, "header", 0)]


# ---------------------------------------------------------------------------------- block grid

def test_block_grid_hit_miss_evicted():
    p1 = list(range(1, 11))
    frame = pl.DataFrame({"request_id": [1, 2, 3, 4], "prompt_tokens": [10, 10, 10, 2],
                          "reused_tokens": [0, 8, 4, 1],
                          "prompt_ids": [p1, p1[:8] + [20, 21], p1, [1, 2]]})
    fig = viz.block_grid(frame, block_size=4)
    # request 3 repeats request 1 but reused one block: block 1 was lost; block 2 is partial,
    # never cacheable, so a plain miss
    assert [list(r) for r in fig.data[0].z] == [[1, 1, 1], [0, 0, 1], [0, 2, 1], [0, None, None]]
    assert list(fig.data[0].y) == ["#1", "#2", "#3", "#4"]
    assert fig.layout.meta["counts"] == {"hit": 4, "miss": 5, "evicted": 1}
    # without ids nothing can be called evicted
    no_ids = frame.drop("prompt_ids")
    assert block_states(request_rows(no_ids), 4)[2] == [0, 1, 1]
    with pytest.raises(VizError, match="block_size"):
        viz.block_grid(frame, block_size=0)


# ---------------------------------------------------------------------------- hit rate curves

def sweep_frame(scale: float) -> pl.DataFrame:
    return pl.DataFrame({"capacity_tokens": [16, 256, 4096],
                         "token_hit_rate": [0.1 * scale, 0.4 * scale, 0.6 * scale],
                         "request_hit_rate": [0.2, 0.5, 0.9]})


def test_hit_rate_curves_one_trace_per_policy():
    fig = viz.hit_rate_curves({"lru": sweep_frame(1), "fifo": sweep_frame(0.5)})
    assert [t.name for t in fig.data] == ["lru", "fifo"]
    assert all(list(t.x) == [16, 256, 4096] for t in fig.data)
    assert list(fig.data[1].y) == pytest.approx([0.05, 0.2, 0.3])
    assert fig.layout.xaxis.type == "log"


def test_hit_rate_curves_from_a_policy_column_and_both_metrics():
    frame = pl.concat([sweep_frame(1).with_columns(policy=pl.lit("lru")),
                       sweep_frame(0.5).with_columns(policy=pl.lit("lfu"))])
    fig = viz.hit_rate_curves(frame, "both")
    assert [t.name for t in fig.data] == ["lru · token", "lru · request", "lfu · token", "lfu · request"]
    assert fig.data[1].line.dash == "dash" and list(fig.data[3].y) == [0.2, 0.5, 0.9]
    with pytest.raises(VizError, match="policy"):
        viz.hit_rate_curves(sweep_frame(1))


def test_hit_rate_curves_with_a_real_sweep():
    seqs = [[1] * 40, [1] * 36, [2] * 20, [1] * 40]
    caps = [16, 32, 64, 128]
    fig = viz.hit_rate_curves({p: kv.sweep(seqs, p, caps, block_size=16) for p in ("lru", "fifo")})
    assert len(fig.data) == 2 and list(fig.data[0].x) == caps
    assert fig.data[0].y[-1] == pytest.approx((32 + 32) / 136)


# the Inspector's budget replay (kvlab.experiments.replay) is tested in test_replay.py


def test_hit_rate_curves_draw_the_optimum_as_the_ceiling_and_fit_the_axis():
    sweeps = {f"p{i}": sweep_frame(0.1 + 0.05 * i) for i in range(10)}
    sweeps["belady"] = sweep_frame(0.4)
    fig = viz.hit_rate_curves(sweeps)
    best = fig.data[-1]  # drawn last, on top of what it bounds
    # mutant: the optimum coloured from the palette like any policy (the 11th trace got LRU's blue)
    assert best.name == "belady (optimum: the ceiling)"
    assert (best.line.color, best.line.dash) == ("black", "dash")
    assert all(t.line.color != "black" for t in fig.data[:-1])
    # mutant: eleven coloured lines; only the four best online policies keep colours
    assert fig.layout.meta["highlighted"] == ["p6", "p7", "p8", "p9"]
    assert sum(t.line.color == "#c7c7c7" for t in fig.data) == 6
    # mutant: a fixed 0-100% axis; the data tops at 0.6 x 0.55 = 33%
    assert fig.layout.yaxis.range[1] == pytest.approx(0.33 * 1.08 + 0.01)
    assert fig.layout.xaxis.title.text == "cache capacity, tokens (log scale)"
    assert fig.layout.yaxis.title.text == "token hit rate (share of prompt tokens reused)"
