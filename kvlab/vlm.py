"""load_vlm(): an mlx-vlm model (qwen2_vl) whose image requests kvlab can cache correctly.

An image request's token ids are only placeholders (``<|image_pad|>`` repeated); the image enters
through the vision tower. Token ids alone therefore cannot key its KV (vllm-mlx#718): kvlab hashes
each image's decoded pixels (``Tokens.images``) and the Engine passes those hashes as extra keys.
The uncached rest of a request runs through ``RequestModel``: the VLM bound to that request's
images and M-RoPE positions, with mlx-lm's model signature ``(ids[1, L], cache=...) -> logits``,
so it works on top of any restored kvlab snapshot.

    import kvlab as kv
    vlm = kv.load_vlm("tiny")                  # random-weight qwen2_vl, built offline once
    msgs = [{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                         {"type": "text", "text": "What is this?"}]}]
    toks = kv.tokenise(vlm, msgs)              # toks.images[0].hash / .token_start / .token_end
    logits, cache = vlm.prefill(toks)          # cold (or on top of a restored cache)
    kv.Engine(vlm, kv.RadixStore(), verify=True).run(msgs)
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import html
import io
import json
import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

from . import _blas

_blas.load_fast_blas()  # before mlx.core

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from . import models as _models  # noqa: E402
from .errors import (ImageError, KvlabError, ModelNotFoundError, TemplateError,  # noqa: E402
                     VLMUnavailableError)
from .models import Model  # noqa: E402
from .tokens import (ImageRef, Span, Tokens, char_to_token_span, encode_with_offsets,  # noqa: E402
                     has_content_lists, is_messages, message_char_spans, render, validate_messages)

SUPPORTED_ARCHS = ("qwen2_vl",)
TINY_VLM_VERSION = 1  # bump when the tiny VLM builder's output changes
IMAGE_MEMO = 64       # processed images kept per model (keyed by pixel hash)
_HOW = ("pass \"tiny\" or a local mlx-vlm qwen2_vl folder (config.json with a vision_config, "
        "*.safetensors, tokenizer and preprocessor_config.json); kvlab never downloads models")

# Qwen2-VL's chat template (as shipped with Qwen/Qwen2-VL-*-Instruct).
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _require_mlx_vlm():
    try:
        import mlx_vlm  # noqa: F401
    except ImportError as e:
        raise VLMUnavailableError("kvlab's VLM support needs mlx-vlm: pip install 'kvlab[vlm]' "
                                  f"(mlx-vlm and pillow); import failed: {e}") from e


# -- images ---------------------------------------------------------------------------------------

def load_image(source, where: str = "image"):
    """A PIL RGB image from a PIL image, a path (or file:// / data: URL), bytes or a uint8 array.

        >>> load_image(np.zeros((56, 56, 3), np.uint8)).size
        (56, 56)
    """
    from PIL import Image, UnidentifiedImageError

    try:
        if isinstance(source, Image.Image):
            img = source
        elif isinstance(source, (str, os.PathLike)):
            s = os.fspath(source)
            if s.startswith(("http://", "https://")):
                raise ImageError(f"{where}: {s[:80]!r} is a web URL and kvlab never downloads; save "
                                 "the image and pass its path, a PIL image or an array")
            if s.startswith("data:"):
                img = Image.open(io.BytesIO(base64.b64decode(s.partition(",")[2], validate=True)))
            else:
                path = Path(s.removeprefix("file://")).expanduser()
                if not path.is_file():
                    raise ImageError(f"{where}: no image file at {path}; pass an existing path, a PIL "
                                     "image or a uint8 array")
                img = Image.open(path)
        elif isinstance(source, (bytes, bytearray, memoryview)):
            img = Image.open(io.BytesIO(bytes(source)))
        elif hasattr(source, "__array__") or isinstance(source, mx.array):
            arr = np.asarray(source)
            channels = arr.shape[2] if arr.ndim == 3 else 1
            if arr.dtype != np.uint8 or arr.ndim not in (2, 3) or channels not in (1, 3, 4):
                raise ImageError(f"{where}: an image array must be uint8 with shape (H, W), (H, W, 3) or "
                                 f"(H, W, 4); got {arr.dtype} {arr.shape}")
            img = Image.fromarray(arr[..., 0] if arr.ndim == 3 and arr.shape[2] == 1 else arr)
        else:
            raise ImageError(f"{where}: cannot read an image from a {type(source).__name__}; pass a PIL "
                             "image, a file path or a uint8 array")
        img.load()  # decode now, so a truncated file fails here and not inside the processor
        return img if img.mode == "RGB" else img.convert("RGB")
    except ImageError:
        raise
    except (OSError, UnidentifiedImageError, ValueError, binascii.Error, SyntaxError) as e:
        raise ImageError(f"{where}: the image cannot be decoded ({type(e).__name__}: {e}); pass a "
                         "readable PNG/JPEG/... file, a PIL image or a uint8 array") from e


def image_hash(img) -> str:
    """sha256 of the decoded pixels: mode, size and raw bytes (never a file name or path).

    Two files with the same pixels hash alike; one path whose file changed does not.
    """
    h = hashlib.sha256(f"{img.mode}:{img.size[0]}x{img.size[1]}:".encode())
    h.update(img.tobytes())
    return h.hexdigest()


def _image_source(part: dict, where: str):
    if part.get("type") == "image_url" or "image_url" in part:
        src = part.get("image_url")
        src = src.get("url") if isinstance(src, dict) else src
    else:
        src = next((part[k] for k in ("image", "path", "url") if part.get(k) is not None), None)
    if src is None:
        raise ImageError(f"{where} is an image part without an image: put a PIL image, a path or a "
                         "uint8 array under 'image', e.g. {'type': 'image', 'image': 'cat.png'}")
    return src


class Pixels(NamedTuple):
    """One processed image: pixel patches [patches, C*T*P*P], its (t, h, w) grid, its token count."""

    hash: str
    pixel_values: Any
    grid: tuple[int, int, int]
    tokens: int

    def __repr__(self) -> str:
        t, h, w = self.grid
        return f"Pixels({self.hash[:12]}, grid {t}x{h}x{w}, {self.tokens} tokens)"

    def _repr_html_(self) -> str:
        return (f"<div><b>Pixels</b> <code>{self.hash[:16]}</code> · grid {self.grid} · "
                f"{self.tokens} image tokens · patches {tuple(self.pixel_values.shape)}</div>")


def _runs(ids, token_id) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of ``token_id`` in ``ids``."""
    out, start = [], None
    for i, t in enumerate(ids):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(ids)))
    return out


