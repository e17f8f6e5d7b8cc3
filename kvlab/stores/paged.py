"""PagedStore: vLLM's prefix cache — fixed-size KV blocks keyed by chained block hashes.

Each full block of ``block_size`` tokens is stored once, under ``kv.block_hashes`` of the request
(with its extra keys and salt), holding its own copy of every layer's keys/values for its tokens.
Blocks carry reference counts; a block nobody references is *free but still cached* and sits in
a free queue until it is reused (a hit takes it out) or evicted from the queue's front. A finished
request frees its blocks tail first, so its tail is evicted before its head (vLLM's order).

Hits are full blocks only and the last prompt token is always recomputed: reuse is the number of
leading resident blocks within the first n-1 tokens, times ``block_size``.

Which free block goes is ``policy``'s choice (any online name in ``kvlab.policies.POLICIES``,
default ``"lru"``, which is exactly the free queue's front): each block is an evictable unit of
size 1 (capacity: ``num_blocks``, else the budget in blocks), depth ``i * block_size``, its
parent block as ``parent``; a request's blocks are accessed when it frees them, tail first, as
in ``kv.simulate``. Blocks a running request holds are never victims.

Only attention (``KVCache``, ``QuantizedKVCache``) layers can be paged. For a model with other layers (SSM/conv state,
rotating windows) ``insert`` stores nothing and ``lookup`` answers a miss whose ``why`` says which
layer is the obstacle, so the Engine's Result explains the 0% reuse instead of hiding it.

Example:
    >>> store = kv.PagedStore(block_size=16, num_blocks=2048)
    >>> engine = kv.Engine(kv.load("tiny"), store)
    >>> store.blocks_frame()
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import polars as pl
from mlx.utils import tree_flatten, tree_map

from ..errors import BlockSizeError, BudgetError, SnapshotError
from ..keys import CacheKey
from ..policies import KIND_PRIORITY, Unit, store_policy
from ..primitives.display import summary_html, table_html
from ..primitives.snapshots import LayerState, Snapshot
from ..primitives.tokens import Tokens
from .base import Capabilities, Match
from .budgeted import BudgetedStore


@dataclass(eq=False)
class Block:
    """One resident block: its hash, parent hash, token ids and per-layer (keys, values)
    arrays of shape [batch, kv_heads, block_size, head_dim] (quantized layers: (keys, values,
    group_size, bits), keys and values each (packed words, scales, biases))."""

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

    def __repr__(self) -> str:
        return f"Block({self.hash.hex()[:12]}, {len(self.token_ids)} tokens, ref {self.ref_cnt})"

    def _repr_html_(self) -> str:
        return summary_html(f"block {self.id} {self.hash.hex()[:12]}", f"{len(self.token_ids)} tokens",
                            f"{self.nbytes} B", f"ref {self.ref_cnt}", f"{self.hits} hits")


class PagedStore(BudgetedStore):
    """vLLM-style paged prefix cache (see module docstring).

    ``num_blocks`` is the pool size; ``budget_bytes`` (default 25% of RAM) also caps the resident
    blocks' bytes. Both bound what stays cached; ``policy`` (a name or a ``kvlab.policies.Policy``;
    default the least recently freed block first) and ``policy_params`` say which block goes.
    """

    name = "paged"

    def __init__(self, block_size: int = 16, num_blocks: int | None = None, *,
                 budget_bytes: int | None = None, policy="lru", policy_params: dict | None = None,
                 on_evict=None):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise BlockSizeError(f"block_size must be a positive int (vLLM uses 16), got {block_size!r}")
        if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int)
                                       or num_blocks <= 0):
            raise BudgetError(f"num_blocks must be a positive int (the pool size), got {num_blocks!r}")
        super().__init__(budget_bytes, on_evict)  # on_evict(block_hash_hex, block snapshot)
        self.block_size = block_size
        self.num_blocks = num_blocks
        # capacity in blocks; without num_blocks it is known once a snapshot gives a block's bytes
        self.policy = store_policy(policy, num_blocks, policy_params, store=self.name)
        self._policy_spec = None if num_blocks is not None or not isinstance(policy, str) else (policy, policy_params)
        self._blocks: dict[bytes, Block] = {}
        # free but cached blocks, front = evicted first (vLLM's FreeKVCacheBlockQueue)
        self._free: OrderedDict[bytes, Block] = OrderedDict()
        self._unpageable = ""  # why the last snapshot offered could not be paged

    # -- protocol ---------------------------------------------------------------------------------
    @property
    def entries(self) -> int:
        return len(self._blocks)


    def hashes(self, key: CacheKey, n: int | None = None) -> list[bytes]:
        """Chained hashes of the full blocks of ``key``'s first ``n`` tokens (all by default)."""
        return key.block_hashes(self.block_size, n)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(block_size=self.block_size, holds=frozenset({"full"}), budget_bytes=self.budget_bytes,
                            views=("blocks",))

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
        tick = next(self._clock)
        for b in hits:
            b.hits, b.last_used = b.hits + 1, tick
        n = len(hits) * self.block_size
        return Match("prefix", n, self._gather(hits, key.ids[:n]), n, hits[-1].id)

    def insert(self, key: CacheKey, tokens: Tokens, snap: Snapshot, *, kind: str = "prompt") -> None:
        why = _why_unpageable(snap)
        if why:
            self._unpageable = why
            return
        hashes = self.hashes(key, snap.offset)
        if not hashes:
            return
        self._check_model(snap)
        per_block = _bytes_per_token(snap) * self.block_size
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
                block = self._store(h, parent, key.ids, i, snap, kind)
            else:
                self._free.pop(h, None)
            block.ref_cnt += 1
            held.append(block)
            parent = h
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
    def _store(self, h: bytes, parent, ids, i: int, snap: Snapshot, kind: str) -> Block:
        s, e = i * self.block_size, (i + 1) * self.block_size
        # a copy per block (not a view) so a block never keeps a whole request buffer alive
        # (mx.array copies; mx.contiguous returns a one-KV-head slice as the view it is), in fresh
        # memory: MLX's buffer cache would hand a small copy a freed buffer up to twice its size.
        # A quantized layer's packed words, scales and biases all have the token axis at -2, and
        # its (group_size, bits) ride along after (keys, values)
        mx.clear_cache()
        kv = tuple(tree_map(lambda a: mx.array(a[..., s:e, :]), tuple(layer.state[:2])) + tuple(layer.state[3:5])
                   for layer in snap.layers)
        arrays = [a for _, a in tree_flatten(kv) if isinstance(a, mx.array)]
        mx.eval(arrays)
        nbytes = sum(a.nbytes for a in arrays)
        while self._full(nbytes):
            self._evict_one()
        block = Block(next(self._ids), h, parent, tuple(ids[s:e]), kv, nbytes, snap.fingerprint,
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
        if self.on_evict is not None:
            self.on_evict(h.hex(), self._gather([block], block.token_ids))  # hand it over first
        del self._free[h]
        del self._blocks[h]
        self._bytes -= block.nbytes
        self.evictions += 1
        self.log.add("block_removed", tokens=len(block.token_ids), nbytes=block.nbytes,
                     entry=h.hex(), reason=self.policy.name, capacity=True)

    def _gather(self, hits: list[Block], ids) -> Snapshot:
        n = len(hits) * self.block_size
        layers = []
        for i in range(len(hits[0].kv)):
            parts = [b.kv[i] for b in hits]
            quant = {tuple(p[2:]) for p in parts if len(p) > 2}
            if len(quant) > 1:
                raise SnapshotError(f"this PagedStore holds blocks quantized with different (group size, "
                                    f"bits) {sorted(quant)}: use one PagedStore per KV format")
            if quant:
                # float blocks cached below quantized_kv_start: mlx quantizes each token's groups on
                # their own, so quantizing a block alone equals what mlx-lm's conversion would give
                group, bits = quant.pop()
                parts = [p if len(p) > 2 else tuple(mx.quantize(x, group_size=group, bits=bits) for x in p)
                         for p in parts]
                k, v = (tuple(mx.concatenate([p[j][a] for p in parts], axis=-2) for a in range(3)) for j in (0, 1))
                layers.append(LayerState("QuantizedKVCache", (k, v, n, group, bits), n,
                                         sum(a.nbytes for a in k + v)))
                continue
            k = mx.concatenate([p[0] for p in parts], axis=2)
            v = mx.concatenate([p[1] for p in parts], axis=2)
            layers.append(LayerState("KVCache", (k, v, n), n, k.nbytes + v.nbytes))
        mx.eval([layer.state[:2] for layer in layers])
        return Snapshot(tuple(layers), n, tuple(ids), hits[0].fingerprint)

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
        """One row per resident block: hash, parent, ids, bytes, ref count, hits, recency and its
        place in the free queue (0 = evicted next; null = referenced)."""
        order = {h: i for i, h in enumerate(self._free)}
        return pl.DataFrame(
            [{"block": b.id, "hash": b.hash.hex(), "parent": b.parent.hex() if b.parent else None,
              "token_ids": list(b.token_ids), "bytes": b.nbytes, "ref_cnt": b.ref_cnt,
              "hits": b.hits, "last_used": b.last_used, "free_position": order.get(h)}
             for h, b in self._blocks.items()],
            schema={"block": pl.Int64, "hash": pl.Utf8, "parent": pl.Utf8,
                    "token_ids": pl.List(pl.Int64), "bytes": pl.Int64, "ref_cnt": pl.Int64,
                    "hits": pl.Int64, "last_used": pl.Int64, "free_position": pl.Int64})

    def _pool(self) -> str:
        return "" if self.num_blocks is None else f" of {self.num_blocks}"

    def __repr__(self) -> str:
        return (f"PagedStore({len(self._blocks)}{self._pool()} blocks of {self.block_size}, "
                f"{len(self._free)} free, {self._bytes / 2**20:.1f} MiB, {self.evictions} evictions)")

    def _repr_html_(self) -> str:
        blocks = self.blocks_frame().drop("token_ids")
        return summary_html("PagedStore", f"{len(self._blocks)}{self._pool()} blocks of "
                            f"{self.block_size} tokens", f"{len(self._free)} free (cached)", f"{self._bytes / 2**20:.2f} MiB",
                            f"{self.evictions} evictions", note=self._unpageable,
                            body=table_html(blocks.columns, blocks.head(50).rows(), total=blocks.height))


def _why_unpageable(snap: Snapshot) -> str:
    for i, layer in enumerate(snap.layers):
        if layer.kind not in ("KVCache", "QuantizedKVCache"):
            return (f"PagedStore pages attention KV only: layer {i} is {layer.kind}, which cannot be "
                    "cut into token blocks; use RadixStore (the Engine checkpoints such models at "
                    "message boundaries)")
    return ""


def _bytes_per_token(snap: Snapshot) -> int:
    return sum(layer.nbytes for layer in snap.layers) // max(snap.offset, 1)
