"""Request and Workload: the request types every layer shares (the Engine runs them, the
generators in ``kv.workloads`` make them, traces export them).

Example:
    >>> r = Request(ids=(1, 2, 3), max_tokens=8, name="r0")
    >>> Workload("mine", (r,))
    Workload('mine', 1 requests, ids)
"""

from __future__ import annotations

import hashlib
import html
import json
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .errors import RequestError
from .primitives.display import summary_html, table_html


@dataclass(frozen=True, eq=False, kw_only=True)
class Request:
    """One request: chat ``messages`` or raw token ``ids`` (exactly one), and how much to generate.

    ``extra_keys`` and ``salt`` join the request's block hashes (LoRA ids, tenant salts).
    ``tools`` (chat requests only) are OpenAI function-tool schemas, rendered by the chat template
    (its ``tools=``), so their order is part of the prompt.
    Equality and hashing go through :meth:`digest`, so requests holding image arrays compare.

    Example:
        >>> r = Request(ids=(1, 2, 3), max_tokens=8, name="r0")
        >>> r.kind, len(r)
        ('ids', 3)
    """

    messages: tuple[dict, ...] | None = None
    ids: tuple[int, ...] | None = None
    extra_keys: tuple = ()
    salt: str | None = None
    max_tokens: int = 128
    name: str = ""
    tools: tuple[dict, ...] | None = None

    def __post_init__(self):
        if (self.messages is None) == (self.ids is None):
            raise RequestError(f"request {self.name!r}: set exactly one of messages= (chat) or "
                               "ids= (token ids), not both or neither")
        if self.messages is not None:
            if isinstance(self.messages, (str, bytes)) or not len(self.messages):
                raise RequestError(f"request {self.name!r}: messages must be a non-empty sequence of "
                                   "{'role': ..., 'content': ...} dicts")
            object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))
        else:
            ids = tuple(int(i) for i in self.ids)
            if not ids:
                raise RequestError(f"request {self.name!r}: ids is empty; a request needs at least "
                                   "one token")
            object.__setattr__(self, "ids", ids)
        if not isinstance(self.max_tokens, (int, np.integer)) or self.max_tokens < 0:
            raise RequestError(f"request {self.name!r}: max_tokens must be an int >= 0, "
                               f"got {self.max_tokens!r}")
        object.__setattr__(self, "extra_keys", tuple(self.extra_keys))
        if self.tools is not None:
            if self.messages is None or isinstance(self.tools, (str, dict)) or \
                    not all(isinstance(t, dict) for t in self.tools):
                raise RequestError(f"request {self.name!r}: tools must be a sequence of tool-schema "
                                   "dicts ({'type': 'function', 'function': {...}}) on a chat request")
            object.__setattr__(self, "tools", tuple(dict(t) for t in self.tools))

    @property
    def kind(self) -> str:
        """``"ids"`` or ``"messages"``."""
        return "ids" if self.ids is not None else "messages"

    @property
    def has_images(self) -> bool:
        return self.messages is not None and any(
            isinstance(m.get("content"), (list, tuple))
            and any(isinstance(p, dict) and p.get("type") in ("image", "image_url") for p in m["content"])
            for m in self.messages)

    @property
    def template_kwargs(self) -> dict:
        """What the chat template gets besides the messages: ``{"tools": [...]}`` or nothing."""
        return {"tools": [dict(t) for t in self.tools]} if self.tools is not None else {}

    def __len__(self) -> int:
        """Token ids, or messages for a chat request."""
        return len(self.ids) if self.ids is not None else len(self.messages)

    def text_chars(self) -> int:
        """Characters of text content (0 for token-id requests)."""
        if self.messages is None:
            return 0
        return sum(len(text_of(m.get("content"))) for m in self.messages)

    def digest(self) -> str:
        """A process-independent sha256 of everything the request contains (images by content)."""
        body = {"messages": self.messages, "ids": self.ids, "extra_keys": self.extra_keys,
                "salt": self.salt, "max_tokens": int(self.max_tokens), "name": self.name}
        if self.tools is not None:  # only then, so digests of requests without tools stay as they were
            body["tools"] = self.tools
        return hashlib.sha256(canonical_json(body).encode()).hexdigest()

    def __eq__(self, other) -> bool:
        return isinstance(other, Request) and self.digest() == other.digest()

    def __hash__(self) -> int:
        return int(self.digest()[:16], 16)

    def __repr__(self) -> str:
        size = (f"ids={len(self.ids)}" if self.ids is not None
                else f"messages={len(self.messages)}" + (" +images" if self.has_images else "")
                + (f" tools={len(self.tools)}" if self.tools is not None else ""))
        return f"Request({self.name!r} {size} max_tokens={self.max_tokens})"

    def _repr_html_(self) -> str:
        if self.ids is not None:
            head = " ".join(map(str, self.ids[:24])) + (" …" if len(self.ids) > 24 else "")
            body = f"<code>{html.escape(head)}</code>"
        else:
            body = table_html(None, [(m.get("role"), _preview(m.get("content"))) for m in self.messages])
        return summary_html("Request", repr(self), body=body)


