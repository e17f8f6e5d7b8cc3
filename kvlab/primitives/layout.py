"""What a model's prompt cache is, layer by layer, and what each layer can do at a position.

Derived once from mlx-lm's own cache objects (``make_prompt_cache(model)``), never from a probe of
an empty cache: an empty sliding window says it can be trimmed, and so does a chunked cache that
loses the KV before its chunk start when trimmed (pitfalls 6 and 11 in the README).

Layer kinds:

- ``full``: attention KV for every token (KVCache, QuantizedKVCache, ConcatenateKVCache): can be
  cut back to any position and sliced into blocks;
- ``window``: a sliding window of W tokens (RotatingKVCache): can go back only until it wraps;
- ``recurrent``: a state that folds every token in (ArraysCache: conv, SSM, GatedDeltaNet):
  restorable only exactly where it was taken;
- ``chunked``: chunked attention of C tokens (ChunkedKVCache, Llama 4): can go back only while
  the chunk of the new position starts at or after what it still holds;
- ``compressed``: what a press kept of a full-attention layer (KeptKVCache,
  ``kvlab.primitives.kept_cache``): rows at their original positions, not one per token, so it is
  neither sliced into blocks nor cut back below the point it was compressed at;
- ``list``: several of these in one layer (CacheList); it can do what all its parts can.

Example:
    >>> layout = CacheLayout.of([KVCache(), RotatingKVCache(512), ArraysCache(2)])  # doctest: +SKIP
    >>> layout.kinds, layout.slices_into_blocks
    (('full', 'window', 'recurrent'), False)
"""

from __future__ import annotations

from dataclasses import dataclass

from .display import summary_html, table_html

KINDS = ("full", "window", "recurrent", "chunked", "compressed", "list", "unknown")
FULL_CLASSES = ("KVCache", "QuantizedKVCache", "ConcatenateKVCache")
KEPT_CLASSES = ("KeptKVCache", "QuantizedKeptKVCache")  # kvlab.primitives.kept_cache


@dataclass(frozen=True)
class LayerKind:
    """One layer's cache: its kind (``KINDS``), mlx-lm class, window or chunk size, and for a
    CacheList its parts."""

    kind: str
    cls: str
    window: int | None = None
    chunk: int | None = None
    quantized: bool = False
    parts: tuple["LayerKind", ...] = ()

    @property
    def label(self) -> str:
        if self.kind == "window":
            return f"sliding window of {self.window}"
        if self.kind == "chunked":
            return f"chunked attention of {self.chunk}"
        if self.kind == "list":
            return "CacheList of " + " + ".join(p.label for p in self.parts)
        if self.kind == "recurrent":
            return f"recurrent state ({self.cls})"
        if self.kind == "compressed":
            return ("quantized " if self.quantized else "") + "compressed full-attention KV"
        return ("quantized " if self.quantized else "") + ("full-attention KV" if self.kind == "full"
                                                            else f"{self.cls} (unknown to kvlab)")

    @property
    def kinds(self) -> frozenset[str]:
        """Every kind in this layer (a CacheList's parts' kinds)."""
        return frozenset().union(*(p.kinds for p in self.parts)) if self.parts else frozenset({self.kind})


def layer_kind(cache) -> LayerKind:
    """The LayerKind of one mlx-lm cache object."""
    cls = type(cache).__name__
    if cls in FULL_CLASSES:
        return LayerKind("full", cls, quantized=cls == "QuantizedKVCache")
    if cls == "RotatingKVCache":
        return LayerKind("window", cls, window=int(cache.max_size))
    if cls == "ChunkedKVCache":
        return LayerKind("chunked", cls, chunk=int(cache.chunk_size))
    if cls in KEPT_CLASSES:
        return LayerKind("compressed", cls, quantized=cls == "QuantizedKeptKVCache")
    if cls == "CacheList":
        return LayerKind("list", cls, parts=tuple(layer_kind(c) for c in cache.caches))
    if any(k.__name__ == "ArraysCache" for k in type(cache).__mro__):
        return LayerKind("recurrent", cls)
    return LayerKind("unknown", cls)


