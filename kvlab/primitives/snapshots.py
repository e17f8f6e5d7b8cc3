"""Snapshots of mlx-lm prompt caches: prefill, snapshot, restore, trim, save, load_snapshot.

mlx-lm's KVCache writes into a preallocated buffer by slice assignment, and MLX's ``a[...] = b``
rewrites the Python array object ``a`` itself. A snapshot that kept the cache's own array objects
would therefore change under trim-then-append. Snapshots hold *new* array objects that are views
(``keys[..., :offset, :]``): creating them copies nothing, and a later write to the live buffer
copies on write instead of touching the view.

Example:
    >>> logits, cache = kv.prefill(m, ids_a)
    >>> snap = kv.snapshot(cache, model=m)
    >>> logits_b, cache = kv.prefill(m, ids_b, kv.restore(snap))
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol, Sequence, runtime_checkable

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import cache as mlx_cache

from .. import device
from ..errors import NotTrimmableError, SnapshotError
from .display import summary_html, table_html
from .kept_cache import CLASSES as KEPT_CLASSES
from .kv_format import maybe_quantize
from .layout import position_of, refusal
from .units import fmt_bytes

FORMAT_VERSION = 2  # 2: the digest covers the metadata too; "kv_format" names float or quantized KV
PREFILL_STEP = 2048


@dataclass(frozen=True)
class LayerState:
    """One layer's cache: mlx-lm class name, its ``state`` tree (array views), valid tokens, bytes."""

    kind: str
    state: Any
    tokens: int
    nbytes: int

    def __repr__(self) -> str:
        return f"LayerState({self.kind}, {self.tokens} tokens, {self.nbytes} B)"


@dataclass(frozen=True)
class Snapshot:
    """An immutable copy-free picture of a prompt cache after ``offset`` tokens.

    ``nbytes`` counts valid tokens only (never the preallocated buffer).
    """

    layers: tuple[LayerState, ...]
    offset: int
    token_ids: tuple[int, ...] | None = None
    fingerprint: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(layer.kind for layer in self.layers)

    @property
    def trimmable(self) -> bool:
        """It can drop its last token (not always more: see ``cuts_anywhere``)."""
        return not non_trimmable_layers(self)

    @property
    def cuts_anywhere(self) -> bool:
        """It can be cut back exactly to any earlier position, so it serves every prefix of
        itself. A chunked cache that has dropped its first chunks can drop its last token but
        cannot go back before the chunk it holds (pitfall 11)."""
        return not non_trimmable_layers(self, 0)

    def __repr__(self) -> str:
        kinds = sorted(set(self.kinds))
        return (f"Snapshot({self.offset} tokens, {len(self.layers)} layers {'/'.join(kinds)}, "
                f"{fmt_bytes(self.nbytes)})")

    def _repr_html_(self) -> str:
        rows = [(i, layer.kind, layer.tokens, fmt_bytes(layer.nbytes)) for i, layer in enumerate(self.layers)]
        return summary_html("Snapshot", f"{self.offset} tokens", fmt_bytes(self.nbytes),
                            f"model {(self.fingerprint or '—')[:12]}",
                            "trimmable" if self.trimmable else "not trimmable",
                            body=table_html(["layer", "cache", "tokens", "bytes"], rows, limit=64))


def _view(x):
    # A fresh array object over the same buffer (see module docstring for why it must be fresh).
    return x[...] if isinstance(x, mx.array) else x


def _views(tree):
    if isinstance(tree, list):
        return tuple(_views(t) for t in tree)
    return tree_map(_view, tree)


def _to_live(tree):
    # Fresh views again on restore, and fresh lists: mlx-lm writes into ArraysCache.cache in place,
    # so a list handed over as it is (a CacheList's recurrent part) would change the snapshot.
    if isinstance(tree, tuple):
        return tuple(_to_live(t) for t in tree)
    if isinstance(tree, list):
        return [_to_live(t) for t in tree]
    return _view(tree)