@dataclass(frozen=True, eq=False)
class Workload:
    """A named, replayable tuple of requests and the parameters that made it.

    Example:
        >>> wl = kv.workloads.shared_system_prompt(num_users=3)
        >>> len(wl), wl.params["seed"]
        (3, 0)
    """

    name: str
    requests: tuple[Request, ...]
    params: dict = field(default_factory=dict)
    description: str = ""

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __getitem__(self, i):
        return self.requests[i]

    def digest(self) -> str:
        """sha256 over the requests' digests: equal digests, identical workloads."""
        return hashlib.sha256("".join(r.digest() for r in self.requests).encode()).hexdigest()

    def __eq__(self, other) -> bool:
        return isinstance(other, Workload) and self.digest() == other.digest()

    def __hash__(self) -> int:
        return int(self.digest()[:16], 16)

    def token_ids(self, tokenizer=None) -> list[tuple[int, ...]]:
        """Each request's prompt token ids; chat requests need a ``tokenizer`` (a model or tokenizer).

        Example:
            >>> kv.workloads.prefix_repetition(num_prompts=10).token_ids()[0][:3]
            (12418, 8855, 11572)
        """
        out = []
        for r in self.requests:
            if r.ids is not None:
                out.append(r.ids)
                continue
            if tokenizer is None:
                raise RequestError(f"workload {self.name!r} holds chat messages; pass tokenizer= "
                                   "(e.g. kv.load('tiny') or kvlab.models.qwen_tokenizer()) to "
                                   "tokenise them")
            from .primitives.tokens import tokenise

            out.append(tuple(tokenise(tokenizer, list(r.messages), **r.template_kwargs).ids))
        return out

    def __repr__(self) -> str:
        kinds = sorted({r.kind for r in self.requests})
        seed = self.params.get("seed")
        return (f"Workload({self.name!r}, {len(self)} requests, {'/'.join(kinds) or 'empty'}"
                + (f", seed={seed}" if seed is not None else "") + ")")

    def _repr_html_(self, limit: int = 50) -> str:
        rows = [(r.name, r.kind, f"{len(r.ids)} ids" if r.ids is not None
                 else f"{len(r.messages)} msgs, {r.text_chars()} chars",
                 "yes" if r.has_images else "", r.max_tokens) for r in self.requests[:limit]]
        params = ", ".join(f"{k}={v}" for k, v in self.params.items())
        table = table_html(("name", "kind", "size", "images", "max_tokens"), rows, limit=limit,
                           total=len(self))
        return summary_html("Workload", self.name, f"{len(self)} requests", note=params, body=table)


def canonical_json(obj) -> str:
    """JSON with sorted keys; arrays stand in as their shape, dtype and content sha256."""
    def default(o):
        if isinstance(o, np.ndarray):
            return {"ndarray": hashlib.sha256(np.ascontiguousarray(o).tobytes()).hexdigest(),
                    "shape": list(o.shape), "dtype": str(o.dtype)}
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, (bytes, bytearray)):
            return {"bytes": hashlib.sha256(bytes(o)).hexdigest()}
        return repr(o)
    return json.dumps(obj, sort_keys=True, default=default, ensure_ascii=False)


def text_of(content) -> str:
    """The text parts of a message's content, concatenated."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _preview(content, n: int = 160) -> str:
    text = text_of(content)
    if isinstance(content, (list, tuple)):
        images = sum(1 for p in content if isinstance(p, dict) and p.get("type") in ("image", "image_url"))
        text = "[image] " * images + text
    return text if len(text) <= n else text[:n] + "…"
