"""TieredStore on synthetic snapshots (each token's KV is its own id): demotion on RAM eviction,
promotion on a disk hit, which tier served each hit, flush and write-through, restarts."""

from __future__ import annotations

import polars as pl
import pytest
from tier_helpers import FP, ids_in, key_of, seq, snap_of

import kvlab as kv
from kvlab.errors import BlockSizeError, KvlabError
from kvlab.stores import make_store
from kvlab.stores.disk import DiskStore
from kvlab.stores.tiered import TieredStore, hits_by_tier

ENTRY = snap_of(seq(100, 32)).nbytes  # every entry below: 32 tokens


def radix_tier(path, entries=1, **kw):
    return TieredStore(kv.RadixStore(entries * ENTRY), DiskStore(path, model=FP), **kw)


def paged_tier(path, blocks=2, **kw):
    per_block = snap_of(seq(1, 16)).nbytes
    return TieredStore(kv.PagedStore(16, budget_bytes=blocks * per_block), DiskStore(path, model=FP, block_size=16), **kw)


def test_radix_eviction_demotes_to_disk_and_a_disk_hit_promotes(tmp_path):
    t = radix_tier(tmp_path)
    a, b = seq(100, 32), seq(200, 32)
    t.insert(key_of(a), None, snap_of(a))
    t.insert(key_of(b), None, snap_of(b))  # RAM holds one entry: a is demoted
    ev = t.drain_events()
    assert [(e.event, e.tier) for e in ev] == [("insert", "ram"), ("insert", "ram"), ("demote", "disk"),
                                                ("evict", "ram")]
    assert ev[2].entry == key_of(a).digest() and ev[2].nbytes == t.disk.nbytes > ENTRY
    assert ev[3].capacity and t.disk.entries == 1 and t.ram.entries == 1

    m = t.lookup(key_of(a + [7]), None, limit=32)  # from disk, then into RAM (b goes down)
    assert (m.kind, m.tokens) == ("prefix", 32) and ids_in(m.snapshot) == tuple(a)
    ev = t.drain_events()
    assert [(e.event, e.detail) for e in ev] == [("promote", "ram"), ("insert", "promoted"), ("demote", "disk"),
                                                 ("evict", "lru"), ("tier_hit", "disk")]
    assert t.ram.contains(key_of(a)) and not t.ram.contains(key_of(b)) and t.disk.entries == 2
    m = t.lookup(key_of(a + [8]), None, limit=32)  # now from RAM
    assert m.tokens == 32 and [e.detail for e in t.drain_events()] == ["ram"]
    m = t.lookup(key_of(b + [1, 2]), None, limit=33)
    assert m.tokens == 32 and ids_in(m.snapshot) == tuple(b)
    s = t.stats()
    assert (s["hits_ram"], s["hits_disk"], s["tokens_ram"], s["tokens_disk"]) == (1, 2, 32, 64)
    assert s["tokens_read_from_disk"] == 64
    assert s["hits"] == 3 and s["tokens"] == 96 and s["lookups"] == 3
    assert (s["promotions"], s["demotions"]) == (2, 3)


def test_an_lcp_hit_from_disk_is_promoted_under_the_entrys_own_key(tmp_path):
    t = radix_tier(tmp_path)
    a = seq(100, 32)
    t.insert(key_of(a), None, snap_of(a))
    t.insert(key_of(seq(300, 32)), None, snap_of(seq(300, 32)))
    req = a[:20] + seq(900, 12)
    m = t.lookup(key_of(req), None, limit=31)
    assert (m.kind, m.tokens, m.snapshot.offset) == ("lcp", 20, 32) and ids_in(m.snapshot) == tuple(a)
    # the KV is a's: under the request's key it would serve a's tokens for the request's
    assert t.ram.contains(key_of(a)) and not t.ram.contains(key_of(req))


def test_paged_tier_extends_ram_blocks_with_disk_blocks(tmp_path):
    t = paged_tier(tmp_path, blocks=4)
    a = seq(100, 64)  # 4 blocks, all of RAM
    c = a[:32] + seq(500, 32)  # shares a's first two blocks: a's last two are evicted for c's
    t.insert(key_of(a), None, snap_of(a))
    t.insert(key_of(c), None, snap_of(c))
    hashes = [h.hex() for h in key_of(a).block_hashes(16)]
    demoted = [e.entry for e in t.drain_events() if e.event == "demote"]
    assert demoted == hashes[2:][::-1]  # freed tail first, so the tail is evicted first
    assert sorted(t.disk.files_frame()["name"]) == sorted(hashes[2:])
    m = t.lookup(key_of(a + [1]), None, limit=64)  # blocks 0-1 from RAM, 2-3 from disk
    assert (m.kind, m.tokens) == ("prefix", 64) and ids_in(m.snapshot) == tuple(a)
    ev = [e for e in t.drain_events() if e.event == "tier_hit"]
    assert [(e.detail, e.tokens) for e in ev] == [("disk", 64)]
    s = t.stats()
    assert (s["hits_disk"], s["tokens_disk"], s["tokens_read_from_disk"], s["promotions"]) == (1, 64, 32, 1)
    m = t.lookup(key_of(a + [2]), None, limit=64)  # promoted: all of it from RAM now
    assert m.tokens == 64 and ids_in(m.snapshot) == tuple(a) and t.stats()["hits_ram"] == 1


