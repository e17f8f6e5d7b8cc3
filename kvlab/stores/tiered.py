"""TieredStore: a RAM store in front of a DiskStore. RAM evictions are demoted to disk, disk hits
promoted back to RAM, and every hit says which tier served it.

The RAM store (RadixStore: whole entries; PagedStore: blocks, with a DiskStore of the same
``block_size``) hands over what it evicts for room through its ``on_evict`` callback, before it
drops it; the tier writes it to disk (``demote``). A lookup asks RAM first, then the disk for
more: a radix tier serves the longer of the two; a paged tier extends RAM's leading blocks with
the disk's next ones. What the disk served is inserted into RAM (``promote``).

Events (drained by the Engine, detail column in brackets): ``tier_hit`` [ram|disk] once per lookup
that serves tokens, with the tokens served (``disk`` when any of them came from disk);
``promote`` [ram], ``demote`` [disk] (or the reason it was skipped), ``persist`` [disk]
(``flush``/write-through), and the tiers' own events (``evict``, ``corrupt``) stamped with
``tier``. ``stats()`` counts the same: hits per tier sum to the hits.

``write_through=False`` (default) writes on eviction and on ``flush()``/``close()`` (call it before
the process ends, or use ``with``); ``write_through=True`` writes every insert at once, so a killed
process leaves its cache behind too.

Example:
    >>> store = kv.TieredStore(kv.RadixStore(64 << 20), kv.DiskStore("kv-cache", 1 << 30, model=m))
    >>> engine = kv.Engine(m, store)
    >>> store.stats()["hits_disk"]
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import polars as pl

from ..errors import BlockSizeError, BudgetError, KvlabError
from ..keys import CacheKey
from ..primitives.display import summary_html, table_html
from ..primitives.snapshots import Snapshot
from ..primitives.tokens import Tokens
from ..primitives.units import fmt_bytes
from .base import Capabilities, EventLog, Match, StoreBase
from .disk import DiskStore
from .disk_files import concat_blocks
from .paged import PagedStore
from .radix import RadixStore

TIERS = ("ram", "disk")
MAX_FLUSH_KEYS = 4096  # paged tiers remember this many recent keys to find their blocks on flush


class TieredStore(StoreBase):
    """``ram`` (a RadixStore or PagedStore) in front of ``disk`` (a DiskStore); see module docstring."""

    name = "tiered"

    def __init__(self, ram, disk: DiskStore, *, write_through: bool = False):
        if not isinstance(ram, (RadixStore, PagedStore)):
            raise KvlabError(f"TieredStore needs a RAM store that hands over what it evicts "
                             f"(RadixStore or PagedStore), not {type(ram).__name__}")
        if ram.on_evict is not None:
            raise KvlabError("this RAM store already hands its evictions to someone (another "
                             "TieredStore?); give each TieredStore its own RAM store")
        if not isinstance(disk, DiskStore):
            raise KvlabError(f"TieredStore's second tier must be a kv.DiskStore, not {type(disk).__name__}")
        self.block_size = ram.capabilities.block_size
        if disk.block_size != self.block_size:
            want = "None (whole entries)" if self.block_size is None else self.block_size
            raise BlockSizeError(f"a {ram.name} RAM store needs a DiskStore with block_size={want}, "
                                 f"got block_size={disk.block_size}")
        self.ram, self.disk, self.write_through = ram, disk, write_through
        ram.on_evict = self._demote
        self.log = EventLog()
        self._keys: dict[str, tuple[CacheKey, Snapshot]] = {}  # radix: RAM entry id -> its key, snapshot
        self._recent: OrderedDict[str, CacheKey] = OrderedDict()  # paged: keys inserted, for flush
        self._current: CacheKey | None = None  # the key of the RAM insert in progress
        self.counts = dict.fromkeys(("lookups", "hits_ram", "hits_disk", "tokens_ram", "tokens_disk",
                                     "tokens_read_from_disk", "promotions", "demotions", "persisted"), 0)

    # -- the Store protocol -----------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes in RAM (the disk's are ``disk.nbytes``)."""
        return self.ram.nbytes

    @property
    def entries(self) -> int:
        """Entries (or blocks) in RAM (the disk's are ``disk.entries``)."""
        return self.ram.entries

    @property
    def capabilities(self) -> Capabilities:
        ram = self.ram.capabilities
        return replace(ram, tiers=("ram", "disk"))

    def lookup(self, key: CacheKey, tokens: Tokens, *, limit: int) -> Match:
        self.counts["lookups"] += 1
        m = self.ram.lookup(key, tokens, limit=limit)
        if self.block_size is None:
            d = self.disk.best(key, limit, longer_than=m.tokens)
            if d.tokens <= m.tokens:
                return self._served(m, 0, m.entry_id)
            # an lcp/supersequence entry holds other tokens after the shared ones: its own key
            own = key.prefix(d.entry_tokens) if d.kind in ("prefix", "exact") else CacheKey(d.snapshot.token_ids)
            self._promote(own, tokens, d.snapshot)
            return self._served(d, d.tokens, own.digest())
        k = m.tokens // self.block_size
        extra = self.disk.load_blocks(key, limit, start=k)
        if not extra:
            return self._served(m, 0, m.entry_id)
        n = (k + len(extra)) * self.block_size
        pieces = ([m.snapshot] if k else []) + extra
        snap = concat_blocks(pieces, key.ids[:n])
        self._promote(key.prefix(n), tokens, snap)
        return self._served(Match("prefix", n, snap, n), n - m.tokens, key.block_hashes(self.block_size, n)[-1].hex())

    def insert(self, key: CacheKey, tokens: Tokens, snap: Snapshot, *, kind: str = "prompt") -> None:
        self._ram_insert(key, tokens, snap, kind)
        if self.block_size is not None:
            name = key.digest(snap.offset)
            self._recent[name] = key.prefix(snap.offset)
            self._recent.move_to_end(name)
            while len(self._recent) > MAX_FLUSH_KEYS:
                self._recent.popitem(last=False)
        if self.write_through:
            self._persist(key.prefix(snap.offset), snap)

    def drain_events(self):
        self._forward()
        return sorted(self.log.drain(), key=lambda ev: ev.t)

    # -- moving between tiers ---------------------------------------------------------------------
    def _served(self, m: Match, from_disk: int, entry) -> Match:
        if m.tokens > 0:
            tier = "disk" if from_disk else "ram"
            self.counts[f"hits_{tier}"] += 1
            self.counts[f"tokens_{tier}"] += m.tokens
            self.counts["tokens_read_from_disk"] += from_disk
            self.log.add("tier_hit", tokens=m.tokens, entry=entry, tier=tier)
        return m

    def _ram_insert(self, key: CacheKey, tokens, snap: Snapshot, kind: str) -> None:
        self._current = key
        try:
            self.ram.insert(key, tokens, snap, kind=kind)
            self._forward(snap)
        finally:
            self._current = None

    def _promote(self, key: CacheKey, tokens, snap: Snapshot) -> None:
        if snap.nbytes > self.ram.budget_bytes:
            self.log.add("promote", tokens=snap.offset, reason="larger than the RAM budget", tier="ram")
            return
        if self.block_size is not None and isinstance(self.ram, PagedStore) and self.ram.num_blocks is not None \
                and snap.offset // self.block_size > self.ram.num_blocks:
            self.log.add("promote", tokens=snap.offset, reason="more blocks than the RAM pool", tier="ram")
            return
        self.counts["promotions"] += 1
        self.log.add("promote", tokens=snap.offset, nbytes=snap.nbytes, tier="ram")
        self._ram_insert(key, tokens, snap, "promoted")

    def _demote(self, entry: str, snap: Snapshot) -> None:
        """The RAM store's on_evict: write what it is about to drop to disk."""
        if self.block_size is not None:
            self._write("demote", lambda: self.disk.put_block(entry, snap), snap, entry)
            return
        key = self._keys.pop(entry, (None, None))[0]
        if key is None:
            self.log.add("demote", tokens=snap.offset, entry=entry, tier="disk",
                         reason="skipped: inserted into the RAM store around the tier, key unknown")
            return
        self._write("demote", lambda: self.disk.put(key, snap, kind="demoted"), snap, key.digest(snap.offset))

    def _persist(self, key: CacheKey, snap: Snapshot) -> None:
        self._write("persist", lambda: self.disk.put(key, snap, kind="persisted"), snap, key.digest(snap.offset))

    def _write(self, event: str, put, snap: Snapshot, entry: str) -> None:
        try:
            nbytes = put()
        except BudgetError:
            self.log.add(event, tokens=snap.offset, entry=entry, tier="disk",
                         reason="skipped: larger than the disk budget")
            return
        if event == "demote" or nbytes:
            self.counts["demotions" if event == "demote" else "persisted"] += 1
        self.log.add(event, tokens=snap.offset, nbytes=nbytes, entry=entry, tier="disk")
        # the disk's own insert rows would repeat this one; its evictions and corrupt files stay
        self.log.rows += [replace(ev, tier="disk") for ev in self.disk.drain_events() if ev.event != "insert"]

    def _forward(self, snap: Snapshot | None = None) -> None:
        """Move the tiers' events into this log; track radix entries' keys for demotion."""
        for ev in self.ram.drain_events():
            if self.block_size is None and ev.event == "insert" and self._current is not None:
                self._keys[ev.entry] = (self._current.prefix(ev.tokens), snap)
            elif ev.event == "evict" and not ev.capacity:
                self._keys.pop(ev.entry, None)
            self.log.rows.append(replace(ev, tier="ram"))
        self.log.rows += [replace(ev, tier="disk") for ev in self.disk.drain_events()]

    def frame(self, view: str):
        """The RAM tier's frames (its capabilities' views): what serves hits first."""
        return self.ram.frame(view)

    def flush(self) -> int:
        """Write everything resident in RAM that is not on disk yet; returns the bytes written.

        Example:
            >>> store.flush()   # before the process ends (close() and ``with`` do it too)
        """
        before = self.disk.nbytes
        if self.block_size is None:
            for key, snap in list(self._keys.values()):
                self._persist(key, snap)
        else:
            for key in list(self._recent.values()):
                m = self.ram.lookup(key, None, limit=len(key))
                if m.tokens:
                    self._persist(key.prefix(m.tokens), m.snapshot)
        return max(self.disk.nbytes - before, 0)

    def close(self) -> None:
        """Flush RAM to disk (the RAM tier stays usable)."""
        self.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- looking ----------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Lookups; hits and their tokens per serving tier (a hit is the disk's when any of its
        tokens came from disk; they sum to ``hits`` and ``tokens``); tokens read from disk; moves
        between tiers; each tier's bytes and entries."""
        c = dict(self.counts)
        c["hits"] = c["hits_ram"] + c["hits_disk"]
        c["tokens"] = c["tokens_ram"] + c["tokens_disk"]
        c.update(ram_bytes=self.ram.nbytes, ram_entries=self.ram.entries, disk_bytes=self.disk.nbytes,
                 disk_files=self.disk.entries, disk_evictions=self.disk.evictions, corrupt=self.disk.corrupt)
        return c

    def __repr__(self) -> str:
        s = self.stats()
        return (f"TieredStore(ram={self.ram.name} {s['ram_entries']} entries {fmt_bytes(s['ram_bytes'])}, "
                f"disk {s['disk_files']} files {fmt_bytes(s['disk_bytes'])}; hits ram {s['hits_ram']} / "
                f"disk {s['hits_disk']})")

    def _repr_html_(self) -> str:
        return summary_html("TieredStore", repr(self),
                            body=table_html(None, self.stats().items(), row_headers=True))


def hits_by_tier(events: pl.DataFrame) -> pl.DataFrame:
    """Hits and tokens served per tier from an Engine's ``events`` (its ``tier_hit`` rows).

    Example:
        >>> kv.stores.tiered.hits_by_tier(engine.events)
    """
    hits = events.filter(pl.col("event") == "tier_hit")
    counts = hits.group_by("detail").agg(pl.len().alias("hits"), pl.col("tokens").sum())
    return (pl.DataFrame({"tier": list(TIERS)})
            .join(counts.rename({"detail": "tier"}), on="tier", how="left")
            .with_columns(pl.col("hits").fill_null(0).cast(pl.Int64), pl.col("tokens").fill_null(0).cast(pl.Int64)))
