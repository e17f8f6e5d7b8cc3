"""Images of a VLM request: reading them from any source, hashing their pixels, the processed
pixels of one image, and finding an image's placeholder tokens in a prompt.

An image request's token ids are only placeholders (``<|image_pad|>`` repeated), so token ids
alone cannot key its KV (vllm-mlx#718): kvlab keys it by the sha256 of the decoded pixels.

Example:
    >>> import numpy as np
    >>> img = load_image(np.zeros((56, 56, 3), np.uint8))
    >>> img.size, image_hash(img)[:12]
    ((56, 56), 'aa44028ed6d3')
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
from pathlib import Path
from typing import Any, NamedTuple

from .. import _blas

_blas.load_fast_blas()  # before mlx.core

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from ..errors import ImageError  # noqa: E402
from ..primitives.display import Html, summary_html  # noqa: E402


def load_image(source, where: str = "image"):
    """A PIL RGB image from a PIL image, a path (or file:// / data: URL), bytes or a uint8 array.

    Example:
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

    Example:
        >>> image_hash(load_image(np.zeros((2, 2, 3), np.uint8))) == image_hash(
        ...     load_image(np.zeros((2, 2), np.uint8)))          # grey converts to the same RGB
        True
    """
    h = hashlib.sha256(f"{img.mode}:{img.size[0]}x{img.size[1]}:".encode())
    h.update(img.tobytes())
    return h.hexdigest()


def image_source(part: dict, where: str):
    """What an image content part points at: ``{"type": "image", "image": ...}`` (or ``path``,
    ``url``), or OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``.

    Example:
        >>> image_source({"type": "image_url", "image_url": {"url": "cat.png"}}, "message 0")
        'cat.png'
    """
    if part.get("type") == "image_url" or "image_url" in part:
        src = part.get("image_url")
        src = src.get("url") if isinstance(src, dict) else src
    else:
        src = next((part[k] for k in ("image", "path", "url") if part.get(k) is not None), None)
    if src is None:
        raise ImageError(f"{where} is an image part without an image: put a PIL image, a path or a "
                         "uint8 array under 'image', e.g. {'type': 'image', 'image': 'cat.png'}")
    return src


def image_parts(messages) -> list[tuple[int, dict]]:
    """(message index, part) of every image part of a conversation, in order."""
    return [(mi, part) for mi, m in enumerate(messages or ())
            if isinstance(m.get("content"), (list, tuple))
            for part in m["content"] if isinstance(part, dict)
            and part.get("type") in ("image", "image_url")]


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
        return summary_html("Pixels", Html(f"<code>{self.hash[:16]}</code>"), f"grid {self.grid}",
                            f"{self.tokens} image tokens", f"patches {tuple(self.pixel_values.shape)}")


def placeholder_runs(ids, token_id) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of ``token_id`` in ``ids``.

    Example:
        >>> placeholder_runs([1, 7, 7, 2, 7], 7)
        [(1, 3), (4, 5)]
    """
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
