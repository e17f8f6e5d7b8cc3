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
    >>> want = oracle_logits(m, c, question, [next_id])   # a question block, then a decode step
    >>> got = continue_logits(m, c, question, [next_id])
    >>> float(mx.abs(want - got).max())                # ~1e-6
"""

from __future__ import annotations

import mlx.core as mx

from ..models import attention
from ..primitives.snapshots import prefill, restore, snapshot
from .apply import full_layers


def masked_attention(kept, cache, compressed_tokens: int, *, gather: bool = False):
    """An attention wrapper hiding, on the uncompressed ``cache``, the positions below
    ``compressed_tokens`` that ``kept`` (per layer [heads, n] positions, -1 unused; None: all)
    does not list; later positions are causal as usual.

    ``gather=True`` computes the same attention over the listed rows taken out of the full cache
    (then the new rows) instead of masking the others: the same keys and values in the compressed
    cache's layout, so a correct compressed cache matches it bit for bit (masking sums over other
    shapes, which moves float32 by rounding). A layer whose heads keep different counts is masked
    either way."""
    by_cache = {id(c): kept[i] for i, _, c in full_layers(cache) if kept[i] is not None}

    def wrapper(call, q, k, v, c, scale, mask, sinks):
        positions = by_cache.get(id(c))
        if positions is None:
            return call(q, k, v, c, scale, mask, sinks)
        rows, n = k.shape[2], q.shape[2]
        heads, group = positions.shape[0], q.shape[1] // positions.shape[0]
        holes = bool(mx.any(positions < 0).item())
        if gather and not holes:
            tail = mx.broadcast_to(mx.arange(compressed_tokens, rows, dtype=mx.int32),
                                   (heads, rows - compressed_tokens))
            idx = mx.concatenate([positions, tail], axis=1)
            k = mx.take_along_axis(k, idx[None, :, :, None], axis=2)
            v = mx.take_along_axis(v, idx[None, :, :, None], axis=2)
            return call(q, k, v, c, scale, "causal" if n > 1 else None, sinks)
        used = _keep(positions, rows) | (mx.arange(rows) >= compressed_tokens)[None]
        used = mx.repeat(used, group, axis=0)[None, :, None, :]
        causal = mx.arange(rows - n, rows)[:, None] >= mx.arange(rows)[None]
        return call(q, k, v, c, scale, used & causal, sinks)

    return wrapper


def _keep(positions: mx.array, rows: int) -> mx.array:
    """[heads, rows] True at every listed position (-1 entries list nothing)."""
    hits = mx.zeros((positions.shape[0], rows + 1), mx.int32)
    idx = mx.where(positions >= 0, positions, rows)  # unused entries land in a spare column
    hits = hits.at[mx.arange(positions.shape[0])[:, None], idx].add(1)
    return hits[:, :rows] > 0


def _run(model, cache, blocks, step) -> mx.array:
    out = [prefill(model, list(b), cache, all_logits=True, step=step)[0] for b in blocks]
    return mx.concatenate(out, axis=0)


def oracle_logits(model, compressed, *blocks, full=None, gather: bool = False, step: int | None = None) -> mx.array:
    """[sum of block lengths, vocab] float32: ``blocks`` run one forward each (a question block,
    then decode steps of one token) after the uncompressed prompt, the evicted positions masked per
    head. ``full``: a snapshot of the uncompressed prefill of the compressed part, if you have one
    (``Prefilled.snapshot``); otherwise it is prefilled again. ``gather``: see ``masked_attention``."""
    ids = compressed.token_ids
    cache = restore(full) if full is not None else prefill(model, ids[: compressed.tokens], step=step)[1]
    blocks = ([ids[compressed.tokens:]] if compressed.tokens < len(ids) else []) + [list(b) for b in blocks]
    # a press that keeps every row in place and masks (adakv) has the masked layout itself
    gather = gather and not compressed.press.masks_in_place
    with attention.wrapping(masked_attention(compressed.kept, cache, compressed.tokens, gather=gather)):
        logits = _run(model, cache, blocks, step)
    asked = sum(len(b) for b in blocks[1:]) if compressed.tokens < len(ids) else logits.shape[0]
    return logits[logits.shape[0] - asked:]


def continue_logits(model, compressed, *blocks, step: int | None = None) -> mx.array:
    """[sum of block lengths, vocab] float32: ``blocks`` run one forward each on a restored copy of
    the compressed cache (``compressed`` itself is not changed)."""
    return _run(model, restore(snapshot(compressed.cache)), blocks, step)