def _layer_state(c) -> LayerState:
    kind = type(c).__name__
    if isinstance(c, mlx_cache.KVCache) and type(c) is mlx_cache.KVCache:
        if c.keys is None:
            return LayerState(kind, (None, None, 0), 0, 0)
        k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        return LayerState(kind, (k, v, c.offset), c.offset, k.nbytes + v.nbytes)
    if type(c) is mlx_cache.QuantizedKVCache and c.keys is not None:
        # packed words, scales and biases all keep the token axis at -2: views of the valid tokens
        kq, vq = tree_map(lambda a: a[..., : c.offset, :], (c.keys, c.values))
        nbytes = sum(a.nbytes for a in kq + vq)
        return LayerState(kind, (kq, vq, c.offset, c.group_size, c.bits), c.offset, nbytes)
    if kind in KEPT_CLASSES:  # a press's rows: views of the rows it holds, at the true offset
        state = _views(c.state)
        return LayerState(kind, state, c.offset, c.nbytes + c.kept.nbytes)
    if isinstance(c, mlx_cache.ArraysCache):
        arrays, left_padding, lengths = c.state
        state = (tuple(_view(a) for a in arrays), _view(left_padding), _view(lengths))
        nbytes = sum(a.nbytes for a in arrays if a is not None)
        return LayerState(kind, state, 0, nbytes)
    state = _views(c.state)
    rotating = isinstance(c, mlx_cache.RotatingKVCache)
    tokens = min(c.offset, c.max_size) if rotating else int(getattr(c, "offset", 0) or 0)
    buffer_bytes = sum(a.nbytes for _, a in tree_flatten(state) if isinstance(a, mx.array))
    if rotating and c.keys is not None:
        # bytes of the valid window only, not of the preallocated ring
        per_token = (c.keys.nbytes + c.values.nbytes) / max(c.keys.shape[2], 1)
        buffer_bytes = int(per_token * tokens)
    return LayerState(kind, state, tokens, buffer_bytes)


def snapshot(cache: Sequence[Any], *, tokens=None, model=None) -> Snapshot:
    """An immutable snapshot of an mlx-lm prompt cache; costs O(layers), not O(tokens).

    Example:
        >>> snap = kv.snapshot(cache, tokens=ids, model=m)
        >>> snap.offset, snap.nbytes
    """
    if not isinstance(cache, (list, tuple)) or not cache:
        raise SnapshotError("snapshot() takes an mlx-lm prompt cache: the list that "
                            "mlx_lm.models.cache.make_prompt_cache(model) returns")
    layers = tuple(_layer_state(c) for c in cache)
    mx.eval([a for layer in layers for _, a in tree_flatten(layer.state) if isinstance(a, mx.array)])
    # the position the cache is at (a sliding window's offset, not the window it still holds)
    seen = [n for n in (position_of(layer.kind, layer.state) for layer in layers) if n is not None]
    ids = ids_of(tokens)
    if not seen:  # recurrent layers only (Mamba, RWKV): the state does not say what it has seen
        if ids is None:
            raise SnapshotError("this cache has recurrent layers only and does not say how many tokens "
                                "it has seen: pass tokens= (the ids it has run)")
        return Snapshot(layers, len(ids), ids, getattr(model, "fingerprint", None))
    offset = max(seen)
    if ids is not None and len(ids) != offset:
        raise SnapshotError(f"tokens has {len(ids)} ids but the cache holds {offset} tokens")
    return Snapshot(layers, offset, ids, getattr(model, "fingerprint", None))


def ids_of(tokens):
    return None if tokens is None else tuple(int(i) for i in getattr(tokens, "ids", tokens))


def restore(snap: Snapshot) -> list:
    """Fresh mlx-lm cache objects holding the snapshot; use with ``kv.prefill`` or
    ``mlx_lm.stream_generate(prompt_cache=...)``. The snapshot is never written to."""
    return [_live_cache(layer.kind, layer.state) for layer in snap.layers]


def _live_cache(kind: str, state):
    cls = getattr(mlx_cache, kind, None) or KEPT_CLASSES.get(kind)
    if cls is None:
        raise SnapshotError(f"unknown mlx-lm cache class {kind!r}; this mlx-lm is too old")
    if cls is mlx_cache.CacheList:  # built part by part: mlx-lm's own setter keeps a part's state as given
        return mlx_cache.CacheList(*(_live_cache(part_kind, part) for part, part_kind in state))
    state = _to_live(state)
    if issubclass(cls, mlx_cache.ArraysCache):
        # mlx-lm writes into ArraysCache.cache in place: a list of its own, whatever was stored
        state = (list(state[0]), state[1], state[2])
    if kind == "KVCache" and state[0] is None:
        return mlx_cache.KVCache()
    return cls.from_state(state)


