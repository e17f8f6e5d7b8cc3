"""kv.traces: Mooncake JSONL in and out, block-hash export, clear errors on malformed files."""

import json
import math

import numpy as np
import polars as pl
import pytest

import kvlab as kv
from kvlab.primitives.blocks import chained_hashes
from kvlab.errors import BlockSizeError, TraceError


@pytest.fixture(scope="module")
def synthetic():
    try:
        path = kv.traces.locate()
    except TraceError as e:
        pytest.skip(f"Mooncake synthetic trace not available ({e})")
    return kv.traces.read(path)


def write_lines(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


GOOD = {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}


def test_read_the_public_synthetic_trace(synthetic):
    t = synthetic
    assert len(t) == 3993 and t.block_size == 512
    assert t.frame.columns == ["timestamp", "input_length", "output_length", "hash_ids"]
    assert t.frame.schema["hash_ids"] == pl.List(pl.Int64)
    # Mooncake convention: ceil(n / 512) ids, the last one possibly partial
    lengths = t.frame["hash_ids"].list.len().to_numpy()
    assert (lengths == np.ceil(t.frame["input_length"].to_numpy() / 512)).all()
    assert t.tokens == int(t.frame["input_length"].sum())
    assert t.distinct_blocks == 43924
    assert t.tokens == 61_194_628  # the prompt tokens the Mooncake check's 65.04% is a share of
    assert repr(t) == "Trace(3993 requests, 61.2M tokens, 43.9k distinct blocks, block_size=512)"
    assert "3,993 requests" in t._repr_html_()


def test_locate_honours_KVLAB_TRACES(tmp_path, monkeypatch):
    write_lines(tmp_path / "mine.jsonl", [GOOD])
    monkeypatch.setenv("KVLAB_TRACES", str(tmp_path))
    assert kv.traces.locate("mine.jsonl") == tmp_path / "mine.jsonl"
    with pytest.raises(TraceError, match="not found; looked in .*KVLAB_TRACES"):
        kv.traces.locate("absent.jsonl")


def test_block_arrays_and_token_blocks(tmp_path):
    t = kv.traces.read(write_lines(tmp_path / "t.jsonl", [GOOD, {**GOOD, "hash_ids": [0, 2, 3]}]))
    flat, offsets = t.block_arrays()
    assert flat.tolist() == [0, 1, 0, 2, 3] and offsets.tolist() == [0, 2, 5]
    assert [b.tolist() for b in t.to_token_blocks()] == [[0, 1], [0, 2, 3]]
    assert flat.dtype == np.int64


@pytest.mark.parametrize("line, lineno, match", [
    ("{not json", 2, "not valid JSON"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}), 2, "missing field 'hash_ids'"),
    (json.dumps({**GOOD, "input_length": "600"}), 2, "'input_length' must be an integer"),
    (json.dumps({**GOOD, "hash_ids": [0, "x"]}), 2, "'hash_ids' must be a list of integers"),
    (json.dumps({**GOOD, "input_length": 0}), 2, "'input_length' must be >= 1"),
    (json.dumps({**GOOD, "hash_ids": [0, -1]}), 2, "'hash_ids' must be a list of integers >= 0"),
    ("[1, 2]", 2, "expected a JSON object"),
])
def test_malformed_lines_name_line_and_field(tmp_path, line, lineno, match):
    path = write_lines(tmp_path / "bad.jsonl", [GOOD, line, GOOD])
    with pytest.raises(TraceError, match=match) as e:
        kv.traces.read(path)
    assert f"bad.jsonl:{lineno}:" in str(e.value)