# -- the model ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class VLModel(Model):
    """A loaded mlx-vlm model (``kind="vlm"``): ``.model`` is the mlx-vlm module, ``.tokenizer`` an
    mlx-lm TokenizerWrapper, ``.processor`` the mlx-vlm processor. Its cache is mlx-lm KVCache
    objects (one per language-model layer), so kvlab snapshots and stores work unchanged.

        >>> vlm = kv.load_vlm("tiny"); vlm.kind, vlm.arch, len(vlm.make_cache())
        ('vlm', 'qwen2_vl', 4)
    """

    processor: Any = None
    _memo: OrderedDict = dataclasses.field(default_factory=OrderedDict, repr=False)

    @property
    def image_token(self) -> str:
        return getattr(self.processor, "image_token", "<|image_pad|>")

    @property
    def image_token_id(self) -> int:
        return int(self.model.config.image_token_id)

    @property
    def merge_size(self) -> int:
        return int(getattr(self.processor.image_processor, "merge_size", 2))

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
                    images.append((i, load_image(_image_source(part, where), where)))
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
        runs = _runs(ids, self.image_token_id)
        if [e - s for s, e in runs] != [p.tokens for p in pixels]:
            raise ImageError(f"the processor made images of {[p.tokens for p in pixels]} tokens but the "
                             f"prompt has placeholder runs of {[e - s for s, e in runs]}: the tokenizer "
                             "and image processor of this model folder do not match")
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
            out = self.processor.image_processor(images=[img])
        except Exception as e:  # the numpy processor raises ValueError/IndexError/... on odd sizes
            raise ImageError(f"the image processor rejected a {img.size[0]}x{img.size[1]} image "
                             f"({type(e).__name__}: {e}); resize it to a usual aspect ratio") from e
        grid = tuple(int(x) for x in np.asarray(out["image_grid_thw"])[0])
        tokens = int(np.prod(grid)) // self.merge_size**2
        pixels = Pixels(h, mx.array(np.asarray(out["pixel_values"])), grid, tokens)
        self._memo[h] = pixels
        while len(self._memo) > IMAGE_MEMO:
            self._memo.popitem(last=False)
        return pixels

    # -- running ----------------------------------------------------------------------------------
    def for_request(self, tokens: Tokens) -> "RequestModel":
        """This model bound to one request (its images and M-RoPE positions): the Engine's hook."""
        return RequestModel(self, tokens)

    def prefill(self, tokens: Tokens, cache=None, *, all_logits: bool = False):
        """Run ``tokens`` from the cache's offset to the end (a cold run when ``cache`` is None).
        Returns (logits, cache) like ``kv.prefill``.

            >>> logits, cache = vlm.prefill(toks)                        # cold
            >>> logits2, _ = vlm.prefill(toks, kv.restore(kv.trim(kv.snapshot(cache), 10)))
        """
        from .snapshots import prefill

        net = self.for_request(tokens)
        cache = self.make_cache() if cache is None else cache
        start = _offset(cache)
        if start >= len(tokens.ids):
            raise KvlabError(f"the cache already holds {start} tokens of a {len(tokens.ids)}-token "
                             "request: nothing left to prefill (trim the cache first)")
        return prefill(net, tokens.ids[start:], cache, all_logits=all_logits)

    def _fields(self) -> dict:
        vc = self.config.get("vision_config", {})
        return {**super()._fields(), "kind": self.kind,
                "vision": f"{vc.get('depth', '?')} blocks, embed {vc.get('embed_dim', '?')}",
                "images memoised": len(self._memo)}

    def __repr__(self) -> str:
        f = self._fields()
        return (f"VLModel({f['name']!r}, {f['arch']}, {f['layers']} layers, {f['params']} params, "
                f"{f['dtype']}, context {f['context']}, fingerprint {f['fingerprint']})")

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{html.escape(str(v))}</td></tr>"
                       for k, v in self._fields().items())
        return f"<table><caption>kvlab VLModel</caption>{rows}</table>"


