"""``kv.compress``: prefill a prompt with kvlab's chunked prefill, then compress once with a press.

The order is the one that cannot corrupt attention: the whole compressed part is prefilled in
mlx-lm's steps (``step`` tokens at a time, 2048 by default) with every token attending to every
earlier one, and only then does the press pick rows, once, for every full-attention layer (never
per chunk, never before the step that produced the keys has attended to them). The last prefill
logits are therefore the uncompressed model's. With ``context_end`` only the first ``context_end``
tokens are compressed and the rest (a question) runs on the compressed cache, at its true
positions (kvpress's pipeline). ``kv_bits`` quantizes the cache after compressing it.

Example:
    >>> c = kv.compress(m, msgs, kv.press("snapkv", 0.5))
    >>> c.kept[0].shape, c.bytes_kept / c.bytes_full      # [kv_heads, n_kept], about 0.5
    >>> kv.prefill(m, question_ids, c.cache)              # the question on the compressed cache
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import mlx.core as mx

from ..errors import PressError, RequestError
from ..models import attention
from ..primitives import timing
from ..primitives.display import summary_html, table_html
from ..primitives.kv_format import check_settings, head_dims_of, maybe_quantize
from ..primitives.snapshots import make_cache, prefill, snapshot
from ..primitives.units import fmt_bytes
from .apply import apply_press, check_compressible, left_layers, ropes_of
from .base import Press
from .capture import Capture


@dataclass(frozen=True, eq=False)
class Compressed:
    """A compressed prompt: ``cache`` (mlx-lm cache list, full-attention layers as KeptKVCache),
    ``kept`` per layer ([kv_heads, n_kept] original positions, ascending; -1 pads a head that keeps
    fewer; None for a layer left as it was), ``logits`` [vocab] of the prompt's last position,
    ``context_logits`` of the last compressed one (the uncompressed model's: compression comes
    after), bytes of the cache's KV before and after (``bytes_positions``: the kept positions'
    index on top), the compressed layers and those left (``layers_left``: (layer, what))."""

    press: Press
    cache: list
    kept: tuple
    logits: mx.array
    context_logits: mx.array
    token_ids: tuple[int, ...]
    tokens: int
    bytes_full: int
    bytes_kept: int
    bytes_positions: int
    layers_compressed: tuple[int, ...]
    layers_left: tuple[tuple[int, str], ...]
    prefill_s: float = 0.0
    compress_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def kept_tokens(self) -> float:
        """Rows kept per head, averaged over the compressed layers' heads."""
        counts = [float(mx.sum(k >= 0).item()) / k.shape[0] for k in self.kept if k is not None]
        return sum(counts) / len(counts) if counts else float(self.tokens)

    def kept_mask(self) -> mx.array:
        """[compressed layers, kv_heads, tokens] 1.0 where that layer's head kept the position."""
        out = []
        for k in self.kept:
            if k is not None:
                heads = mx.arange(k.shape[0])[:, None]
                out.append(mx.zeros((k.shape[0], self.tokens)).at[heads, mx.maximum(k, 0)].add(
                    (k >= 0).astype(mx.float32)))
        return mx.stack(out)

    def share(self) -> mx.array:
        """[tokens] the share of (compressed layer, KV head) pairs that kept each position."""
        return mx.mean(self.kept_mask(), axis=(0, 1))

    def __repr__(self) -> str:
        return (f"Compressed({self.press.key}: {self.tokens} tokens -> {self.kept_tokens:.0f} rows per head "
                f"in {len(self.layers_compressed)} layers, {fmt_bytes(self.bytes_full)} -> "
                f"{fmt_bytes(self.bytes_kept)}" + (f", {len(self.layers_left)} layers left" if self.layers_left else "")
                + ")")

    def _repr_html_(self) -> str:
        rows = [(i, "compressed", int(mx.sum(k[0] >= 0).item()) if k is not None else "—") if k is not None
                else (i, dict(self.layers_left).get(i, "left"), "—") for i, k in enumerate(self.kept)]
        return summary_html("Compressed", self.press.key, f"{self.tokens} tokens",
                            f"{fmt_bytes(self.bytes_full)} -> {fmt_bytes(self.bytes_kept)}",
                            f"prefill {self.prefill_s:.3f} s, compress {self.compress_s:.3f} s",
                            body=table_html(["layer", "cache", "rows (head 0)"], rows, limit=64))


def prompt_ids(model, ids_or_messages) -> tuple[int, ...]:
    """The token ids of messages, text, token ids or Tokens, checked against the vocabulary."""
    x = ids_or_messages
    ids = getattr(x, "ids", None)
    if ids is None:
        if isinstance(x, (list, tuple)) and x and all(isinstance(i, int) for i in x):
            ids = x
        else:
            ids = model.tokenise(x).ids
    return tuple(model.check_ids(list(ids)))


def _end(context_end, n: int) -> int:
    if context_end is None:
        return n
    if isinstance(context_end, bool) or not isinstance(context_end, int) or not 1 <= context_end <= n:
        raise RequestError(f"context_end must be an int in 1..{n} (the tokens to compress), got {context_end!r}")
    return context_end


def compress(model, ids_or_messages, press: Press, *, context_end: int | None = None, step: int | None = None,
             kv_bits: int | None = None, kv_group_size: int = 64) -> Compressed:
    """Prefill, then compress with ``press`` (module docstring)."""
    if not isinstance(press, Press):
        raise PressError(f"compress takes a press (kv.press(name, ratio)), got {type(press).__name__}")
    if kv_bits is not None:
        check_settings(kv_bits, kv_group_size, head_dims_of(model))
    ids = prompt_ids(model, ids_or_messages)
    if not ids:
        raise RequestError("nothing to compress: the prompt has no tokens")
    end = _end(context_end, len(ids))
    cache = make_cache(model)
    layers = check_compressible(model, cache)
    left = left_layers(cache)
    needs = press.needs
    capture = None
    if needs.queries:
        ropes = ropes_of(model.net, layers) if needs.stats else {}
        capture = Capture({id(c): i for i, _, c in layers}, needs, ropes)
    t = timing.timed()
    with attention.wrapping(capture) if capture is not None else contextlib.nullcontext():
        context_logits, cache = prefill(model, ids[:end], cache, step=step)
    prefill_s = t.done(context_logits)
    full = snapshot(cache).nbytes
    t = timing.timed()
    kept, compressed = apply_press(press, cache, capture, layers)
    maybe_quantize(cache, kv_bits, kv_group_size, 0)
    compress_s = t.done([c.state for c in cache])
    positions = sum(int(k.nbytes) for k in kept if k is not None)
    held = snapshot(cache).nbytes - positions
    logits = context_logits
    if end < len(ids):
        logits, cache = prefill(model, ids[end:], cache, step=step, kv_bits=kv_bits, kv_group_size=kv_group_size)
    return Compressed(press, cache, tuple(kept), logits, context_logits, ids, end, full, held, positions,
                      compressed, left, prefill_s, compress_s)
