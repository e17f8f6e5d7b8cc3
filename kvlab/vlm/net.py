"""RequestModel: a VLM bound to one request, with mlx-lm's model signature
``net(ids[1, L], cache=...) -> logits[1, L, vocab]``, so it runs on top of any restored kvlab
snapshot and inside mlx-lm's ``generate_step``.

Example:
    >>> vlm = kv.load_vlm("tiny")
    >>> msgs = list(kv.workloads.multimodal_mix(num_requests=2)[1].messages)  # one image part
    >>> net = vlm.for_request(kv.tokenise(vlm, msgs))
    >>> logits, cache = kv.prefill(net, net.tokens.ids)  # the vision tower runs once, here
    >>> net.vision_calls, cache[0].offset == len(net.tokens.ids)
    (1, True)
"""

from __future__ import annotations


from .. import _blas

_blas.load_fast_blas()  # before mlx.core

import mlx.core as mx  # noqa: E402

from ..errors import ImageError, KvlabError, TokenIdError  # noqa: E402
from ..primitives.display import summary_html, table_html  # noqa: E402
from ..primitives.tokens import ImageRef, Tokens  # noqa: E402
from .images import Pixels, image_parts, image_source, load_image, placeholder_runs  # noqa: E402


def cache_offset(cache) -> int:
    """How many tokens an mlx-lm prompt cache holds (0 for None or an empty cache): the offset of
    its first attention layer (a recurrent layer's state does not say; a sliding window's offset
    counts every token it has seen)."""
    from mlx_lm.models.cache import ArraysCache

    for c in cache or ():
        if not isinstance(c, ArraysCache):
            off = c.offset
            return int(off.max().item()) if isinstance(off, mx.array) else int(off or 0)
    return 0


def inside_image(images, position: int, arch: str) -> str:
    """Why a cache of a model whose image tokens attend to each other cannot be cut at
    ``position`` ('' when it can: at or outside every image's ends).

    Example:
        >>> inside_image([ImageRef("ab", 31, 37, 1)], 33, "gemma4")[:37]
        'position 33 is inside image 0 (tokens'
    """
    for i, im in enumerate(images):
        if im.token_start < position < im.token_end:
            return (f"position {position} is inside image {i} (tokens {im.token_start}:{im.token_end}): "
                    f"{arch} attends bidirectionally within an image; restore at or before token_start "
                    f"{im.token_start}")
    return ""