def _offset(cache) -> int:
    if not cache:
        return 0
    off = getattr(cache[0], "offset", 0)
    return int(off.max().item()) if isinstance(off, mx.array) else int(off or 0)


class RequestModel:
    """A VLM bound to one request: ``net(ids[1, L], cache=cache) -> logits[1, L, vocab]``.

    The chunk's first position is the cache's offset; where the chunk covers an image's
    placeholders it embeds that image's vision features (computed once, only if needed), and it
    passes the request's M-RoPE position ids explicitly, so a prefill on top of a restored prefix
    (or past the prompt, when decoding) uses the same positions as a cold run. It holds no state
    of mlx-vlm's own (mlx-vlm's language model caches rope deltas between calls; this does not use
    that path). Quack like an mlx-lm model: ``kv.prefill(net, ids, cache)``, mlx-lm's
    ``generate_step(prompt, net, prompt_cache=cache)``.
    """

    def __init__(self, vlm: VLModel, tokens: Tokens):
        self.vlm = vlm
        self.tokens = tokens
        self.vision_calls = 0  # how many images went through the vision tower
        self._features: dict[int, mx.array] = {}
        self._pixels: list[Pixels | None] = [None] * len(tokens.images)
        self._positions = None  # [3, 1, N] once computed (image requests only)
        self._delta = 0
        found = _runs(tokens.ids, vlm.image_token_id)
        spans = [(im.token_start, im.token_end) for im in tokens.images]
        if found != spans:
            raise ImageError(
                f"these tokens have {len(found)} image placeholder runs but {len(spans)} images: "
                + ("token ids with image placeholders carry no pixels; tokenise the messages with "
                   "kv.tokenise(vlm, messages) so the images come along" if not spans else
                   f"placeholders at {found}, images at {spans}"))

    @property
    def layers(self):
        return self.vlm.model.layers

    def make_cache(self) -> list:
        return self.vlm.make_cache()

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        if kwargs.get("input_embeddings") is not None:
            raise KvlabError("RequestModel computes its own input embeddings; do not pass them")
        lm = self.vlm.model.language_model
        start, length = _offset(cache), inputs.shape[1]
        embeds = lm.model.embed_tokens(inputs)
        for i, ref in enumerate(self.tokens.images):
            a, b = max(start, ref.token_start), min(start + length, ref.token_end)
            if a >= b:
                continue
            got = inputs[0, a - start: b - start].tolist()
            if any(t != self.vlm.image_token_id for t in got):
                raise ImageError(f"the ids being prefilled at {a}:{b} are not image {i}'s placeholders: "
                                 "this RequestModel was bound to other tokens (or the cache offset is "
                                 "not where these ids start)")
            feats = self._image_features(i)
            embeds[:, a - start: b - start] = feats[a - ref.token_start: b - ref.token_start][None]
        out = lm(inputs, inputs_embeds=embeds, cache=cache,
                 position_ids=self.positions(start, start + length))
        return out.logits

    def positions(self, start: int, end: int) -> mx.array:
        """M-RoPE position ids [3, 1, end-start] of request positions start..end (end may pass the
        prompt: generated tokens continue from the last position, as in mlx-vlm's decode)."""
        n = len(self.tokens.ids)
        if self.tokens.images and self._positions is None:
            grids = mx.array([self._pixels_of(i).grid for i in range(len(self.tokens.images))])
            pos, delta = self.vlm.model.language_model.get_rope_index(
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
            ref = self.tokens.images[i]
            p = self.vlm._memo.get(ref.hash) or self._reload(i)
            if p.hash != ref.hash or p.tokens != ref.token_end - ref.token_start:
                raise ImageError(f"image {i} is no longer the image that was tokenised (its pixels "
                                 "changed); tokenise the request again")
            self._pixels[i] = p
        return self._pixels[i]

    def _reload(self, i: int) -> Pixels:
        """Re-read image i from the request's messages (its processed pixels were evicted)."""
        sources = [(mi, part) for mi, m in enumerate(self.tokens.messages or ())
                   if isinstance(m.get("content"), (list, tuple))
                   for part in m["content"] if isinstance(part, dict)
                   and part.get("type") in ("image", "image_url")]
        if i >= len(sources):
            raise ImageError(f"image {i}'s pixels are not available: tokenise the messages with "
                             "kv.tokenise(vlm, messages)")
        mi, part = sources[i]
        return self.vlm.process_image(load_image(_image_source(part, f"message {mi}"), f"message {mi}"))

    def _image_features(self, i: int) -> mx.array:
        if i not in self._features:
            p = self._pixels_of(i)
            tower = self.vlm.model.vision_tower
            dtype = tower.patch_embed.proj.weight.dtype
            feats = tower(p.pixel_values.astype(dtype), mx.array([p.grid]), output_hidden_states=False)
            if feats.shape[0] != p.tokens:
                raise ImageError(f"the vision tower made {feats.shape[0]} features for image {i}, "
                                 f"which has {p.tokens} placeholders: the model and its "
                                 "preprocessor_config.json do not match")
            self._features[i] = feats
            self.vision_calls += 1
        return self._features[i]

    def __repr__(self) -> str:
        return (f"RequestModel({self.vlm.name!r}, {len(self.tokens.ids)} ids, "
                f"{len(self.tokens.images)} images, {self.vision_calls} vision calls)")

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{i}</td><td><code>{im.hash[:12]}</code></td><td>{im.token_start}:"
                       f"{im.token_end}</td></tr>" for i, im in enumerate(self.tokens.images))
        return (f"<div><b>RequestModel</b> {html.escape(repr(self))}<table><tr><th>image</th>"
                f"<th>hash</th><th>tokens</th></tr>{rows}</table></div>")


