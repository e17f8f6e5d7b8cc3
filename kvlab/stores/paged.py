"""PagedStore: vLLM's prefix cache — fixed-size KV blocks keyed by chained block hashes.

Each full block of ``block_size`` tokens is stored once, under ``kv.block_hashes`` of the request
(with its extra keys and salt), holding its own copy of every full-attention layer's keys/values
for its tokens. Blocks carry reference counts; a block nobody references is *free but still
cached* and sits in a free queue until it is reused (a hit takes it out) or evicted from the
queue's front. A finished request frees its blocks tail first, so its tail is evicted before its
head (vLLM's order).

Hits are full blocks only and the last prompt token is always recomputed: reuse is the number of
leading resident blocks within the first n-1 tokens, times ``block_size``.

Which free block goes is ``policy``'s choice (any online name in ``kvlab.policies.POLICIES``,
default ``"lru"``, which is exactly the free queue's front): each block is an evictable unit of
size 1 (capacity: ``num_blocks``, else the budget in blocks), depth ``i * block_size``, its
parent block as ``parent``; a request's blocks are accessed when it frees them, tail first, as
in ``kv.simulate``. Blocks a running request holds are never victims.

Sliding-window and recurrent layers (hybrid models, CacheList layers) are held too
(``kvlab.stores.paged_parts``): a window layer keeps only the blocks inside the window before
each checkpoint, a recurrent state is kept as a checkpoint at a block end the prompt was
snapshotted at (the store asks the Engine for one every ``checkpoint_every`` tokens through
``Capabilities.checkpoint_every``; the policy's positions move down to block ends), and a hit
lands on the deepest checkpoint along the prompt's cached blocks. A chunked-attention layer
(Llama 4) is held as a sliding window of its chunk size (its KV counts as ``window`` in
``components()``, which gives the bytes of each kind). A paged store in front of a disk tier
(``on_evict``) holds full KV only.

Example:
    >>> store = kv.PagedStore(block_size=16, num_blocks=2048)
    >>> engine = kv.Engine(kv.load("tiny"), store)
    >>> store.blocks_frame()
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import mlx.core as mx
import polars as pl

from .. import device as devices
from ..errors import BlockSizeError, BudgetError, SnapshotError
from ..keys import CacheKey
from ..policies import KIND_PRIORITY, Unit, store_policy
from ..primitives.cache_parts import WINDOWED, arrays_of, assemble, fresh_of, full_kv, nbytes_of, parts_of, structure_of
from ..primitives.display import summary_html, table_html
from ..primitives.snapshots import Snapshot
from ..primitives.tokens import Tokens
from .base import Capabilities, Match
from .block_tree import tree_of
from .budgeted import BudgetedStore
from .paged_parts import Checkpoint, CheckpointBook, block_bytes, check_pool, join_full, join_window, needs, obstacle


@dataclass(eq=False)
class Block:
    """One resident block: its hash, parent hash, token ids, per full-attention part (keys,
    values) arrays of shape [batch, kv_heads, block_size, head_dim] (quantized parts: (keys,
    values, group_size, bits), keys and values each (packed words, scales, biases)), and per
    window part (part index -> (keys, values)) while a checkpoint's window reaches it."""

    id: int
    hash: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    kv: tuple[tuple[mx.array, mx.array], ...]
    nbytes: int
    fingerprint: str | None
    ref_cnt: int = 0
    hits: int = 0
    last_used: int = 0
    window: dict = field(default_factory=dict)
    window_refs: int = 0

    def __repr__(self) -> str:
        return f"Block({self.hash.hex()[:12]}, {len(self.token_ids)} tokens, ref {self.ref_cnt})"

    def _repr_html_(self) -> str:
        return summary_html(f"block {self.id} {self.hash.hex()[:12]}", f"{len(self.token_ids)} tokens",
                            f"{self.nbytes} B", f"ref {self.ref_cnt}", f"{self.hits} hits")


CHECKPOINT_TOKENS = 256  # default recurrent checkpoint interval, rounded up to a block end