def non_trimmable_layers(snap: Snapshot, keep: int | None = None) -> list[tuple[int, str, str]]:
    """(layer index, cache class, why) for every layer that cannot be cut back exactly to its
    first ``keep`` tokens (default: one fewer than it holds), as ``kvlab.primitives.layout`` says."""
    keep = snap.offset - 1 if keep is None else keep
    if keep >= snap.offset:
        return []
    bad = []
    for i, layer in enumerate(snap.layers):
        why = refusal(layer.kind, layer.state, max(keep, 0))
        if why:
            bad.append((i, layer.kind, why))
    return bad


def cut_refusal(snap: Snapshot, keep: int) -> str | None:
    """Why ``snap`` cannot be cut back exactly to its first ``keep`` tokens (its first layer that
    refuses, and how many more do), or None when it can.

    Example:
        >>> cut_refusal(snap, 585)  # a llama4 snapshot of 665 tokens  # doctest: +SKIP
        'layer 0 (ChunkedKVCache) cannot be trimmed to 585 tokens: its chunked attention of 32 ...'
    """
    bad = non_trimmable_layers(snap, keep)
    if not bad:
        return None
    i, kind, why = bad[0]
    return (f"layer {i} ({kind}) cannot be trimmed to {keep} tokens: {why}"
            + (f"; {len(bad) - 1} more such layers" if len(bad) > 1 else ""))