# -- loading --------------------------------------------------------------------------------------

def load_vlm(name_or_path: str | os.PathLike = "tiny", *, dtype: str | None = None) -> VLModel:
    """Load "tiny" (a deterministic random-weight qwen2_vl, built offline into $KVLAB_HOME) or a
    local mlx-vlm qwen2_vl folder. Never downloads.

        >>> vlm = kv.load_vlm("tiny"); vlm
        VLModel('tiny-vlm', qwen2_vl, 4 layers, ...)
    """
    _require_mlx_vlm()
    if dtype is not None and dtype not in _models.DTYPES:
        raise KvlabError(f"dtype {dtype!r} is not supported; use one of {', '.join(_models.DTYPES)}")
    key = os.fspath(name_or_path)
    if key in ("tiny", "tiny-vlm"):
        return _load_folder(ensure_tiny_vlm(), "tiny-vlm", dtype or "float32")
    path = Path(key).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(f"{key!r} is neither \"tiny\" nor a local folder: {_HOW}")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"{path} has no readable config.json ({e}): {_HOW}") from e
    if "vision_config" not in config or not list(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"{path} is not an mlx-vlm model folder (it needs a config.json with "
                                 f"a vision_config and *.safetensors): {_HOW}")
    return _load_folder(path.resolve(), path.name, dtype)