def test_missing_file_and_bad_block_size(tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        kv.traces.read(tmp_path / "nope.jsonl")
    with pytest.raises(BlockSizeError, match="positive int"):
        kv.traces.read(write_lines(tmp_path / "t.jsonl", [GOOD]), block_size=0)


def test_from_requests_chains_and_remaps_in_order_of_first_appearance():
    a = list(range(40))
    b = list(range(32)) + [99] * 8          # shares 2 full blocks with a, then differs
    c = [5] * 16 + list(range(16, 40))      # block 1 equals a's block 1 but follows another block
    t = kv.traces.from_requests([a, b, c, a], [1, 2, 3, 4], block_size=16)
    ids = t.frame["hash_ids"].to_list()
    assert ids[0] == [0, 1, 2]              # two full blocks and a partial one (Mooncake)
    assert ids[1] == [0, 1, 3]
    assert ids[2] == [4, 5, 6]              # chained: equal tokens after a different prefix differ
    assert ids[3] == ids[0]
    assert t.frame["input_length"].to_list() == [40, 40, 40, 40]
    assert t.frame["output_length"].to_list() == [1, 2, 3, 4]
    assert t.frame["timestamp"].to_list() == [0, 1, 2, 3]
    assert t.block_size == 16
    # a partial block never equals the full block with the same leading tokens
    t2 = kv.traces.from_requests([list(range(20)), list(range(32))], 0, block_size=16)
    assert t2.frame["hash_ids"].to_list() == [[0, 1], [0, 2]]


def test_from_requests_keys_and_validation():
    same = [list(range(32))] * 3
    t = kv.traces.from_requests(same, 0, block_size=16, keys=["a", "b", "a"])
    assert t.frame["hash_ids"].to_list() == [[0, 1], [2, 3], [0, 1]]
    with pytest.raises(TraceError, match="3 requests but 2 output lengths"):
        kv.traces.from_requests(same, [1, 2], block_size=16)
    with pytest.raises(TraceError, match="request 1 has no tokens"):
        kv.traces.from_requests([[1], []], 0)
    with pytest.raises(BlockSizeError):
        kv.traces.from_requests(same, 0, block_size=-1)


def test_from_requests_uses_the_project_block_hashes():
    ids = list(range(48))
    hashes = chained_hashes(ids, 16, partial=False)
    assert hashes == kv.block_hashes(ids, 16)


def test_write_is_atomic_and_round_trips(tmp_path):
    t = kv.traces.from_requests([list(range(1000)), list(range(700))], [7, 8], timestamps=[10, 25])
    path = tmp_path / "sub" / "trace.jsonl"
    assert t.write(path) == path
    t.write(path)  # overwrite in place
    assert [p.name for p in path.parent.iterdir()] == ["trace.jsonl"]  # no temporary left behind
    back = kv.traces.read(path)
    assert back.frame.equals(t.frame)
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"timestamp": 10, "input_length": 1000, "output_length": 7, "hash_ids": [0, 1]}


def test_repeat_shifts_ids_and_times():
    t = kv.traces.from_requests([list(range(40))], 1, block_size=16, timestamps=[5])
    r = t.repeat(3)
    assert r.frame["hash_ids"].to_list() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert r.frame["timestamp"].to_list() == [5, 11, 17]
    assert t.repeat(2, shift_ids=False).frame["hash_ids"].to_list() == [[0, 1, 2]] * 2
    with pytest.raises(TraceError):
        t.repeat(0)


def test_from_workload_exports_token_id_workloads():
    wl = kv.workloads.prefix_repetition(prefix_len=32, suffix_len=16, num_prompts=4, num_prefixes=2,
                                        output_len=9)
    t = kv.traces.from_workload(wl, block_size=16)
    assert len(t) == 4 and t.frame["output_length"].to_list() == [9] * 4
    assert (t.frame["hash_ids"].list.len() == 3).all()
    firsts = t.frame["hash_ids"].list.first().to_list()
    assert len(set(firsts)) == 2  # two prefixes
    assert t.source == "workload:prefix_repetition"


def test_large_trace_reads_lazily(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(20_000):
            n = int(rng.integers(1, 5000))
            f.write(json.dumps({"timestamp": i, "input_length": n, "output_length": 1,
                                "hash_ids": list(range(math.ceil(n / 512)))}) + "\n")
    t = kv.traces.read(path)
    assert len(t) == 20_000 and t.distinct_blocks <= 10
