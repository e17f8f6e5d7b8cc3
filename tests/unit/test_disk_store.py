"""DiskStore on synthetic snapshots (each token's KV is its own id): what it serves, the budget and
its eviction order, restarts, corrupt files, a writer killed mid-write, paged blocks."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from tier_helpers import FP, OTHER_FP, ids_in, key_of, seq, snap_of

import kvlab as kv
from kvlab.errors import BlockSizeError, BudgetError, SnapshotError
from kvlab.stores.disk import CorruptFileWarning, DiskStore

ROOT = Path(__file__).resolve().parents[2]


def files(d: DiskStore) -> list[Path]:
    return sorted(d.folder.glob("*.safetensors"))


def test_serves_prefixes_lcp_and_the_identical_prompt_trimmed(tmp_path):
    d = DiskStore(tmp_path, model=FP)
    a = seq(100, 40)
    d.put(key_of(a), snap_of(a))
    assert [p.name for p in files(d)] == [f"{key_of(a).digest()}.safetensors"]
    assert d.files_frame()["tokens"].to_list() == [40] and d.entries == 1
    assert d.nbytes == files(d)[0].stat().st_size
    m = d.lookup(key_of(a + [7, 8]), None, limit=41)  # a is a prefix of the request
    assert (m.kind, m.tokens, m.entry_tokens) == ("prefix", 40, 40) and ids_in(m.snapshot) == tuple(a)
    m = d.lookup(key_of(a), None, limit=39)  # the same prompt: its last token is recomputed
    assert (m.kind, m.tokens, m.snapshot.offset) == ("exact", 39, 40)
    m = d.lookup(key_of(a[:30] + [5, 6, 7]), None, limit=32)  # shares 30 tokens
    assert (m.kind, m.tokens, m.entry_tokens) == ("lcp", 30, 40) and ids_in(m.snapshot) == tuple(a)
    m = d.lookup(key_of(a[:25]), None, limit=24)
    assert (m.kind, m.tokens) == ("supersequence", 24)
    assert d.lookup(key_of(seq(900, 20)), None, limit=19).kind == "miss"
    assert d.hits == 4


def test_a_namespace_is_served_only_as_a_whole_prefix(tmp_path):
    d = DiskStore(tmp_path, model=FP)
    a = seq(100, 40)
    d.put(key_of(a, salt="alice"), snap_of(a))
    assert d.lookup(key_of(a + [1], salt="alice"), None, limit=40).tokens == 40
    assert d.lookup(key_of(a + [1], salt="bob"), None, limit=40).kind == "miss"
    assert d.lookup(key_of(a + [1]), None, limit=40).kind == "miss"
    assert d.lookup(key_of(a[:30] + [1], salt="alice"), None, limit=30).kind == "miss"  # no lcp
    # a plain entry is never served to a salted request
    d.put(key_of(seq(500, 20)), snap_of(seq(500, 20)))
    assert d.lookup(key_of(seq(500, 21), salt="alice"), None, limit=20).kind == "miss"


def test_restart_rebuilds_the_index_from_the_files(tmp_path):
    d = DiskStore(tmp_path, 1 << 30, model=FP)
    for start in (100, 200, 300):
        d.put(key_of(seq(start, 32)), snap_of(seq(start, 32)))
    again = DiskStore(tmp_path, 1 << 30, model=FP)
    assert again.files_frame().drop("hits").equals(d.files_frame().drop("hits"))
    m = again.lookup(key_of(seq(200, 40)), None, limit=39)
    assert m.tokens == 32 and ids_in(m.snapshot) == tuple(seq(200, 32))
    # another model's store under the same path sees none of them
    assert DiskStore(tmp_path, model=OTHER_FP).entries == 0


def test_a_store_must_know_its_model_so_a_second_process_finds_the_first_ones_files(tmp_path):
    # Before: DiskStore(path) without model= bound on its first insert, so a second process's
    # store saw none of the first one's files and its lookups missed, silently.
    with pytest.raises(SnapshotError, match=r"needs model=.*m\.fingerprint") as refused:
        DiskStore(tmp_path, 1 << 30)
    assert str(tmp_path) in str(refused.value)
    with pytest.raises(SnapshotError, match="needs model="):
        kv.stores.make_store("disk", disk_path=tmp_path, budget_bytes=1 << 30)
    assert list(tmp_path.iterdir()) == []  # refused before touching the folder
    first = DiskStore(tmp_path, 1 << 30, model=FP)
    a, b = seq(100, 40), seq(500, 24)
    first.put(key_of(a), snap_of(a))
    first.put(key_of(b, salt="alice"), snap_of(b))
    second = DiskStore(tmp_path, 1 << 30, model=FP)  # a fresh store, as in a new process
    assert second.entries == 2 and second.nbytes == sum(p.stat().st_size for p in files(second))
    m = second.lookup(key_of(a + [1, 2]), None, limit=41)  # its very first lookup is served
    assert (m.kind, m.tokens) == ("prefix", 40) and ids_in(m.snapshot) == tuple(a)
    m = second.lookup(key_of(b + [3], salt="alice"), None, limit=24)
    assert (m.kind, m.tokens) == ("prefix", 24) and ids_in(m.snapshot) == tuple(b)


def test_budget_evicts_the_least_recently_used_file_and_survives_restart(tmp_path):
    one = DiskStore(tmp_path / "probe", model=FP)
    one.put(key_of(seq(600, 32)), snap_of(seq(600, 32)))
    size = one.nbytes  # every file below has the same size (ids of three digits)
    d = DiskStore(tmp_path / "d", 3 * size, model=FP)
    a, b, c, e, f = (seq(s, 32) for s in (100, 200, 300, 400, 500))
    for x in (a, b, c):
        d.put(key_of(x), snap_of(x))
        time.sleep(0.002)
    assert d.lookup(key_of(a + [1]), None, limit=32).tokens == 32  # a is now the most recent
    d.drain_events()
    d.put(key_of(e), snap_of(e))
    ev = [x for x in d.drain_events() if x.event == "evict"]
    assert [(x.entry, x.capacity, x.reason, x.tier) for x in ev] == [(key_of(b).digest(), True, "lru", "disk")]
    assert d.nbytes == 3 * size <= d.budget_bytes and d.evictions == 1
    # the order is in the files' mtimes: a new process evicts c next, not a
    again = DiskStore(tmp_path / "d", 3 * size, model=FP)
    again.put(key_of(f), snap_of(f))
    assert [x.entry for x in again.drain_events() if x.event == "evict"] == [key_of(c).digest()]
    assert {p.name.split(".")[0] for p in files(again)} == {key_of(x).digest() for x in (a, e, f)}


def a_prompt_and_its_head(path):
    """A store's files for a 40-token prompt and its first 20 tokens: the ids, the longer file."""
    d = DiskStore(path, model=FP)
    a = seq(100, 40)
    d.put(key_of(a), snap_of(a))
    d.put(key_of(a[:20]), snap_of(a[:20]))
    return a, d.folder / f"{key_of(a).digest()}.safetensors"


