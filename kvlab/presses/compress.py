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
from dataclasses import dataclass

import mlx.core as mx

from ..errors import PressError, RequestError
from ..models import attention
from ..primitives import timing
from ..primitives.display import summary_html, table_html
from ..primitives.kv_format import check_settings, head_dims_of, maybe_quantize
from ..primitives.kept_cache import KeptBase
from ..primitives.snapshots import make_cache, prefill, restore, snapshot
from ..primitives.units import fmt_bytes
from .apply import apply_press, check_compressible, full_layers, left_layers, ropes_of
from .base import Needs, Press
from .capture import Capture
from .decoding import attach


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


class Prefilled:
    """A prompt prefilled once, uncompressed, with what ``presses`` read captured on the way:
    ``compress(press)`` then gives each press its own compressed copy (a sweep of presses and
    ratios pays for one prefill). ``kv.compress`` is ``Prefilled(model, x, [press]).compress(press)``.

    Example:
        >>> pre = Prefilled(m, ids, [kv.press("snapkv", 0.5), kv.press("knorm", 0.5)])
        >>> [pre.compress(kv.press(n, r)).bytes_kept for n in ("snapkv", "knorm") for r in (0.25, 0.5)]
    """

    def __init__(self, model, ids_or_messages, presses=(), *, context_end: int | None = None,
                 step: int | None = None):
        self.model, self.step = model, step
        self.ids = prompt_ids(model, ids_or_messages)
        if not self.ids:
            raise RequestError("nothing to compress: the prompt has no tokens")
        self.end = _end(context_end, len(self.ids))
        cache = make_cache(model)
        layers = check_compressible(model, cache)
        self.left = left_layers(cache)
        needs = Needs()
        for p in presses:
            needs = needs | _checked(p).needs
        self.needs, self.capture = needs, None
        if needs.queries:
            ropes = ropes_of(model.net, layers) if needs.stats else {}
            self.capture = Capture({id(c): i for i, _, c in layers}, needs, ropes)
        t = timing.timed()
        with attention.wrapping(self.capture) if self.capture is not None else contextlib.nullcontext():
            self.context_logits, cache = prefill(model, self.ids[: self.end], cache, step=step)
        self.prefill_s = t.done(self.context_logits)
        self.snapshot = snapshot(cache)

    def compress(self, press: Press, *, kv_bits: int | None = None, kv_group_size: int = 64) -> Compressed:
        """A compressed copy of the prefilled prompt (the prefill itself is left as it is)."""
        press = _checked(press)
        if kv_bits is not None:
            check_settings(kv_bits, kv_group_size, head_dims_of(self.model))
        cache = restore(self.snapshot)
        t = timing.timed()
        kept, compressed = apply_press(press, cache, self.capture, full_layers(cache))
        cap = self.capture
        attach(press, cache, cap.scale if cap else None, cap.queries if cap else None)
        maybe_quantize(cache, kv_bits, kv_group_size, 0)
        compress_s = t.done([c.state for c in cache])
        positions = sum(int(k.nbytes) for k in kept if k is not None)
        held = snapshot(cache).nbytes - sum(int(c.kept.nbytes) for c in _kept_caches(cache))
        logits = self.context_logits
        if self.end < len(self.ids):
            logits, cache = prefill(self.model, self.ids[self.end:], cache, step=self.step, kv_bits=kv_bits,
                                    kv_group_size=kv_group_size)
        return Compressed(press, cache, tuple(kept), logits, self.context_logits, self.ids, self.end,
                          self.snapshot.nbytes, held, positions, compressed, self.left, self.prefill_s, compress_s)

    def __repr__(self) -> str:
        return f"Prefilled({len(self.ids)} tokens, {self.end} to compress, {self.prefill_s:.3f} s)"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def compress(model, ids_or_messages, press: Press, *, context_end: int | None = None, step: int | None = None,
             kv_bits: int | None = None, kv_group_size: int = 64) -> Compressed:
    """Prefill, then compress with ``press`` (module docstring)."""
    return Prefilled(model, ids_or_messages, [_checked(press)], context_end=context_end,
                     step=step).compress(press, kv_bits=kv_bits, kv_group_size=kv_group_size)


def _checked(press) -> Press:
    if not isinstance(press, Press):
        raise PressError(f"a press is made with kv.press(name, ratio), got {type(press).__name__}")
    return press


def _kept_caches(cache):
    for c in cache:
        for part in getattr(c, "caches", (c,)):
            if isinstance(part, KeptBase):
                yield part