def test_hits_per_tier_sum_to_the_hits_and_the_frame_agrees(tmp_path):
    t = radix_tier(tmp_path, entries=2)
    prompts = [seq(s, 32) for s in (100, 200, 300, 400)]
    rows, served = [], 0
    for rnd in range(3):
        for p in prompts:
            m = t.lookup(key_of(p + [rnd]), None, limit=32)
            served += m.tokens
            rows += [{"event": e.event, "tokens": e.tokens, "detail": e.detail} for e in t.drain_events()]
            t.insert(key_of(p), None, snap_of(p))
    s = t.stats()
    assert s["hits_ram"] + s["hits_disk"] == s["hits"] == 8 and s["tokens"] == served == 8 * 32
    assert s["hits_disk"] > 0 and s["lookups"] == 12
    frame = hits_by_tier(pl.DataFrame(rows))
    assert frame.rows() == [("ram", s["hits_ram"], s["tokens_ram"]), ("disk", s["hits_disk"], s["tokens_disk"])]


@pytest.mark.parametrize("make", [radix_tier, paged_tier])
def test_flush_persists_ram_and_a_new_tier_serves_it_from_disk(tmp_path, make):
    t = make(tmp_path, 4)
    a = seq(100, 32)
    t.insert(key_of(a), None, snap_of(a))
    assert t.disk.entries == 0
    with t:
        pass  # close() flushes
    assert t.disk.entries == (1 if make is radix_tier else 2)
    assert [e.event for e in t.drain_events()][-1] == "persist"
    assert t.flush() == 0  # nothing new
    again = make(tmp_path, 4)
    m = again.lookup(key_of(a + [1]), None, limit=32)
    assert m.tokens == 32 and ids_in(m.snapshot) == tuple(a) and again.stats()["hits_disk"] == 1


def test_write_through_writes_every_insert(tmp_path):
    t = radix_tier(tmp_path, 4, write_through=True)
    t.insert(key_of(seq(100, 32)), None, snap_of(seq(100, 32)))
    assert t.disk.entries == 1 and t.stats()["persisted"] == 1


def test_what_cannot_be_tiered_is_refused(tmp_path):
    with pytest.raises(KvlabError, match="hands over what it evicts"):
        TieredStore(kv.SystemPromptStore(), DiskStore(tmp_path, model=FP))
    with pytest.raises(BlockSizeError, match="block_size=16"):
        TieredStore(kv.PagedStore(16), DiskStore(tmp_path, model=FP))
    with pytest.raises(BlockSizeError, match="None"):
        TieredStore(kv.RadixStore(), DiskStore(tmp_path, model=FP, block_size=16))
    ram = kv.RadixStore()
    TieredStore(ram, DiskStore(tmp_path, model=FP))
    with pytest.raises(KvlabError, match="already"):
        TieredStore(ram, DiskStore(tmp_path, model=FP))
    with pytest.raises(KvlabError, match="disk_path"):
        make_store("tiered")
    with pytest.raises(KvlabError, match="'radix' or 'paged' RAM store"):
        make_store("tiered", disk_path=tmp_path, ram="system")


def test_make_store_builds_the_tiers(tmp_path):
    t = make_store("tiered", budget_bytes=1 << 20, disk_path=tmp_path, disk_budget_bytes=1 << 22, model=FP)
    assert isinstance(t.ram, kv.RadixStore) and t.disk.budget_bytes == 1 << 22 and t.disk.fingerprint == FP
    p = make_store("tiered", disk_path=tmp_path, model=FP, ram="paged", block_size=32)
    assert p.ram.block_size == p.disk.block_size == 32
    d = make_store("disk", disk_path=tmp_path, budget_bytes=1 << 22, model=FP)
    assert isinstance(d, kv.DiskStore) and d.block_size is None and d.budget_bytes == 1 << 22
    assert "disk" in kv.stores.STORE_NAMES and "tiered" in kv.stores.STORE_NAMES
    assert repr(t).startswith("TieredStore(ram=radix 0 entries") and "<b>TieredStore</b>" in t._repr_html_()
    assert repr(d).startswith("DiskStore(") and "<b>DiskStore</b>" in d._repr_html_()