def test_a_truncated_file_is_reported_moved_aside_and_never_used(tmp_path):
    a, p = a_prompt_and_its_head(tmp_path)
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.warns(CorruptFileWarning, match=str(p)):
        again = DiskStore(tmp_path, model=FP)
    ev = again.drain_events()
    assert [(x.event, x.entry, x.tier) for x in ev] == [("corrupt", key_of(a).digest(), "disk")]
    assert "truncated" in ev[0].reason and again.corrupt == 1
    assert not p.exists() and p.with_name(p.name + ".corrupt").exists()
    m = again.lookup(key_of(a + [1]), None, limit=40)  # the shorter, sound file serves
    assert m.tokens == 20 and ids_in(m.snapshot) == tuple(a[:20])
    assert DiskStore(tmp_path, model=FP).corrupt == 0  # reported once: it stays aside


def test_a_flipped_byte_fails_its_digest_on_load_and_the_lookup_falls_back(tmp_path):
    a, p = a_prompt_and_its_head(tmp_path)
    data = bytearray(p.read_bytes())
    data[-9] ^= 0x40  # inside the last array: the header still checks out
    p.write_bytes(bytes(data))
    again = DiskStore(tmp_path, model=FP)
    assert again.entries == 2 and again.corrupt == 0
    with pytest.warns(CorruptFileWarning, match="digest"):
        m = again.lookup(key_of(a + [1]), None, limit=40)
    assert m.tokens == 20 and ids_in(m.snapshot) == tuple(a[:20])
    assert [x.event for x in again.drain_events()] == ["corrupt"] and again.entries == 1
    assert p.with_name(p.name + ".corrupt").exists()