class PagedStore(CheckpointBook, BudgetedStore):
    """vLLM-style paged prefix cache (see module docstring).

    ``num_blocks`` is the pool size; ``budget_bytes`` (default 25% of the device's memory) also
    caps the resident bytes. Both bound what stays cached; ``policy`` (a name or a ``kvlab.policies.Policy``;
    default the least recently freed block first) and ``policy_params`` say which block goes.
    ``checkpoint_every`` (a multiple of ``block_size``, default 256 tokens rounded up to one):
    how often a prompt of a model with recurrent layers is snapshotted at a block end besides its
    checkpoint policy's positions (moved down to block ends: ``kvlab.checkpoints.prefill_stops``).
    ``block_size`` reuses the most and splits a prefill into block-sized pieces, which is slower
    (BENCHMARKS.md's hybrid TTFT rows); vLLM's align mode uses blocks of hundreds of tokens, oMLX
    snapshots every 2048/4096. ``keep_superseded_windows`` (default False): the window KV of a
    checkpoint taken mid-prompt is dropped once a deeper one on its path is kept, so a sliding
    model holds one window per cached prompt (``kvlab.stores.paged_parts.CheckpointBook``); True
    keeps every checkpoint's window, so a prompt branching off at any earlier message end reuses it.
    ``device`` (default ``kvlab.device.current()``): where the blocks live; each block keeps a
    buffer per full-attention layer for K and for V, and a backend with a buffer limit (Metal)
    refuses a pool that could outgrow it: at construction when ``num_blocks`` alone does, else
    when the first snapshot tells a block's buffers and bytes (``BufferLimitError``).
    """

    name = "paged"

    def __init__(self, block_size: int = 16, num_blocks: int | None = None, *,
                 budget_bytes: int | None = None, policy="lru", policy_params: dict | None = None,
                 on_evict=None, checkpoint_every: int | None = None, keep_superseded_windows: bool = False,
                 device: devices.Device | None = None):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise BlockSizeError(f"block_size must be a positive int (vLLM uses 16), got {block_size!r}")
        if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int)
                                       or num_blocks <= 0):
            raise BudgetError(f"num_blocks must be a positive int (the pool size), got {num_blocks!r}")
        every = checkpoint_every if checkpoint_every is not None else -(-CHECKPOINT_TOKENS // block_size) * block_size
        if isinstance(every, bool) or not isinstance(every, int) or every <= 0 or every % block_size:
            raise BlockSizeError(f"checkpoint_every must be a positive multiple of block_size={block_size} "
                                 f"(a block end; default {CHECKPOINT_TOKENS} rounded up to one), got "
                                 f"{checkpoint_every!r}")
        super().__init__(budget_bytes, on_evict, device)  # on_evict(block_hash_hex, block snapshot)
        self.block_size = block_size
        self.checkpoint_every = every
        self.keep_superseded_windows = bool(keep_superseded_windows)
        self.num_blocks = num_blocks
        if num_blocks is not None:
            check_pool(self, None, 2)  # a block holds at least one layer's K and V
        # capacity in blocks; without num_blocks it is known once a snapshot gives a block's bytes
        self.policy = store_policy(policy, num_blocks, policy_params, store=self.name)
        self._policy_spec = None if num_blocks is not None or not isinstance(policy, str) else (policy, policy_params)
        self._blocks: dict[bytes, Block] = {}
        # free but cached blocks, front = evicted first (vLLM's FreeKVCacheBlockQueue)
        self._free: OrderedDict[bytes, Block] = OrderedDict()
        self._unpageable = ""  # why the last snapshot offered could not be paged
        self._parts = None  # the model's cache parts (kvlab.primitives.cache_parts), from its first snapshot
        self._checkpoints: dict[bytes, Checkpoint] = {}  # by the hash of the block they end

    # -- protocol ---------------------------------------------------------------------------------
    @property
    def entries(self) -> int:
        return len(self._blocks)

    def hashes(self, key: CacheKey, n: int | None = None) -> list[bytes]:
        """Chained hashes of the full blocks of ``key``'s first ``n`` tokens (all by default)."""
        return key.block_hashes(self.block_size, n)

    @property
    def capabilities(self) -> Capabilities:
        # a block handed to a disk tier alone restores nothing of a window or a recurrent state
        holds = {"full"} if self.on_evict is not None else {"full", "window", "chunked", "recurrent", "list"}
        return Capabilities(block_size=self.block_size, holds=frozenset(holds), budget_bytes=self.budget_bytes,
                            views=("tree", "blocks"), checkpoint_every=None if self.on_evict else self.checkpoint_every,
                            components=True, eviction_policy=self.policy.name)

    def lookup(self, key: CacheKey, tokens: Tokens, *, limit: int) -> Match:
        if self._unpageable:
            return Match("miss", why=self._unpageable)
        hits = []
        for h in self.hashes(key, limit):
            block = self._blocks.get(h)
            if block is None:
                break
            hits.append(block)
        if not hits:
            return Match("miss", why=self._miss_why(key, limit))
        cp = None
        if self._checkpointed:
            k = next((k for k in range(len(hits), 0, -1) if hits[k - 1].hash in self._checkpoints), 0)
            if not k:
                return Match("miss", why=f"{len(hits)} leading blocks ({len(hits) * self.block_size} tokens) "
                             f"are cached, but no checkpoint of {needs(self._parts)} is held at a block "
                             "end within them")
            hits, cp = hits[:k], self._checkpoints[hits[k - 1].hash]
            cp.hits += 1
        tick = next(self._clock)
        for b in hits:
            b.hits, b.last_used = b.hits + 1, tick
        n = len(hits) * self.block_size
        return Match("prefix", n, self._gather(hits, key.ids[:n], cp), n, hits[-1].id)

    def insert(self, key: CacheKey, tokens: Tokens, snap: Snapshot, *, kind: str = "prompt") -> None:
        parts = parts_of(snap)
        why = obstacle(parts)
        if why:
            self._unpageable = why
            return
        hashes = self.hashes(key, snap.offset)
        if not hashes:
            return
        self._check_model(snap)
        if self._parts is None:
            self._parts = structure_of(parts)
        per_block = block_bytes(self.device, parts, self.block_size)
        if not self._blocks:  # the first snapshot tells how many buffers a block keeps
            check_pool(self, per_block, len(arrays_of([tuple(p.state[:2]) for p in parts if p.kind == "full"])))
        if self._policy_spec is not None:  # first blocks: size the policy to the budget in blocks
            name, params = self._policy_spec
            self.policy = store_policy(name, self.budget_bytes // max(per_block, 1), params, store=self.name)
            self._policy_spec = None
        if self.num_blocks is not None and len(hashes) > self.num_blocks:
            raise BudgetError(f"paged: this request needs {len(hashes)} blocks of {self.block_size} "
                              f"tokens but the pool has num_blocks={self.num_blocks}; raise num_blocks "
                              "(or lower block_size / send shorter prompts)")
        if len(hashes) * per_block > self.budget_bytes:
            raise BudgetError(f"paged: this request's {len(hashes)} blocks need "
                              f"{len(hashes) * per_block} bytes but budget_bytes is "
                              f"{self.budget_bytes}; raise budget_bytes")
        # allocate: the request references every one of its blocks while it runs ...
        held, parent = [], None
        for i, h in enumerate(hashes):
            block = self._blocks.get(h)
            if block is None:
                block = self._store(h, parent, key.ids, i, parts, snap.fingerprint, kind)
            else:
                self._free.pop(h, None)
            block.ref_cnt += 1
            held.append(block)
            parent = h
        if self._checkpointed:
            self._checkpoint(held, parts, snap.offset, prompt_end=kind != "checkpoint")
        # ... and frees them when it finishes, tail first, so the tail is evicted before the head
        tick = next(self._clock)
        priority = KIND_PRIORITY.get(kind, 0)
        for i in range(len(held) - 1, -1, -1):
            block = held[i]
            block.ref_cnt -= 1
            block.last_used = max(block.last_used, tick)
            self.policy.access(Unit(block.hash, 1, i * self.block_size, self.block_size, block.parent,
                                    priority))
            if block.ref_cnt == 0:
                self._free[block.hash] = block

    # -- internals --------------------------------------------------------------------------------
    @property
    def _checkpointed(self) -> bool:
        """A hit needs a checkpoint (this model has window or recurrent parts)."""
        return bool(self._parts) and bool(needs(self._parts))

    def _store(self, h: bytes, parent, ids, i: int, parts, fingerprint, kind: str) -> Block:
        s, e = i * self.block_size, (i + 1) * self.block_size
        # a copy per block (not a view) so a block never keeps a whole request buffer alive, in
        # fresh memory on CPU: MLX's buffer cache would hand a small copy a freed buffer up to twice
        devices.before_copies(self.device)  # its size (not on GPUs: Device.clears_cache_for_copies)
        kv = tuple(full_kv(p.state, s, e) for p in parts if p.kind == "full")
        mx.eval(arrays_of(kv))
        nbytes = self.device.held_bytes(arrays_of(kv))
        while self._full(nbytes):
            self._evict_one()
        block = Block(next(self._ids), h, parent, tuple(ids[s:e]), kv, nbytes, fingerprint,
                      last_used=next(self._clock))
        self._blocks[h] = block
        self._bytes += nbytes
        self.log.add("block_stored", tokens=self.block_size, nbytes=nbytes, entry=h.hex(), kind=kind)
        return block

    def _full(self, incoming: int) -> bool:
        if self.num_blocks is not None and len(self._blocks) >= self.num_blocks:
            return True
        return self._bytes + incoming > self.budget_bytes

    def _evict_one(self) -> None:
        if not self._free:
            # unreachable after insert's size checks: every other block is free between requests
            raise BudgetError("paged: every block is referenced; raise num_blocks or budget_bytes")
        h = self.policy.victim(self._free.__contains__)
        block = self._free[h]
        if self.on_evict is not None and not self._checkpointed:
            self.on_evict(h.hex(), self._gather([block], block.token_ids))  # hand it over first
        self._drop_checkpoint(h, self.policy.name)
        del self._free[h]
        del self._blocks[h]
        self._bytes -= block.nbytes
        self.evictions += 1
        self.log.add("block_removed", tokens=len(block.token_ids), nbytes=block.nbytes,
                     entry=h.hex(), reason=self.policy.name, capacity=True)

    def _gather(self, hits: list[Block], ids, cp: Checkpoint | None = None) -> Snapshot:
        n = len(hits) * self.block_size
        states, f = {}, 0
        for i, p in enumerate(self._parts):
            if p.kind == "full":
                states[i], f = join_full([b.kv[f] for b in hits], n), f + 1
            elif p.kind in WINDOWED:
                states[i] = join_window(hits, i, n, p, self.block_size)
            else:
                states[i] = fresh_of(cp.states[i])
        layers = assemble(self._parts, states, n)
        mx.eval([arrays_of(layer.state) for layer in layers])
        return Snapshot(layers, n, tuple(ids), hits[0].fingerprint)

    def _miss_why(self, key: CacheKey, limit: int) -> str:
        if limit < self.block_size:
            return (f"only full blocks are reused and the last token is recomputed: a prompt needs "
                    f"more than {self.block_size} tokens to hit")
        if not self._blocks:
            return "no blocks cached yet"
        return "the request's first block is not cached"

    def _check_model(self, snap: Snapshot) -> None:
        if not self._blocks:
            return
        theirs = next(iter(self._blocks.values())).fingerprint
        if snap.fingerprint is not None and theirs is not None and snap.fingerprint != theirs:
            raise SnapshotError(f"this PagedStore holds KV of model {theirs[:12]}, not of model "
                                f"{snap.fingerprint[:12]}: block hashes do not include the model, so "
                                "use one PagedStore per model")

    # -- looking ----------------------------------------------------------------------------------
    def blocks_frame(self) -> pl.DataFrame:
        """One row per resident block: hash, parent, ids, bytes, ref count, hits, recency, its
        place in the free queue (0 = evicted next; null = referenced), its window KV bytes and
        the recurrent-state bytes of a checkpoint at its end."""
        order = {h: i for i, h in enumerate(self._free)}
        return pl.DataFrame(
            [{"block": b.id, "hash": b.hash.hex(), "parent": b.parent.hex() if b.parent else None,
              "token_ids": list(b.token_ids), "bytes": b.nbytes, "ref_cnt": b.ref_cnt,
              "hits": b.hits, "last_used": b.last_used, "free_position": order.get(h),
              "window_bytes": nbytes_of(list(b.window.values())),
              "checkpoint_bytes": self._checkpoints[h].nbytes if h in self._checkpoints else None}
             for h, b in self._blocks.items()],
            schema={"block": pl.Int64, "hash": pl.Utf8, "parent": pl.Utf8,
                    "token_ids": pl.List(pl.Int64), "bytes": pl.Int64, "ref_cnt": pl.Int64,
                    "hits": pl.Int64, "last_used": pl.Int64, "free_position": pl.Int64,
                    "window_bytes": pl.Int64, "checkpoint_bytes": pl.Int64})

    def tree_frame(self) -> pl.DataFrame:
        """The block chains as a prefix tree, RadixStore.tree_frame's columns (kvlab.stores.block_tree)."""
        return tree_of(self.blocks_frame())

    def _pool(self) -> str:
        return "" if self.num_blocks is None else f" of {self.num_blocks}"

    def __repr__(self) -> str:
        return (f"PagedStore({len(self._blocks)}{self._pool()} blocks of {self.block_size}, "
                f"{len(self._free)} free, {self._bytes / 2**20:.1f} MiB, {self.evictions} evictions)")

    def _repr_html_(self) -> str:
        blocks = self.blocks_frame().drop("token_ids")
        c = self.components()
        return summary_html("PagedStore", f"{len(self._blocks)}{self._pool()} blocks of "
                            f"{self.block_size} tokens", f"{len(self._free)} free (cached)", f"{self._bytes / 2**20:.2f} MiB",
                            f"full KV {c['full']} B, window KV {c['window']} B, recurrent {c['recurrent']} B "
                            f"in {c['checkpoints']} checkpoints",
                            f"{self.evictions} evictions", note=self._unpageable,
                            body=table_html(blocks.columns, blocks.head(50).rows(), total=blocks.height))