def tiny_vlm_config() -> dict:
    """config.json of the tiny qwen2_vl: 4 text layers of width 64, a 2-block vision tower."""
    return {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
            "vocab_size": _models.qwen_vocab_size(), "hidden_size": 64, "num_hidden_layers": 4,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 1e6,
            "tie_word_embeddings": True,
            # head_dim 16 -> 8 rotary frequencies split over (t, h, w)
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
            "vision_end_token_id": 151653, "bos_token_id": 151643, "eos_token_id": [151645, 151643],
            "torch_dtype": "float32",
            # mlp_ratio must be an int: mlx-vlm sizes the vision MLP with int(embed_dim * ratio)
            "vision_config": {"model_type": "qwen2_vl", "depth": 2, "embed_dim": 32, "hidden_size": 64,
                              "num_heads": 2, "mlp_ratio": 2, "in_channels": 3, "patch_size": 14,
                              "spatial_patch_size": 14, "spatial_merge_size": 2,
                              "temporal_patch_size": 2}}


# Small images stay small: 56x56 px -> 4 image tokens, at most 64 tokens per image.
TINY_PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
                     "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
                     "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64,
                     "image_mean": [0.48145466, 0.4578275, 0.40821073],
                     "image_std": [0.26862954, 0.26130258, 0.27577711],
                     "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                     "do_convert_rgb": True}
_EXTRA_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.json")


def ensure_tiny_vlm(with_status: bool = False):
    """The tiny VLM's folder, built once (temp dir + rename, like kv.load's tiny models)."""
    cfg = tiny_vlm_config()
    expect = {"name": "tiny-vlm", "builder": f"tiny-vlm-{TINY_VLM_VERSION}", "seed": _models.TINY_SEED,
              "dtype": "float32", "preprocessor": TINY_PREPROCESSOR,
              "source": {"tokenizer_sha256": _models.digest_files(_models.qwen_tokenizer_dir(),
                                                                   _models.QWEN_FILES)}}
    digest = _models.sha256_json({"config": cfg, **expect})[:12]
    folder = _models.kvlab_home() / "models" / f"tiny-qwen2vl-{digest}"
    result = _models.ensure_folder(folder, expect, lambda tmp: _build_tiny_vlm(tmp, cfg))
    return result if with_status else result[0]