def test_a_file_from_another_model_in_the_folder_is_corrupt(tmp_path):
    other = DiskStore(tmp_path / "o", model=OTHER_FP)
    other.put(key_of(seq(1, 20)), snap_of(seq(1, 20), fp=OTHER_FP))
    d = DiskStore(tmp_path, model=FP)
    (d.folder / files(other)[0].name).write_bytes(files(other)[0].read_bytes())
    with pytest.warns(CorruptFileWarning, match="made by model eeeeeeeeeeee"):
        d.rebuild()
    assert d.entries == 0 and d.corrupt == 1


def test_temp_files_of_killed_writers(tmp_path):
    d = DiskStore(tmp_path, model=FP)
    fresh, stale = d.folder / ".kvlab-fresh.safetensors", d.folder / ".kvlab-stale.safetensors"
    fresh.write_bytes(b"partial")
    stale.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    d.rebuild()
    assert d.entries == 0 and d.corrupt == 0
    assert fresh.exists() and not stale.exists()  # a fresh one may be another process writing


def test_paged_blocks_chain_and_tail_first_eviction(tmp_path):
    d = DiskStore(tmp_path, model=FP, block_size=16)
    a = seq(100, 50)
    assert d.put(key_of(a), snap_of(a)) > 0
    hashes = [h.hex() for h in key_of(a).block_hashes(16)]
    frame = d.files_frame()  # sorted oldest first: the tail is evicted first
    assert frame["name"].to_list() == hashes[::-1] and frame["tokens"].to_list() == [16] * 3
    assert DiskStore(tmp_path, model=FP, block_size=16).files_frame()["name"].to_list() == hashes[::-1]
    m = d.lookup(key_of(a), None, limit=49)
    assert (m.kind, m.tokens) == ("prefix", 48) and ids_in(m.snapshot) == tuple(a[:48])
    m = d.lookup(key_of(a[:20] + seq(900, 30)), None, limit=49)
    assert m.tokens == 16 and ids_in(m.snapshot) == tuple(a[:16])
    assert d.lookup(key_of(a), None, limit=15).kind == "miss"
    blocks = d.load_blocks(key_of(a), 49, start=1)
    assert [ids_in(b) for b in blocks] == [tuple(a[16:32]), tuple(a[32:48])]
    with pytest.raises(BlockSizeError):
        d.put_block("ab", snap_of(seq(1, 8)))


def test_bad_input_is_refused_with_kvlab_errors(tmp_path):
    with pytest.raises(BudgetError):
        DiskStore(tmp_path, 0)
    with pytest.raises(BlockSizeError):
        DiskStore(tmp_path, block_size=0)
    with pytest.raises(SnapshotError, match="model fingerprint"):
        DiskStore(tmp_path, model=12)
    d = DiskStore(tmp_path, model=FP)
    with pytest.raises(SnapshotError, match="kv.snapshot"):
        d.put(key_of(seq(1, 8)), snap_of(seq(1, 8), fp=None))
    d.put(key_of(seq(1, 8)), snap_of(seq(1, 8)))
    with pytest.raises(SnapshotError, match="one DiskStore"):
        d.put(key_of(seq(1, 8)), snap_of(seq(1, 8), fp=OTHER_FP))
    with pytest.raises(SnapshotError, match="token ids"):
        d.put(key_of(seq(2, 8)), snap_of(seq(1, 8)))
    with pytest.raises(BudgetError, match="raise budget_bytes"):
        DiskStore(tmp_path / "small", 1000, model=FP).put(key_of(seq(1, 64)), snap_of(seq(1, 64)))
    assert list((tmp_path / "small").rglob("*.safetensors")) == []


