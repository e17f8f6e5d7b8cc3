"""DiskStore: a persistent tier, one safetensors file per entry (or per paged block), keyed by its hash.

Layout under ``path``: ``<fingerprint[:16]>/entries/<CacheKey.digest(n)>.safetensors`` (whole
prefixes, what a RadixStore evicts) or ``<fingerprint[:16]>/blocks<B>/<block hash hex>.safetensors``
(``block_size=B``: paged blocks). Files are written by ``kv.save`` (temp file, then atomic rename: a
killed writer leaves a ``.kvlab-*`` temp file, never a partial entry; metadata: format version,
model fingerprint, token ids, data digest) and read by ``kv.load_snapshot`` (refuses another
model's file, a digest mismatch, a newer format).

On open the index is rebuilt from the files' headers (no data read). A file whose header, size or
metadata is wrong, or that fails its digest or token-id check on load, is *corrupt*: renamed to
``<name>.corrupt``, reported (a ``corrupt`` StoreEvent and a ``CorruptFileWarning`` naming the
path) and never used; a lookup falls back to the next candidate.

Eviction under ``budget_bytes`` (bytes of files): least recently used first, recency being the
file's mtime, set on every write and hit, so the order survives restarts. A block chain is stamped
head newest, so it loses its tail first (a block is reachable only after its parent).

Entry files serve the longest common prefix with a request (trimmed, when their cache is
trimmable); an entry whose key has a salt or extra keys serves only as a whole prefix (its file
cannot tell its namespace, its name can). Block files serve the leading run of a request's
chained block hashes.

Example:
    >>> disk = kv.DiskStore("kv-cache", 4 << 30, model=m)
    >>> kv.Engine(m, disk).run("hello")
"""

from __future__ import annotations

import html
import os
import shutil
import warnings
from pathlib import Path

import polars as pl

from ..errors import BlockSizeError, KvlabError, SnapshotError
from ..keys import CacheKey
from ..primitives.snapshot_files import load_snapshot, save
from ..primitives import timing
from ..primitives.snapshots import Snapshot, cut_refusal
from ..primitives.tokens import Tokens
from ..primitives.units import fmt_bytes
from .base import (ALL_LAYER_KINDS, Capabilities, MISS, EventLog, Match, StoreBase, check_budget, fell_back,
                   too_big)
from .disk_files import (PAGEABLE, SUFFIX, TEMP_PREFIX, CorruptFileWarning, FingerprintOnly, as_ids,
                         check_file, concat_blocks, cut_block)
from .disk_index import DiskEntry, DiskIndex

__all__ = ["DiskStore", "DiskEntry", "CorruptFileWarning", "concat_blocks"]
STALE_TEMP_S = 600  # a temp file older than this is a killed writer's leftover, removed on open