def _build_tiny_vlm(out: Path, cfg: dict) -> None:
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    model_class, _ = get_model_and_args(config=dict(cfg))
    raw = json.loads(json.dumps(cfg))
    raw.setdefault("text_config", {})
    model_config = model_class.ModelConfig.from_dict(raw)
    model_config = update_module_configs(model_config, model_class, raw, ["text", "vision"])
    model = model_class.Model(model_config)
    params = {}
    for name, p in tree_flatten(model.parameters()):
        # one generator per parameter name, so weights don't depend on mlx-vlm's init order
        rng = np.random.default_rng(int.from_bytes(hashlib.sha256(
            f"{_models.TINY_SEED}:{name}".encode()).digest()[:8], "little"))
        if p.ndim == 1:  # norm scales one, biases zero
            norm = any(k in name for k in ("norm", "ln_q")) and name.endswith("weight")
            value = np.ones(p.shape, np.float32) if norm else np.zeros(p.shape, np.float32)
        else:
            # embeddings std 0.25 keep tied logits near std 2; other weights preserve scale
            std = 0.25 if "embed_tokens" in name else 1 / np.sqrt(np.prod(p.shape[1:]))
            value = rng.standard_normal(p.shape, dtype=np.float32) * np.float32(std)
        params[name] = mx.array(value)
    model.update(tree_unflatten(list(params.items())))
    src = _models.qwen_tokenizer_dir()
    for fname in ("tokenizer.json", "vocab.json", "merges.txt"):
        shutil.copyfile(src / fname, out / fname)
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok_cfg["chat_template"] = QWEN2_VL_TEMPLATE  # the Qwen3 text template has no image parts
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": QWEN2_VL_TEMPLATE}))
    (out / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=2))
    # written so mlx-vlm finds it locally instead of asking the hub
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})


def _load_folder(folder: Path, name: str, dtype: str | None) -> VLModel:
    import mlx_vlm
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    config = json.loads((folder / "config.json").read_text())
    arch = config.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise ModelNotFoundError(f"{folder} is a {arch!r} model; kvlab's image prefill supports "
                                 f"{', '.join(SUPPORTED_ARCHS)} (M-RoPE positions and the vision "
                                 "tower call are architecture-specific)")
    try:
        model, processor = mlx_vlm.load(str(folder))  # an existing local folder: never the hub
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        raise ModelNotFoundError(f"mlx-vlm cannot load {folder}: {e}. {_HOW}") from e
    stored = _models.stored_dtype(model)
    if dtype is None:
        dtype = _models.default_dtype() if stored in ("float16", "bfloat16") else stored
    if dtype != stored:
        model.set_dtype(getattr(mx, dtype))
    hf = processor.tokenizer
    if not getattr(hf, "chat_template", None):
        raise ModelNotFoundError(f"{folder} has no chat template (chat_template.json or "
                                 "tokenizer_config.json): kvlab needs it to place image tokens")
    eos = config.get("eos_token_id")
    tokenizer = TokenizerWrapper(hf, eos_token_ids=[eos] if isinstance(eos, int) else eos)
    manifest = _models.read_manifest(folder)
    weights = (manifest["weights_sha256"] if manifest else
               _models.digest_files(folder, sorted(p.name for p in folder.glob("*.safetensors"))))
    files = _models.digest_files(folder, _models.TOKENIZER_FILES + _EXTRA_FILES)
    fp = _models.sha256_json({"config": config, "weights": weights, "files": files, "dtype": dtype})
    return VLModel(name, model, tokenizer, fp, folder, config, dtype,
                   _models.context_length_of(config, hf), "vlm", processor)
