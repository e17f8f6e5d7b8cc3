"""VLModel: a loaded mlx-vlm model with kvlab's model interface (``tokenise``, ``for_request``,
``net``, ``check_ids``, ``vocab_size``, ``make_cache``), so the Engine, the stores and
``kv.prefill`` treat it as they treat a text model.

Example:
    >>> vlm = kv.load_vlm("tiny")
    >>> vlm.kind, vlm.arch, len(vlm.make_cache())
    ('vlm', 'qwen2_vl', 4)
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

from .. import _blas

_blas.load_fast_blas()  # before mlx.core

import mlx.core as mx  # noqa: E402

from ..errors import ImageError, KvlabError, TemplateError  # noqa: E402
from ..models.loading import Model  # noqa: E402
from ..primitives.chat_template import (char_to_token_span, encode_with_offsets,  # noqa: E402
                                        has_content_lists, is_messages, message_char_spans, render,
                                        validate_messages)
from ..primitives.tokens import ImageRef, Span, Tokens  # noqa: E402
from .archs import Adapter, adapter_for  # noqa: E402
from .images import Pixels, image_hash, image_source, load_image, placeholder_runs  # noqa: E402
from .net import RequestModel, cache_offset, inside_image  # noqa: E402

IMAGE_MEMO = 64  # processed images kept per model (keyed by pixel hash)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)  # Model's repr and table, named VLModel
class VLModel(Model):
    """A loaded mlx-vlm model (``kind="vlm"``): ``.model`` is the mlx-vlm module, ``.tokenizer`` an
    mlx-lm TokenizerWrapper, ``.processor`` the mlx-vlm processor. Its cache is mlx-lm KVCache
    objects (one per language-model layer), so kvlab snapshots and stores work unchanged.

    ``net`` runs text-only token ids (``kv.prefill(vlm, ids)``); an image request runs through
    ``for_request(tokens)``, the net bound to its images (``vlm.prefill(tokens)``, the Engine).

    Example:
        >>> vlm = kv.load_vlm("tiny"); vlm.kind, vlm.arch, len(vlm.make_cache())
        ('vlm', 'qwen2_vl', 4)
    """

    processor: Any = None
    _memo: OrderedDict = dataclasses.field(default_factory=OrderedDict, repr=False)

    @property
    def adapter(self) -> Adapter:
        """What is specific to this architecture (``kvlab.vlm.archs``)."""
        return adapter_for(self.arch)

    @property
    def image_token(self) -> str:
        return self.adapter.image_token

    @property
    def image_token_id(self) -> int:
        return int(self.module.config.image_token_id)

    @property
    def num_layers(self) -> int:
        return len(self.module.language_model.model.layers)

    def make_cache(self) -> list:
        """A fresh mlx-lm prompt cache of this VLM's language model (mlx-vlm's own cache classes
        mapped onto mlx-lm's, which kvlab's snapshots and stores know)."""
        return self.adapter.make_cache(self.module)

    @property
    def net(self) -> RequestModel:
        """The language model for text-only ids, with mlx-lm's signature
        ``net(ids[1, L], cache=...) -> logits``; image placeholder ids raise ImageError (their
        pixels come with ``for_request(tokens)``). mlx-vlm's own module stays in ``.model``."""
        return RequestModel(self, None)

    # -- tokenising -------------------------------------------------------------------------------
    def tokenise(self, messages_or_text, *, add_generation_prompt: bool = True, **template_kwargs) -> Tokens:
        """Text as a text model does; a conversation with image parts through ``tokenise_images``."""
        if is_messages(messages_or_text) and has_content_lists(messages_or_text):
            return self.tokenise_images(messages_or_text, add_generation_prompt=add_generation_prompt,
                                        **template_kwargs)
        return super().tokenise(messages_or_text, add_generation_prompt=add_generation_prompt,
                                **template_kwargs)

    def tokenise_images(self, messages, *, add_generation_prompt=True, **template_kwargs) -> Tokens:
        """Tokens for a conversation with image parts: each image's placeholder expanded to its
        token count, with ``images`` = ImageRef(pixel hash, placeholder span, message index).
        ``kv.tokenise(vlm, messages)`` calls this when a message has an image part.
        """
        messages = validate_messages(messages)
        plain, images = [], []  # template-ready messages; (message index, PIL image)
        for i, m in enumerate(messages):
            content = m["content"]
            if isinstance(content, str):
                plain.append(m)
                continue
            if not isinstance(content, (list, tuple)):
                raise TemplateError(f"message {i} content must be a string or a list of parts like "
                                    f"{{'type': 'text', 'text': ...}}, got {type(content).__name__}")
            parts = []
            for j, part in enumerate(content):
                where = f"message {i} part {j}"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("image", "image_url"):
                    images.append((i, load_image(image_source(part, where), where)))
                    parts.append({"type": "image"})
                elif kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                else:
                    raise TemplateError(f"{where} must be {{'type': 'text', 'text': str}} or "
                                        f"{{'type': 'image', 'image': ...}}, got {part!r:.80} "
                                        "(videos and audio are not supported)")
            plain.append({**m, "content": parts})
        text = render(self.tokenizer, plain, add_generation_prompt=add_generation_prompt,
                      **template_kwargs)
        token = self.image_token
        if text.count(token) != len(images):
            raise TemplateError(
                f"the chat template rendered {text.count(token)} image placeholders ({token}) for "
                f"{len(images)} image parts; each image part needs exactly one placeholder: use the "
                "model's own chat template and do not write image tokens into message text")
        pixels = [self.process_image(img) for _, img in images]
        pieces, moves, pos = [], [], 0  # moves: (char index of a placeholder, characters it grew)
        for p in pixels:
            k = text.index(token, pos)
            pieces += [text[pos:k], token * p.tokens]
            moves.append((k, (p.tokens - 1) * len(token)))
            pos = k + len(token)
        full = "".join(pieces) + text[pos:]
        ids, offsets = encode_with_offsets(self.tokenizer, full)
        runs = placeholder_runs(ids, self.image_token_id)
        if [e - s for s, e in runs] != [p.tokens for p in pixels]:
            raise ImageError(f"the processor made images of {[p.tokens for p in pixels]} tokens but the "
                             f"prompt has placeholder runs of {[e - s for s, e in runs]}: the tokenizer "
                             "and image processor of this model folder do not match")
        self.check_ids(ids)
        refs = tuple(ImageRef(p.hash, s, e, mi) for (s, e), (mi, _), p in zip(runs, images, pixels))

        def moved(c: int) -> int:
            return c + sum(grow for k, grow in moves if k < c)

        spans = []
        for i, (c0, c1) in enumerate(message_char_spans(self.tokenizer, plain, text, template_kwargs)):
            c0, c1 = moved(c0), moved(c1)
            t0, t1 = char_to_token_span(offsets, c0, c1)
            spans.append(Span(i, plain[i]["role"], t0, t1, c0, c1))
        return Tokens(ids, full, tuple(spans), offsets, tuple(messages), refs, self.tokenizer,
                      tuple(sorted(template_kwargs.items())))

    def process_image(self, image) -> Pixels:
        """Pixel patches, grid and token count of one image (memoised by pixel hash)."""
        img = load_image(image)
        h = image_hash(img)
        if h in self._memo:
            self._memo.move_to_end(h)
            return self._memo[h]
        try:
            values, grid, tokens = self.adapter.process(self.processor.image_processor, img)
        except Exception as e:  # the numpy processors raise ValueError/IndexError/... on odd sizes
            raise ImageError(f"the image processor rejected a {img.size[0]}x{img.size[1]} image "
                             f"({type(e).__name__}: {e}); resize it to a usual aspect ratio") from e
        pixels = Pixels(h, values, grid, tokens)
        self._memo[h] = pixels
        while len(self._memo) > IMAGE_MEMO:
            self._memo.popitem(last=False)
        return pixels

    def memoised(self, image_hash: str) -> Pixels | None:
        """The processed pixels of the image with this pixel hash, if still memoised."""
        return self._memo.get(image_hash)

    def restorable_limit(self, tokens, n: int) -> tuple[int, str]:
        """The largest position <= n at which a cache of ``tokens`` can be restored exactly, and
        why it is less than n ('' when it is n). The reuse core asks every model this: a model
        whose image tokens attend to each other (gemma4) is never restored inside an image.

        Example:
            >>> kv.load_vlm("tiny:gemma4").restorable_limit(toks, 33)           # doctest: +SKIP
            (31, 'position 33 is inside image 0 (tokens 31:37): gemma4 attends bidirectionally ...')
        """
        images = getattr(tokens, "images", ()) or ()
        why = inside_image(images, n, self.arch) if images and self.adapter.bidirectional(self.module) else ""
        if not why:
            return n, ""
        return next(im.token_start for im in images if im.token_start < n < im.token_end), why

    # -- running ----------------------------------------------------------------------------------
    def for_request(self, tokens: Tokens) -> RequestModel:
        """This model bound to one request (its images and M-RoPE positions): the Engine's hook."""
        return RequestModel(self, tokens)

    def prefill(self, tokens: Tokens, cache=None, *, all_logits: bool = False):
        """Run ``tokens`` from the cache's offset to the end (a cold run when ``cache`` is None).
        Returns (logits, cache) like ``kv.prefill``.

        Example:
            >>> vlm = kv.load_vlm("tiny")
            >>> toks = kv.tokenise(vlm, list(kv.workloads.multimodal_mix(num_requests=2)[1].messages))
            >>> logits, cache = vlm.prefill(toks)                                  # cold
            >>> warm, _ = vlm.prefill(toks, kv.restore(kv.trim(kv.snapshot(cache), 10)))  # last 10
            >>> float(mx.abs(warm - logits).max()) <= 1e-4
            True
        """
        from ..primitives.snapshots import prefill

        if not isinstance(tokens, Tokens):
            raise KvlabError(f"vlm.prefill takes the Tokens of a request (kv.tokenise(vlm, messages)), "
                             f"not a {type(tokens).__name__}: an image request's pixels come with its "
                             "Tokens; use kv.prefill(vlm, ids) for text-only token ids")
        net = self.for_request(tokens)
        cache = self.make_cache() if cache is None else cache
        start = cache_offset(cache)
        if start >= len(tokens.ids):
            raise KvlabError(f"the cache already holds {start} tokens of a {len(tokens.ids)}-token "
                             "request: nothing left to prefill (trim the cache first)")
        return prefill(net, tokens.ids[start:], cache, all_logits=all_logits)

    def _fields(self) -> dict:
        return {**super()._fields(), "kind": self.kind, "vision": self.adapter.vision_summary(self.config),
                "images memoised": len(self._memo)}

