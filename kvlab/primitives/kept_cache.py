"""Position-preserving KV caches: what a press leaves of a full-attention layer.

A press keeps, per KV head, some of the T rows a layer's KVCache held. The cache that results must
not confuse two numbers mlx-lm's KVCache keeps equal: ``offset`` is the true length (the RoPE
offset of the next token, T plus every token appended since) while ``rows`` is what the buffer
holds (the kept rows plus the appended ones). Each kept row's original position is kept, per head
(``kept`` [heads, n], ascending; -1 marks a row a head does not use when heads keep different
counts: adakv). Rows appended after the compression sit at positions ``boundary .. offset-1``.

- ``make_mask`` counts rows, not the offset: a later query block sees every kept row and its own
  rows causally (``"causal"`` aligns the block with the last rows, as mlx-lm's KVCache does).
- No ``merge``: mlx-lm's batching server would swap in a plain BatchKVCache of the kept rows and
  lose the positions; a model whose caches lack ``merge`` is served one request at a time.
- ``trim`` drops only rows appended after the compression (positions at or past the new offset);
  below ``boundary`` it refuses: the kept set was chosen with every token up to ``boundary``, so a
  shorter cache is not the compression of a shorter prompt. ``is_trimmable`` says whether any
  appended row is there to drop.
- ``state`` carries the rows, the offset, the kept positions and the boundary, so save/load,
  snapshot/restore and the disk tier round-trip exactly (``kvlab.primitives.snapshots``).
- Rows a head does not use (-1) are masked by ``attention_mask``, which kvlab's attention
  dispatcher (``kvlab.models.attention``) calls with every query block.

``QuantizedKeptKVCache`` is the same after ``to_quantized`` (compressed first, then quantized,
as mlx-lm quantizes a KVCache): packed words, scales and biases per row.

Example:
    >>> c = KeptKVCache.of(keys, values, kept, offset=600)     # keys [1, H, n, D], kept [H, n]
    >>> c.offset, c.rows, c.kept_positions().shape
    (600, 300, (3, 300))
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache, _BaseCache, create_attention_mask

from ..errors import NotTrimmableError, QuantizationError
from .display import summary_html

STEP = 256  # rows added to the buffer at a time, as mlx-lm's KVCache


class KeptBase(_BaseCache):
    """Offset, rows, kept positions and boundary, shared by the float and the quantized cache."""

    offset: int
    boundary: int
    kept: mx.array  # [H, n] int32: original position of each kept row, -1 for a row a head does not use
    on_append = None  # a live cache's decode-time hooks (kvlab.presses.decoding), never saved:
    on_attend = None  # before new rows go in, and with every query block

    @property
    def rows(self) -> int:
        """Rows each head holds: the kept ones plus those appended since the compression."""
        return int(self.kept.shape[1]) + self.offset - self.boundary

    @property
    def appended(self) -> int:
        return self.offset - self.boundary

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return False

    def is_trimmable(self) -> bool:
        return self.offset > self.boundary

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens: only rows appended after the compression can go."""
        n = min(self.offset, int(n))
        if n > self.appended:
            raise NotTrimmableError(
                f"a compressed cache of {self.boundary} tokens (+{self.appended} appended) cannot drop "
                f"{n}: its kept rows were chosen with every token up to {self.boundary}, so cutting "
                "below that is not the compression of a shorter prompt; compress the shorter prompt")
        self.offset -= n
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise ValueError("a compressed cache holds a full-attention layer; it has no window")
        return create_attention_mask(N, offset=self.rows, return_array=return_array, window_size=None)

    def kept_positions(self) -> mx.array:
        """[H, n] the original positions of the kept rows (-1: a row that head does not use)."""
        return self.kept

    def positions(self) -> mx.array:
        """[H, rows] the original position of every row (kept, then appended)."""
        tail = mx.broadcast_to(mx.arange(self.boundary, self.offset, dtype=mx.int32),
                               (self.kept.shape[0], self.appended))
        return mx.concatenate([self.kept, tail], axis=1)

    @property
    def has_holes(self) -> bool:
        return bool(mx.any(self.kept < 0).item())

    def attention_mask(self, mask, queries: mx.array):
        """``mask`` with the rows a head does not use hidden from its query heads (called by
        kvlab's attention dispatcher for every query block); ``mask`` itself when every row is used."""
        if self.on_attend is not None:
            self.on_attend(queries)
        if not getattr(self, "_holes", False):
            return mask
        n_q, heads, rows = queries.shape[-2], queries.shape[1], self.rows
        used = mx.concatenate([self.kept >= 0, mx.ones((self.kept.shape[0], self.appended), mx.bool_)], axis=1)
        used = mx.repeat(used, heads // self.kept.shape[0], axis=0)[None, :, None, :]
        if mask is None:
            return used
        if isinstance(mask, str):
            return used & (mx.arange(rows - n_q, rows)[:, None] >= mx.arange(rows)[None])
        if mask.dtype == mx.bool_:
            return used & mask
        return mx.where(used, mask, mx.array(-float("inf"), mask.dtype))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.kept.shape[1]} kept rows of {self.boundary} tokens per head, "
                f"{self.kept.shape[0]} heads, +{self.appended} appended, offset {self.offset})")

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)

    def set_kept(self, kept, offset, boundary) -> None:
        self.kept = kept.astype(mx.int32)
        self.offset, self.boundary = int(offset), int(boundary)
        self._holes = bool(mx.any(self.kept < 0).item()) if self.kept.size else False


