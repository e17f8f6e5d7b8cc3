"""The exact oracle: what a compressed cache must compute, from the uncompressed one.

A compressed cache is right when every later query attends to exactly the rows its head kept, at
their original positions. The same thing can be computed without the compressed cache at all:
prefill the prompt uncompressed, then run the continuation with an attention wrapper
(``kvlab.models.attention.wrapping``) that masks, per KV head, the positions the press evicted.
``oracle_logits`` does that; ``continue_logits`` runs the same continuation on the compressed
cache. Both go through the same attention kernel (whichever ``attention.set_kernel`` chose), so
they agree to float rounding (kvlab's tests: float32 within 1e-5) for any correct cache, and a
cache with a stale row, a wrong RoPE offset or a wrong mask moves the logits far beyond it.

Example:
    >>> c = kv.compress(m, ids, kv.press("snapkv", 0.5))
    >>> want = oracle_logits(m, c, question)           # [len(question), vocab]
    >>> got = continue_logits(m, c, question)
    >>> float(mx.abs(want - got).max())                # ~1e-6
"""

from __future__ import annotations

import mlx.core as mx

from ..models import attention
from ..primitives.snapshots import make_cache, prefill, restore, snapshot
from .apply import full_layers


def masked_attention(kept, cache, compressed_tokens: int):
    """An attention wrapper hiding, on the uncompressed ``cache``, the positions below
    ``compressed_tokens`` that ``kept`` (per layer [heads, n] positions, -1 unused; None: all)
    does not list; later positions are causal as usual."""
    by_cache = {id(c): kept[i] for i, _, c in full_layers(cache) if kept[i] is not None}

    def wrapper(call, q, k, v, c, scale, mask, sinks):
        positions = by_cache.get(id(c))
        if positions is None:
            return call(q, k, v, c, scale, mask, sinks)
        rows, n = k.shape[2], q.shape[2]
        heads = positions.shape[0]
        keep = _keep(positions, rows) | (mx.arange(rows) >= compressed_tokens)[None]
        keep = mx.repeat(keep, q.shape[1] // heads, axis=0)[None, :, None, :]
        causal = mx.arange(rows - n, rows)[:, None] >= mx.arange(rows)[None]
        return call(q, k, v, c, scale, keep & causal, sinks)

    return wrapper


def _keep(positions: mx.array, rows: int) -> mx.array:
    """[heads, rows] True at every listed position (-1 entries list nothing)."""
    hits = mx.zeros((positions.shape[0], rows + 1), mx.int32)
    idx = mx.where(positions >= 0, positions, rows)  # unused entries land in a spare column
    hits = hits.at[mx.arange(positions.shape[0])[:, None], idx].add(1)
    return hits[:, :rows] > 0


def oracle_logits(model, compressed, continuation, *, step: int | None = None) -> mx.array:
    """[len(continuation), vocab] float32: the continuation after the uncompressed prompt (its
    compressed part, then the rest) with the evicted positions masked per head (module docstring)."""
    cache = make_cache(model)
    ids = compressed.token_ids
    prefill(model, ids[: compressed.tokens], cache, step=step)
    rest = list(ids[compressed.tokens:]) + list(continuation)
    with attention.wrapping(masked_attention(compressed.kept, cache, compressed.tokens)):
        logits, _ = prefill(model, rest, cache, all_logits=True, step=step)
    return logits[len(rest) - len(continuation):]


def continue_logits(model, compressed, continuation, *, step: int | None = None) -> mx.array:
    """[len(continuation), vocab] float32: the continuation on a restored copy of the compressed
    cache (``compressed`` itself is not changed)."""
    cache = restore(snapshot(compressed.cache))
    logits, _ = prefill(model, list(continuation), cache, all_logits=True, step=step)
    return logits