def trim(snap: Snapshot, n: int) -> Snapshot:
    """A new snapshot without the last ``n`` tokens.

    Example:
        >>> kv.trim(snap, 5).offset == snap.offset - 5
        True
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n > snap.offset:
        raise SnapshotError(f"cannot trim {n!r} tokens from a snapshot of {snap.offset}: "
                            f"n must be an int in 0..{snap.offset}")
    if n == 0:
        return snap
    why = cut_refusal(snap, snap.offset - n)
    if why:
        raise NotTrimmableError(why + ". Keep snapshots at the boundaries you need instead of trimming.")
    live = restore(snap)
    for c in live:
        c.trim(n)
    ids = snap.token_ids[: snap.offset - n] if snap.token_ids is not None else None
    return replace(snapshot(live), token_ids=ids, fingerprint=snap.fingerprint)


def compact(snap: Snapshot) -> Snapshot:
    """A copy whose arrays are exactly their valid size, what a store keeps: a snapshot's views keep
    mlx-lm's whole preallocated buffer alive. Its layers' ``nbytes`` are what the device holds for
    them (``kvlab.device.held_bytes``: the arrays' nbytes on CPU, allocator sizes on a GPU). Example: ``kept = kv.compact(snap)``."""
    # mx.array copies (mx.contiguous returns a one-KV-head view as it is), on CPU into fresh memory:
    device.before_copies()  # (kvlab.device.Device.clears_cache_for_copies says why, and where not)
    states = [tree_map(lambda x: mx.array(x) if isinstance(x, mx.array) else x, layer.state) for layer in snap.layers]
    mx.eval(held := [[a for _, a in tree_flatten(s) if isinstance(a, mx.array)] for s in states])
    return replace(snap, layers=tuple(LayerState(layer.kind, s, layer.tokens, device.held_bytes(h))
                                      for layer, s, h in zip(snap.layers, states, held)))


@runtime_checkable
class Runnable(Protocol):
    """A kvlab model (kv.Model, kv.VLModel): ``net`` runs token ids with mlx-lm's signature
    ``net(ids[1, L], cache=...) -> logits[1, L, vocab]``; ``make_cache()`` builds its cache;
    ``check_ids`` rejects ids outside its vocabulary. A VLM bound to one request (its net) is
    Runnable too; a bare mlx-lm module is accepted wherever a model is, its ids unchecked."""

    net: Any

    def make_cache(self) -> list: ...

    def check_ids(self, ids, what: str = "token ids") -> tuple[int, ...]: ...


def net_of(model):
    """What runs ids: a kvlab model's ``net``, or the net itself."""
    return model.net if isinstance(model, Runnable) else model


def make_cache(model) -> list:
    """A fresh mlx-lm prompt cache for ``model`` (a kvlab model or an mlx-lm net)."""
    return model.make_cache() if isinstance(model, Runnable) else mlx_cache.make_prompt_cache(model)


def _checked(model, ids) -> list[int]:
    ids = list(getattr(ids, "ids", ids))
    return list(model.check_ids(ids)) if isinstance(model, Runnable) else [int(i) for i in ids]


def chunks(net, n: int, cache, step: int | None = None):
    """The prefill chunks ``(start, end)`` of ``n`` ids, yielded one at a time as the cache fills:
    ``step`` (default PREFILL_STEP) tokens each (as mlx-lm's prefill), lengthened where the net
    says a chunk may not end (a VLM whose image tokens attend to each other runs each image in one chunk:
    ``RequestModel.chunk_length``).

    Example:
        >>> list(chunks(m.net, 5000, m.make_cache()))
        [(0, 2048), (2048, 4096), (4096, 5000)]
    """
    chunk_length = getattr(net, "chunk_length", None)  # only an image-bound VLM net has one
    step = PREFILL_STEP if step is None else int(step)
    if step < 1:
        raise SnapshotError(f"the prefill step must be >= 1 token, got {step}")
    start = 0
    while start < n:
        length = min(n - start, step)
        if chunk_length is not None:
            length = min(n - start, chunk_length(cache, length))
        yield start, start + length
        start += length


def advance(model, ids, cache, *, step: int | None = None, **kv_quant) -> list:
    """Run ``ids`` into ``cache`` without computing logits (as mlx-lm's generate_step prefill
    does: with a 150k vocabulary the output projection of every position dominates small models),
    ``step`` tokens at a time (default PREFILL_STEP).
    ``kv_bits=, kv_group_size=, quantized_kv_start=`` quantize the cache as ``prefill`` does."""
    net = net_of(model)
    ids = _checked(model, ids)
    for start, end in chunks(net, len(ids), cache, step):
        net(mx.array(ids[start:end])[None], cache=cache)
        mx.eval([c.state for c in maybe_quantize(cache, **kv_quant)])
    return cache


def prefill(model, ids, cache=None, *, all_logits: bool = False, kv_bits=None, kv_group_size=64,
            quantized_kv_start=0, step: int | None = None):
    """Run ``ids`` through the model on top of ``cache`` in steps of ``step`` tokens (default
    PREFILL_STEP, as mlx-lm's prefill does). Returns (last-position logits as float32 [vocab],
    cache); with
    ``all_logits=True`` the logits of every position of ``ids`` ([len(ids), vocab]). With
    ``kv_bits`` the cache list's layers become QuantizedKVCache as in mlx-lm's generate: after each
    step once their offset reaches ``quantized_kv_start`` (kvlab's default 0; mlx-lm's is 5000).

    Example:
        >>> logits, cache = kv.prefill(m, kv.tokenise(m, msgs).ids)
    """
    ids = _checked(model, ids)
    if not ids:
        raise SnapshotError("prefill needs at least one token id")
    net = net_of(model)
    cache = make_cache(model) if cache is None else cache
    quant = {"kv_bits": kv_bits, "kv_group_size": kv_group_size, "quantized_kv_start": quantized_kv_start}
    if not all_logits:
        advance(model, ids[:-1], cache, step=step, **quant)
        logits = net(mx.array(ids[-1:])[None], cache=cache)[0, -1].astype(mx.float32)
        mx.eval(logits, [c.state for c in maybe_quantize(cache, **quant)])
        return logits, cache
    pieces = []
    for start, end in chunks(net, len(ids), cache, step):
        pieces.append(net(mx.array(ids[start:end])[None], cache=cache)[0].astype(mx.float32))
        mx.eval(pieces[-1], [c.state for c in maybe_quantize(cache, **quant)])
    return mx.concatenate(pieces, axis=0), cache