class KeptKVCache(KeptBase):
    """A full-attention layer's KV after a press: ``kept`` rows per head at their original
    positions, then the rows appended since (module docstring)."""

    step = STEP

    def __init__(self, keys: mx.array, values: mx.array, kept: mx.array, offset: int, boundary: int | None = None):
        self.keys, self.values = keys, values
        self.set_kept(kept, offset, offset if boundary is None else boundary)

    @classmethod
    def of(cls, keys, values, kept, *, offset: int) -> "KeptKVCache":
        """The cache of ``keys``/``values`` [B, H, n, D] kept at ``kept`` [H, n] out of ``offset`` tokens."""
        return cls(keys, values, kept, offset)

    def update_and_fetch(self, keys, values):
        if self.on_append is not None:
            self.on_append(self)  # a decoding press may compress before the next rows go in
        prev, n = self.rows, keys.shape[2]
        if prev + n > self.keys.shape[2]:
            grow = (self.step + n - 1) // self.step * self.step
            k_new = mx.zeros((*keys.shape[:2], grow, keys.shape[3]), keys.dtype)
            v_new = mx.zeros((*values.shape[:2], grow, values.shape[3]), values.dtype)
            self.keys = mx.concatenate([self.keys[..., :prev, :], k_new], axis=2)
            self.values = mx.concatenate([self.values[..., :prev, :], v_new], axis=2)
        self.keys[..., prev: prev + n, :] = keys
        self.values[..., prev: prev + n, :] = values
        self.offset += n
        return self.keys_and_values()

    def keys_and_values(self):
        rows = self.rows
        return self.keys[..., :rows, :], self.values[..., :rows, :]

    @property
    def state(self):
        k, v = self.keys_and_values()
        return k, v, self.offset, self.kept, self.boundary

    @state.setter
    def state(self, v):
        self.keys, self.values, offset, kept, boundary = v
        self.set_kept(kept, offset, boundary)

    @property
    def meta_state(self):
        return tuple(map(str, (self.offset, self.boundary)))

    @property
    def nbytes(self) -> int:
        k, v = self.keys_and_values()
        return k.nbytes + v.nbytes

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "QuantizedKeptKVCache":
        if self._holes:
            raise QuantizationError("a compressed cache whose heads keep different counts (adakv) cannot "
                                    "be quantized: mlx-lm's quantized attention takes no per-head mask")
        k, v = self.keys_and_values()
        return QuantizedKeptKVCache((mx.quantize(k, group_size=group_size, bits=bits),
                                     mx.quantize(v, group_size=group_size, bits=bits)),
                                    self.kept, self.offset, self.boundary, group_size, bits)


class QuantizedKeptKVCache(KeptBase):
    """A KeptKVCache quantized as mlx-lm's QuantizedKVCache quantizes a KVCache: every row,
    kept or appended later, as packed words, scales and biases (``bits``, ``group_size``)."""

    step = STEP

    def __init__(self, kv, kept, offset, boundary, group_size: int = 64, bits: int = 8):
        self.keys, self.values = kv
        self.group_size, self.bits = group_size, bits
        self.set_kept(kept, offset, boundary)

    def update_and_fetch(self, keys, values):
        if self.on_append is not None:
            self.on_append(self)
        prev, n = self.rows, keys.shape[2]
        if prev + n > self.keys[0].shape[2]:
            grow = (self.step + n - 1) // self.step * self.step

            def expand(x):
                return mx.concatenate([x[..., :prev, :], mx.zeros((*x.shape[:2], grow, x.shape[3]), x.dtype)], axis=2)

            self.keys, self.values = tuple(map(expand, self.keys)), tuple(map(expand, self.values))
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev: prev + n, :] = qk[i]
            self.values[i][..., prev: prev + n, :] = qv[i]
        self.offset += n
        return self.keys_and_values()

    def keys_and_values(self):
        rows = self.rows
        return tuple(x[..., :rows, :] for x in self.keys), tuple(x[..., :rows, :] for x in self.values)

    @property
    def state(self):
        k, v = self.keys_and_values()
        return k, v, self.offset, self.group_size, self.bits, self.kept, self.boundary

    @state.setter
    def state(self, v):
        self.keys, self.values, offset, self.group_size, self.bits, kept, boundary = v
        self.keys, self.values = tuple(self.keys), tuple(self.values)
        self.set_kept(kept, offset, boundary)

    @property
    def meta_state(self):
        return tuple(map(str, (self.offset, self.group_size, self.bits, self.boundary)))

    @property
    def nbytes(self) -> int:
        k, v = self.keys_and_values()
        return sum(a.nbytes for a in k + v)


# the cache classes kvlab adds to mlx-lm's, by name (snapshots restore a layer by its class name)
CLASSES = {"KeptKVCache": KeptKVCache, "QuantizedKeptKVCache": QuantizedKeptKVCache}
QUANTIZED = {QuantizedKVCache.__name__, QuantizedKeptKVCache.__name__}
