"""Requests for the served-VLM tests: images as PNG bytes and data URLs, OpenAI and Anthropic
request bodies with an image, a plain-HTTP POST that returns (status, JSON body), SSE parsing."""

import base64
import io
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))
from sse_events import sse_events  # noqa: E402,F401  (the serving tests' SSE parser, re-exported)

BLOCK = 16
SYSTEM = "You describe pictures in one short sentence. Be precise and plain."
MAX = 6
ASK = "Please describe this picture in a few plain words, then say what its main {} is."


def png(seed: int | None = None, size=(84, 56), colour=None) -> bytes:
    w, h = size
    arr = (np.full((h, w, 3), colour, np.uint8) if colour is not None
           else np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_msgs(url: str, question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


def text_msgs(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def post(server, route: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + route, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def anthropic_body(url_png: bytes, question: str, **kw) -> dict:
    return {"model": "tiny-vlm", "max_tokens": MAX, "temperature": 0, "system": SYSTEM, **kw,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(url_png).decode()}},
                {"type": "text", "text": question}]}]}