@dataclass(frozen=True)
class CacheLayout:
    """A model's cache, layer by layer (``layers``), and ``uncached`` layers that keep no cache of
    their own (Gemma 3n/4's shared-KV layers read another layer's KV; Nemotron-H's MLP layers
    have none)."""

    layers: tuple[LayerKind, ...]
    uncached: int = 0

    @classmethod
    def of(cls, cache, n_layers: int | None = None) -> "CacheLayout":
        """The layout of a prompt cache (the list ``make_prompt_cache`` returns); ``n_layers``,
        the model's layer count, tells how many layers have no cache."""
        layers = tuple(layer_kind(c) for c in cache)
        return cls(layers, max(0, (n_layers or len(layers)) - len(layers)))

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(layer.kind for layer in self.layers)

    @property
    def kind_set(self) -> frozenset[str]:
        """Every layer kind present, CacheList parts included."""
        return frozenset().union(*(layer.kinds for layer in self.layers)) if self.layers else frozenset()

    @property
    def slices_into_blocks(self) -> bool:
        """Every layer is full KV: the cache can be cut at any token and kept in blocks."""
        return self.kind_set <= {"full"}

    @property
    def restores_anywhere(self) -> bool:
        """A snapshot of this cache can be restored at any earlier position (full KV only)."""
        return self.slices_into_blocks

    def first_layer_not_in(self, kinds) -> tuple[int, LayerKind] | None:
        """The first layer with a kind outside ``kinds`` (what a store cannot hold), or None."""
        return next(((i, layer) for i, layer in enumerate(self.layers) if not layer.kinds <= set(kinds)), None)

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.label] = counts.get(layer.label, 0) + 1
        parts = [f"{n} x {label}" for label, n in counts.items()]
        if self.uncached:
            parts.append(f"{self.uncached} x no cache (shared-KV or MLP-only layer)")
        return ", ".join(parts) or "no layers"

    def __repr__(self) -> str:
        return f"CacheLayout({len(self.layers)} layers: {self.summary()})"

    def _repr_html_(self) -> str:
        rows = [(i, layer.label) for i, layer in enumerate(self.layers)]
        return summary_html("CacheLayout", self.summary(), body=table_html(["layer", "cache"], rows, limit=64))


def refusal(cls: str, state, keep: int) -> str | None:
    """Why a layer of mlx-lm class ``cls`` with ``state`` (its ``cache.state``) cannot be cut back
    to its first ``keep`` tokens (fewer than it holds) exactly, or None when it can.

    Example:
        >>> refusal("RotatingKVCache", (None, None, 600, 0, 512, 88), 500)
        'its sliding window of 512 has wrapped (offset 600): it cannot go back'
        >>> refusal("ChunkedKVCache", (None, None, 300, 128, 172), 200)
        'its chunked attention of 128 holds tokens from 172 on, but position 200 needs its chunk from 128'
        >>> refusal("KVCache", (None, None, 300), 7) is None
        True
    """
    if cls in FULL_CLASSES:
        return None
    if cls == "RotatingKVCache":
        offset, max_size = int(state[2]), int(state[4])
        if offset < max_size:
            return None
        return f"its sliding window of {max_size} has wrapped (offset {offset}): it cannot go back"
    if cls == "ChunkedKVCache":
        offset, chunk, start = int(state[2]), int(state[3]), int(state[4])
        need = (keep // chunk) * chunk  # the new position's chunk starts here
        if start <= need:
            return None
        return (f"its chunked attention of {chunk} holds tokens from {start} on, but position {keep} "
                f"needs its chunk from {need}")
    if cls in KEPT_CLASSES:
        offset, boundary = int(state[2]), int(state[-1])
        if keep >= boundary:
            return None
        return (f"it is a compressed cache of {boundary} tokens (a press kept its rows seeing all of them), "
                f"so cut to {keep} it is not the compression of the first {keep}: a compressed entry is "
                "reused only on a whole-context hit")
    if cls == "CacheList":
        for sub_state, sub_cls in state:
            why = refusal(sub_cls, sub_state, keep)
            if why:
                return f"its {sub_cls} part: {why}"
        return None
    return "it holds a recurrent state that can be restored only where it was taken" \
        if cls == "ArraysCache" else f"kvlab does not know how to cut a {cls} back"


def position_of(cls: str, state) -> int | None:
    """How many tokens a layer has seen, from its state (a window's or a chunked cache's offset,
    not what it still holds); None for a recurrent state, which does not say."""
    if cls in ("KVCache", "RotatingKVCache", "ChunkedKVCache", "QuantizedKVCache", "ConcatenateKVCache") + KEPT_CLASSES:
        return int(state[2]) if len(state) > 2 else None
    if cls == "CacheList":
        seen = [n for n in (position_of(c, s) for s, c in state) if n is not None]
        return max(seen) if seen else None
    return None