class DiskStore(StoreBase):
    """Snapshots (or paged blocks) as files in ``path`` (see module docstring).

    ``model`` (a kvlab Model or its fingerprint) is required: the files are kept per model, and a
    store must know its model on open to find what an earlier process wrote. ``budget_bytes``
    defaults to a quarter of the disk's free space at open. ``block_size`` switches to paged blocks.
    """

    name = "disk"

    def __init__(self, path, budget_bytes: int | None = None, *, model=None, block_size: int | None = None):
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                       or block_size <= 0):
            raise BlockSizeError(f"block_size must be a positive int or None (whole entries), got {block_size!r}")
        self.budget_bytes = None if budget_bytes is None else check_budget(budget_bytes)
        if model is None:
            raise SnapshotError(f"DiskStore needs model=: its files are kept in a folder per model under "
                                f"{os.fspath(path)}, and without the model a new process cannot find the files "
                                "an earlier one wrote; pass model=m (a kvlab Model) or model=m.fingerprint")
        self.path = Path(os.fspath(path)).expanduser()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KvlabError(f"DiskStore cannot use {self.path}: {e.strerror}; pass a writable folder") from e
        if self.budget_bytes is None:
            self.budget_bytes = max(shutil.disk_usage(self.path).free // 4, 1)
        self.block_size = block_size
        self.fingerprint: str | None = None
        self.folder: Path | None = None
        self._index = DiskIndex()
        self.evictions = self.corrupt = self.hits = 0
        self.log = EventLog()
        self.bind(model)

    # -- binding and the index --------------------------------------------------------------------
    def bind(self, model) -> None:
        """Serve the files of ``model`` (a kvlab Model or a fingerprint) and index them; a store
        bound to one model refuses another's."""
        fp = model if isinstance(model, str) else getattr(model, "fingerprint", None)
        if not isinstance(fp, str) or not fp:
            raise SnapshotError(f"DiskStore needs a model fingerprint, got {model!r:.60}")
        if self.fingerprint == fp:
            return
        if self.fingerprint is not None:
            raise SnapshotError(f"this DiskStore serves model {self.fingerprint[:12]}, not {fp[:12]}: "
                                "use one DiskStore (or TieredStore) per model")
        self.fingerprint = fp
        sub = "entries" if self.block_size is None else f"blocks{self.block_size}"
        self.folder = self.path / fp[:16] / sub
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rebuild()

    def rebuild(self) -> None:
        """Re-read the index from the files (what another process wrote shows up)."""
        self._index = DiskIndex()
        now = timing.wall()
        for p in sorted(self.folder.iterdir()):
            if p.name.startswith(TEMP_PREFIX):
                if now - p.stat().st_mtime > STALE_TEMP_S:
                    p.unlink(missing_ok=True)
                continue
            if not p.name.endswith(SUFFIX):
                continue
            name = p.name[: -len(SUFFIX)]
            why, tokens, ids = check_file(p, self.fingerprint, self.block_size)
            if why and p.exists():  # (a file another process just evicted is simply gone)
                self._quarantine(p, name, why)
            if why:
                continue
            st = p.stat()
            plain = ids is not None and CacheKey(tuple(ids)).digest() == name
            self._index.add(DiskEntry(name, p, tokens, st.st_size, st.st_mtime_ns, as_ids(ids) if plain else None))
        self._evict(protect=set())

    def _quarantine(self, p: Path, name: str, why: str) -> None:
        aside = p.with_name(p.name + ".corrupt")
        try:
            os.replace(p, aside)
        except OSError:
            aside = p  # e.g. a read-only folder: it stays, and stays out of the index
        self.corrupt += 1
        self.log.add("corrupt", entry=name, reason=why, tier="disk")
        warnings.warn(f"DiskStore: {p} is corrupt ({why}); moved aside to {aside.name} and not used",
                      CorruptFileWarning, stacklevel=3)

    # -- writing ----------------------------------------------------------------------------------
    def put(self, key: CacheKey, snap: Snapshot, *, kind: str = "prompt") -> int:
        """Write the KV of ``key``'s first ``snap.offset`` tokens (its blocks in block mode) unless
        present; returns the bytes written. Present files are refreshed (made most recent)."""
        self._check_model(snap)
        if self.block_size is not None:
            return self._put_blocks(key, snap, kind)
        n = snap.offset
        if n <= 0:
            return 0
        if snap.token_ids is not None and tuple(snap.token_ids[:n]) != tuple(key.ids[:n]):
            raise SnapshotError("DiskStore.put: the snapshot's token ids are not the key's")
        name = key.digest(n)
        if name in self._index:
            self._touch([self._index[name]])
            return 0
        plain = key.namespace_at(n) == (None, ())
        return self._write(name, snap, key.ids[:n], kind, plain)

    def put_block(self, name: str, snap: Snapshot, *, kind: str = "demoted") -> int:
        """Write one paged block (a snapshot of its ``block_size`` tokens) under its hash hex."""
        self._check_model(snap)
        if self.block_size is None or snap.offset != self.block_size:
            raise BlockSizeError(f"put_block needs a DiskStore with block_size={snap.offset}, "
                                 f"this one has block_size={self.block_size}")
        if name in self._index:
            self._touch([self._index[name]])
            return 0
        return self._write(name, snap, snap.token_ids, kind)

    def _put_blocks(self, key: CacheKey, snap: Snapshot, kind: str) -> int:
        if any(layer.kind not in PAGEABLE for layer in snap.layers):
            return 0  # only attention KV can be cut into blocks (PagedStore says why on lookup)
        bs, written, chain = self.block_size, 0, []
        for i, h in enumerate(key.block_hashes(bs, snap.offset)):
            if h.hex() not in self._index:
                ids = key.ids[i * bs:(i + 1) * bs]
                written += self._write(h.hex(), cut_block(snap, i, bs, ids), ids, kind)
            chain.append(self._index[h.hex()])
        self._touch(chain)
        return written

    def _write(self, name: str, snap: Snapshot, ids, kind: str, plain: bool = False) -> int:
        p = self.folder / f"{name}{SUFFIX}"
        save(snap, p, tokens=ids, model=FingerprintOnly(self.fingerprint))
        st = p.stat()
        if st.st_size > self.budget_bytes:
            p.unlink()
            raise too_big(self.name, st.st_size, self.budget_bytes)
        e = DiskEntry(name, p, snap.offset, st.st_size, st.st_mtime_ns, as_ids(ids) if plain else None)
        self._index.add(e)
        self.log.add("insert", tokens=e.tokens, nbytes=e.nbytes, entry=name, kind=kind, tier="disk")
        self._evict(protect={name})
        return e.nbytes

    def _check_model(self, snap: Snapshot) -> None:
        if snap.fingerprint is None:
            raise SnapshotError("DiskStore stores snapshots that know their model: take them with "
                                "kv.snapshot(cache, model=m)")
        self.bind(snap.fingerprint)

    def _touch(self, chain: list[DiskEntry]) -> None:
        """Make ``chain`` most recent, its head newest (so its tail is evicted first)."""
        now = timing.wall_ns()
        for i, e in enumerate(chain):
            e.mtime_ns = now - i * 1000
            try:
                os.utime(e.path, ns=(e.mtime_ns, e.mtime_ns))
            except FileNotFoundError:
                pass  # removed by another process; its load will notice

    def _evict(self, protect: set) -> None:
        while self._index.nbytes > self.budget_bytes:
            victims = [e for e in self._index.values() if e.name not in protect]
            if not victims:
                break
            v = min(victims, key=lambda e: (e.mtime_ns, e.name))
            self._index.remove(v)
            v.path.unlink(missing_ok=True)
            self.evictions += 1
            self.log.add("evict", tokens=v.tokens, nbytes=v.nbytes, entry=v.name, reason="lru",
                         capacity=True, tier="disk")

    # -- reading ----------------------------------------------------------------------------------
    def get(self, name: str) -> DiskEntry | None:
        """The indexed file of this hash name, if any."""
        return self._index.get(name)

    def load(self, e: DiskEntry, ids) -> Snapshot | None:
        """The snapshot in ``e``'s file, checked (model, digest, token ids ``ids``); None, and the
        file moved aside and reported, if it fails; None if another process removed it."""
        try:
            snap = load_snapshot(e.path, FingerprintOnly(self.fingerprint))
        except SnapshotError as err:
            self._index.remove(e)
            if e.path.exists():
                self._quarantine(e.path, e.name, str(err).replace(str(e.path), e.path.name))
            return None
        want = e.ids if ids is None else ids
        if snap.token_ids is not None and want is not None and tuple(snap.token_ids) != tuple(int(i) for i in want):
            self._index.remove(e)
            self._quarantine(e.path, e.name, "its token ids differ from its key's")
            return None
        e.hits += 1
        return snap

    def best(self, key: CacheKey, limit: int, *, longer_than: int = 0) -> Match:
        """The usable entry file serving the most tokens (more than ``longer_than``), loaded."""
        skipped = None  # (entry, shared, reuse, why) of the deepest entry that cannot be cut back
        for reuse, shared, e in self._index.candidates(key, limit):
            if reuse <= longer_than:
                break
            snap = self.load(e, key.ids[: e.tokens] if shared == e.tokens else None)
            if snap is None:
                continue
            if reuse < snap.offset and (why := cut_refusal(snap, reuse)):
                skipped = skipped or (e, shared, reuse, why)
                continue
            self._touch([e])
            self.hits += 1
            kind = ("prefix" if shared == e.tokens <= limit else "exact" if shared == e.tokens == len(key)
                    else "supersequence" if shared == len(key) else "lcp")
            fell = skipped is not None and reuse < skipped[2]
            return Match(kind, reuse, snap, e.tokens,
                         why=fell_back(skipped[0].tokens, *skipped[1:], (reuse, e.tokens)) if fell else "")
        return Match("miss", why=fell_back(skipped[0].tokens, *skipped[1:], None) if skipped else "")

    def load_blocks(self, key: CacheKey, limit: int, start: int = 0) -> list[Snapshot]:
        """Block snapshots of the leading run of ``key``'s block hashes (within ``limit`` tokens)
        present on disk, from block ``start``; stops at the first missing or failing file."""
        bs, out, chain = self.block_size, [], []
        for i, h in enumerate(key.block_hashes(bs, limit)[start:], start):
            e = self._index.get(h.hex())
            snap = None if e is None else self.load(e, key.ids[i * bs:(i + 1) * bs])
            if snap is None:
                break
            out.append(snap)
            chain.append(e)
        self._touch(chain)
        self.hits += bool(out)
        return out

    # -- the Store protocol -----------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self._index.nbytes

    @property
    def entries(self) -> int:
        return len(self._index)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(block_size=self.block_size, budget_bytes=self.budget_bytes, tiers=("disk",),
                            holds=ALL_LAYER_KINDS if self.block_size is None else frozenset({"full"}))

    def lookup(self, key: CacheKey, tokens: Tokens, *, limit: int) -> Match:
        if self.block_size is None:
            m = self.best(key, limit)
        else:
            blocks = self.load_blocks(key, limit)
            n = len(blocks) * self.block_size
            m = Match("prefix", n, concat_blocks(blocks, key.ids[:n]), n) if blocks else MISS
        if m.tokens == 0 and not self._index:
            return Match("miss", why="no files on disk yet")
        return m

    def insert(self, key: CacheKey, tokens: Tokens, snap: Snapshot, *, kind: str = "prompt") -> None:
        self.put(key, snap, kind=kind)

    # -- looking ----------------------------------------------------------------------------------
    def files_frame(self) -> pl.DataFrame:
        """One row per indexed file: name, tokens, bytes, mtime (ns; eviction goes oldest first), hits."""
        return pl.DataFrame([{"name": e.name, "tokens": e.tokens, "bytes": e.nbytes,
                              "mtime_ns": e.mtime_ns, "hits": e.hits} for e in self._index.values()],
                            schema={"name": pl.Utf8, "tokens": pl.Int64, "bytes": pl.Int64,
                                    "mtime_ns": pl.Int64, "hits": pl.Int64}).sort("mtime_ns")

    def __repr__(self) -> str:
        mode = "entries" if self.block_size is None else f"blocks of {self.block_size}"
        return (f"DiskStore({self.path}, {len(self._index)} files ({mode}), {fmt_bytes(self._index.nbytes)} of "
                f"{fmt_bytes(self.budget_bytes)}, {self.evictions} evictions, {self.corrupt} corrupt)")

    def _repr_html_(self) -> str:
        return f"<div><b>DiskStore</b> {html.escape(repr(self))}</div>" + self.files_frame().head(50)._repr_html_()