WRITER = """
import sys
from tier_helpers import FP, key_of, seq, snap_of
from kvlab.stores.disk import DiskStore
d = DiskStore(sys.argv[1], model=FP)
base = int(sys.argv[2])
for i in range(10**6):
    ids = seq(base + i * 600, 512)
    d.put(key_of(ids), snap_of(ids, width=64))
"""


def test_killing_a_writer_mid_write_never_leaves_a_file_that_loads_wrong(tmp_path):
    folder = tmp_path / "kv"
    sub = folder / FP[:16] / "entries"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests" / "unit")]))
    rng = random.Random(0)
    for child in range(8):
        before = len(list(sub.glob("*.safetensors")))
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(folder), str(child * 200_000)], env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and \
                len(list(sub.glob("*.safetensors"))) < before + 2:  # this child is in its write loop
            time.sleep(0.001)
        time.sleep(rng.uniform(0, 0.2))  # somewhere in the write loop: often inside a write
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    temps = list(sub.glob(".kvlab-*"))
    assert temps, "no kill landed inside a write"  # each such kill leaves kv.save's temp file
    with warnings.catch_warnings():
        warnings.simplefilter("error", CorruptFileWarning)
        d = DiskStore(folder, model=FP)
    assert d.corrupt == 0 and d.entries >= 16
    assert not list(sub.glob("*.corrupt"))  # nor did any writer find a bad file when it started
    for name in d.files_frame()["name"]:
        snap = d.load(d.get(name), None)
        assert snap is not None and len(ids_in(snap)) == 512
        assert key_of(ids_in(snap)).digest() == name  # the file holds exactly the KV its name says


def test_a_file_under_another_keys_name_is_never_served(tmp_path):
    d = DiskStore(tmp_path, model=FP)
    a, b = seq(100, 40), seq(500, 40)
    d.put(key_of(a), snap_of(a))
    src = d.folder / f"{key_of(a).digest()}.safetensors"
    (d.folder / f"{key_of(b).digest()}.safetensors").write_bytes(src.read_bytes())  # sound file, wrong name
    again = DiskStore(tmp_path, model=FP)
    assert again.entries == 2 and again.corrupt == 0  # its header is fine
    with pytest.warns(CorruptFileWarning, match="token ids differ"):
        m = again.lookup(key_of(b + [1]), None, limit=40)
    assert m.kind == "miss" and again.entries == 1


def test_blocks_cut_and_join_any_keys_values_layout():
    import mlx.core as mx
    import numpy as np

    from kvlab.errors import SnapshotError as SnapErr
    from kvlab.primitives.snapshots import LayerState, Snapshot
    from kvlab.stores.disk_files import concat_blocks, cut_block

    # a quantized-style layer: keys and values are (packed words, scales, biases), token axis -2,
    # with (group size, bits) after the offset
    arrays = [mx.arange(32 * w).reshape(1, 2, 16, w).astype(mx.float32) for w in (8, 2, 2, 8, 2, 2)]
    layer = LayerState("QuantizedKVCache", (tuple(arrays[:3]), tuple(arrays[3:]), 16, 64, 4), 16, 0)
    snap = Snapshot((layer,), 16, tuple(range(16)), FP)
    blocks = [cut_block(snap, i, 8, range(i * 8, i * 8 + 8)) for i in (0, 1)]
    assert blocks[1].layers[0].state[2:] == (8, 64, 4) and blocks[1].token_ids == tuple(range(8, 16))
    joined = concat_blocks(blocks, range(16)).layers[0]
    assert joined.kind == "QuantizedKVCache" and joined.state[2:] == (16, 64, 4)
    got = [a for part in joined.state[:2] for a in part]
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(got, arrays))
    assert joined.nbytes == sum(a.nbytes for a in arrays)
    with pytest.raises(SnapErr, match="different formats"):
        concat_blocks([blocks[0], snap_of(seq(1, 8), layers=1)], range(16))