class RequestModel:
    """A VLM bound to one request: ``net(ids[1, L], cache=cache) -> logits[1, L, vocab]``.

    The chunk's first position is the cache's offset; where the chunk covers an image's
    placeholders it embeds that image's vision features (computed once, only if needed), and it
    passes the request's M-RoPE position ids explicitly (an M-RoPE model; others take plain
    positions from the cache offset: ``kvlab.vlm.archs``), so a prefill on top of a restored prefix
    (or past the prompt, when decoding) uses the same positions as a cold run. It holds no state
    of mlx-vlm's own (mlx-vlm's language model caches rope deltas between calls; this does not use
    that path). Quack like an mlx-lm model: ``kv.prefill(net, ids, cache)``, mlx-lm's
    ``generate_step(prompt, net, prompt_cache=cache)``.

    ``tokens=None`` is the VLM's text-only net (``vlm.net``): plain M-RoPE positions, and ids
    with image placeholders raise ImageError, since their pixels are not known. Every call
    rejects ids outside the vocabulary with TokenIdError (MLX gathers embeddings unchecked).
    """

    def __init__(self, vlm, tokens: Tokens | None):
        self.vlm = vlm
        self.tokens = tokens
        self.vision_calls = 0  # how many images went through the vision tower
        images = tokens.images if tokens is not None else ()
        self._features: dict[int, mx.array] = {}
        self._pixels: list[Pixels | None] = [None] * len(images)
        self._positions = None  # [3, 1, N] once computed (image requests only)
        self._delta = 0
        # Gemma 4: the tokens of one image see each other, so no chunk may start or end inside one
        self.bidirectional = bool(images) and vlm.adapter.bidirectional(vlm.module)
        if tokens is None:
            return
        found = placeholder_runs(tokens.ids, vlm.image_token_id)
        spans = [(im.token_start, im.token_end) for im in images]
        if found != spans:
            raise ImageError(
                f"these tokens have {len(found)} image placeholder runs but {len(spans)} images: "
                + ("token ids with image placeholders carry no pixels; tokenise the messages with "
                   "kv.tokenise(vlm, messages) so the images come along" if not spans else
                   f"placeholders at {found}, images at {spans}"))

    @property
    def images(self) -> tuple:
        return self.tokens.images if self.tokens is not None else ()

    @property
    def layers(self):
        return self.vlm.module.language_model.model.layers

    @property
    def net(self) -> "RequestModel":
        """Itself: a RequestModel runs ids (kvlab's Runnable interface)."""
        return self

    @property
    def vocab_size(self) -> int:
        return self.vlm.vocab_size

    def make_cache(self) -> list:
        return self.vlm.make_cache()

    def check_ids(self, ids, what: str = "token ids") -> tuple[int, ...]:
        """``ids`` as ints, or TokenIdError naming the first one outside ``[0, vocab_size)``."""
        return self.vlm.check_ids(ids, what)

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        if kwargs.get("input_embeddings") is not None:
            raise KvlabError("RequestModel computes its own input embeddings; do not pass them")
        adapter, module = self.vlm.adapter, self.vlm.module
        start, length = cache_offset(cache), inputs.shape[1]
        got = self._checked(inputs, start)
        if self.bidirectional:
            self._whole_images(start, start + length)
        embeds = adapter.embed(module, inputs)
        for i, ref in enumerate(self.images):
            a, b = max(start, ref.token_start), min(start + length, ref.token_end)
            if a >= b:
                continue
            if any(t != self.vlm.image_token_id for t in got[a - start: b - start]):
                raise ImageError(f"the ids being prefilled at {a}:{b} are not image {i}'s placeholders: "
                                 "this RequestModel was bound to other tokens (or the cache offset is "
                                 "not where these ids start)")
            feats = self._image_features(i)
            embeds[:, a - start: b - start] = feats[a - ref.token_start: b - ref.token_start][None].astype(embeds.dtype)
        positions = self.positions(start, start + length) if adapter.mrope else None
        return adapter.run(module, inputs, embeds, cache, positions)

    def chunk_length(self, cache, length: int) -> int:
        """How long the next prefill chunk on ``cache`` is when ``length`` tokens are proposed:
        longer when it would end inside an image whose tokens attend to each other (they run in
        one chunk), else ``length``. kvlab's prefill asks before every chunk
        (``kvlab.primitives.snapshots.chunks``)."""
        start = cache_offset(cache)
        if self.bidirectional:
            for im in self.images:
                if im.token_start < start + length < im.token_end:
                    return im.token_end - start
        return length

    def _whole_images(self, start: int, end: int) -> None:
        """ImageError unless the chunk start..end holds every image it touches whole: a chunk
        that starts inside an image runs on a cache whose image tokens may not have seen the
        rest; one that ends inside leaves such a cache behind."""
        arch = self.vlm.arch
        why = inside_image(self.images, start, arch)
        if why:
            raise ImageError(f"cannot prefill from {start}: {why}")
        for i, im in enumerate(self.images):
            if im.token_start < end < im.token_end:
                raise ImageError(f"a chunk {start}:{end} ends inside image {i} (tokens {im.token_start}:"
                                 f"{im.token_end}): {arch} attends bidirectionally within an image, so "
                                 f"its tokens run in one chunk; end the chunk at or before "
                                 f"{im.token_start}, or at or after {im.token_end}")

    def _checked(self, inputs: mx.array, start: int) -> list[int]:
        """The chunk's ids, or TokenIdError / ImageError before MLX gathers their embeddings."""
        if inputs.ndim != 2 or inputs.shape[0] != 1:
            raise TokenIdError(f"a RequestModel runs one sequence: ids of shape [1, L], got "
                               f"{tuple(inputs.shape)}")
        got = inputs[0].tolist()
        vocab = self.vlm.vocab_size
        if got and (min(got) < 0 or max(got) >= vocab):
            i = next(i for i, v in enumerate(got) if not 0 <= v < vocab)
            raise TokenIdError(f"token ids: position {start + i} holds id {got[i]}, outside this "
                               f"model's vocabulary [0, {vocab}); tokenise text with "
                               "kv.tokenise(vlm, ...)")
        if self.tokens is None and self.vlm.image_token_id in got:
            i = got.index(self.vlm.image_token_id)
            raise ImageError(f"token ids: position {start + i} is an image placeholder "
                             f"({self.vlm.image_token_id}), and token ids carry no pixels: run image "
                             "requests as Tokens, vlm.prefill(kv.tokenise(vlm, messages)) or "
                             "kv.Engine(vlm, store).run(messages), so the images come along")
        return got

    def positions(self, start: int, end: int) -> mx.array:
        """M-RoPE position ids [3, 1, end-start] of request positions start..end (end may pass the
        prompt: generated tokens continue from the last position, as in mlx-vlm's decode)."""
        n = len(self.tokens.ids) if self.tokens is not None else 0
        if self.images and self._positions is None:
            grids = mx.array([self._pixels_of(i).grid for i in range(len(self.images))])
            pos, delta = self.vlm.module.language_model.get_rope_index(
                mx.array(self.tokens.ids)[None], grids, None, None)
            self._positions, self._delta = pos.astype(mx.int32), int(delta.reshape(-1)[0].item())
        parts = []
        if self._positions is not None and start < n:
            parts.append(self._positions[:, :, start: min(end, n)])
        tail = start if self._positions is None else max(start, n)
        if tail < end:
            ramp = mx.arange(tail, end, dtype=mx.int32) + self._delta
            parts.append(mx.broadcast_to(ramp[None, None], (3, 1, end - tail)))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    def _pixels_of(self, i: int) -> Pixels:
        if self._pixels[i] is None:
            ref = self.images[i]
            p = self.vlm.memoised(ref.hash) or self._reload(i)
            if p.hash != ref.hash or p.tokens != ref.token_end - ref.token_start:
                raise ImageError(f"image {i} is no longer the image that was tokenised (its pixels "
                                 "changed); tokenise the request again")
            self._pixels[i] = p
        return self._pixels[i]

    def _reload(self, i: int) -> Pixels:
        """Re-read image i from the request's messages (its processed pixels were evicted)."""
        sources = image_parts(self.tokens.messages)
        if i >= len(sources):
            raise ImageError(f"image {i}'s pixels are not available: tokenise the messages with "
                             "kv.tokenise(vlm, messages)")
        mi, part = sources[i]
        return self.vlm.process_image(load_image(image_source(part, f"message {mi}"), f"message {mi}"))

    def _image_features(self, i: int) -> mx.array:
        if i not in self._features:
            p = self._pixels_of(i)
            feats = self.vlm.adapter.features(self.vlm.module, p.pixel_values, p.grid)
            if feats.shape[0] != p.tokens:
                raise ImageError(f"the vision tower made {feats.shape[0]} features for image {i}, "
                                 f"which has {p.tokens} placeholders: the model and its "
                                 "preprocessor_config.json do not match")
            self._features[i] = feats
            self.vision_calls += 1
        return self._features[i]

    def __repr__(self) -> str:
        ids = f"{len(self.tokens.ids)} ids" if self.tokens is not None else "text-only"
        return (f"RequestModel({self.vlm.name!r}, {ids}, {len(self.images)} images, "
                f"{self.vision_calls} vision calls)")

    def _repr_html_(self) -> str:
        rows = [(i, im.hash[:12], f"{im.token_start}:{im.token_end}") for i, im in enumerate(self.images)]
        return summary_html("RequestModel", repr(self), body=table_html(("image", "hash", "tokens"), rows))
