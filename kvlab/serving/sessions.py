"""What a load run sends: sessions of turns, made from a kvlab workload or a Mooncake trace.

A **session** is one user: its turns go one after another, and every turn after the first sends
the server's *actual* earlier replies back in place of the workload's canned assistant messages
(the way a chat client does). Independent sessions run concurrently.

- ``multi_turn`` and ``agentic_loop``: one session per user, each a fresh seed.
- ``shared_system_prompt``: one single-turn session per user, all sharing the system prompt.
- ``multimodal``: single-turn chat requests sharing a system prompt, text-only and with images
  (``traffic``: text, mixed, images); an image goes as an OpenAI ``image_url`` part holding a
  base64 PNG data URL of its pixels, and the turn lists the pixel hashes it sends (``images``).
- ``fixed``: single-turn chat requests of exactly ``input_len`` rendered tokens (its ``ids``
  are the rendering, so the run checks the server's prompt count against them).
- ``prefix_repetition`` (token ids): single-turn completions; the ids are sent as text that
  the server's tokenizer encodes back to the same ids (``prefix_repetition(tokenizer=...)`` draws
  pieces that round-trip; the load run checks the server's prompt count against the ids).
- a Mooncake trace: one single-turn completion per row at its timestamp. Each ``hash_id`` becomes
  a fixed block of ``block_tokens`` token ids drawn, seeded by the id, from *safe* tokens (a space
  followed by 3-10 lowercase letters, each its own token), so the text of the blocks concatenated
  encodes back to exactly those ids. Requests that share leading hash ids share leading blocks:
  the trace's prefix reuse is preserved token for token. A row's prompt is its blocks cut to
  ``input_length`` (scaled by ``block_tokens / 512`` when blocks are shrunk to fit a small model).

Example:
    >>> ss = sessions_for("multi_turn", users=2, turns=3)
    >>> [len(s.turns) for s in ss]
    [3, 3]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import RequestError, TraceError
from ..request import Request, Workload
from ..workloads.fixed import rendered_ids, safe_ids
from ..primitives.display import summary_html

CHAT_SESSIONS = ("multi_turn", "agentic_loop")
SINGLE_TURN = ("shared_system_prompt", "prefix_repetition", "fixed", "multimodal")
WORKLOADS = CHAT_SESSIONS + SINGLE_TURN


@dataclass(frozen=True, eq=False)
class Turn:
    """One request: chat ``messages`` (assistant messages are slots for earlier replies, unless
    ``as_recorded``: a workload's standalone request, sent exactly as written) or a completions
    ``prompt``; ``ids``, when known, are the prompt's token ids (for chat: the template's rendering)
    the server's prompt count is checked against; ``tools`` go with a chat request; ``images``
    are the pixel hashes (``kvlab.vlm.image_hash``) of the images its messages carry, in order."""

    name: str
    max_tokens: int
    messages: tuple[dict, ...] | None = None
    prompt: str | None = None
    ids: tuple[int, ...] | None = None
    tools: tuple[dict, ...] | None = None
    as_recorded: bool = False
    images: tuple[str, ...] = ()

    @property
    def endpoint(self) -> str:
        return "chat" if self.messages is not None else "completions"

    def with_replies(self, replies: list[str]) -> list[dict]:
        """The messages to send: the k-th assistant message replaced by the k-th real reply."""
        if self.as_recorded:  # a standalone request's history is part of what it measures
            return [dict(m) for m in self.messages]
        slots = [i for i, m in enumerate(self.messages) if m.get("role") == "assistant"]
        if len(slots) != len(replies):
            raise RequestError(f"turn {self.name!r} has {len(slots)} assistant messages but the "
                               f"session has {len(replies)} earlier replies; a session's turn k must "
                               "hold exactly the k earlier assistant turns")
        out = [dict(m) for m in self.messages]
        for i, text in zip(slots, replies):
            out[i] = {"role": "assistant", "content": text}
        return out

    def __repr__(self) -> str:
        what = f"messages={len(self.messages)}" if self.messages is not None else f"ids={len(self.ids or ())}"
        imgs = f" images={len(self.images)}" if self.images else ""
        return f"Turn({self.name!r} {self.endpoint} {what}{imgs} max_tokens={self.max_tokens})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


@dataclass(frozen=True, eq=False)
class Session:
    """One user's turns, sent in order; ``at_s`` is a fixed start time (trace replay) or None."""

    index: int
    turns: tuple[Turn, ...]
    at_s: float | None = None

    def __repr__(self) -> str:
        at = f" at {self.at_s:.3f}s" if self.at_s is not None else ""
        return f"Session({self.index}, {len(self.turns)} turns{at})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def sessions_for(workload, *, tokenizer=None, users: int = 8, seed: int = 0, time_scale: float = 1.0,
                 block_tokens: int | None = None, max_prompt_tokens: int | None = None,
                 **params) -> list[Session]:
    """Sessions for a workload name (:data:`WORKLOADS`), a ``kv.Workload``, or a trace (a
    ``kv.traces.Trace`` or the path of a Mooncake JSONL file). ``users`` is how many sessions
    (or single-turn requests) to make; ``params`` go to the workload generator.

    Example:
        >>> ss = sessions_for("prefix_repetition", tokenizer=m, users=4, num_prefixes=1)
        >>> ss[0].turns[0].endpoint
        'completions'
    """
    from .. import workloads
    from ..experiments import traces

    if isinstance(workload, traces.Trace) or (isinstance(workload, (str, Path))
                                               and str(workload).endswith((".jsonl", ".json"))):
        trace = workload if isinstance(workload, traces.Trace) else traces.read(workload)
        return trace_sessions(trace, tokenizer, block_tokens=block_tokens, time_scale=time_scale,
                              max_prompt_tokens=max_prompt_tokens)
    if isinstance(workload, Workload):
        if workload.name in CHAT_SESSIONS:
            return [Session(0, tuple(_turn(r, tokenizer) for r in workload.requests))]
        return [Session(i, (_turn(r, tokenizer, as_recorded=True),)) for i, r in enumerate(workload.requests)]
    if workload not in WORKLOADS:
        raise RequestError(f"unknown workload {workload!r}; use one of {', '.join(WORKLOADS)}, a "
                           "kv.Workload, or the path of a Mooncake trace (.jsonl)")
    if users < 1:
        raise RequestError(f"users must be >= 1, got {users!r}")
    gen = workloads.GENERATORS[workload]
    if workload in CHAT_SESSIONS:
        return [Session(u, tuple(_turn(r, tokenizer) for r in gen(seed=seed + u, **params)))
                for u in range(users)]
    if workload == "fixed":
        wl = gen(num_requests=users, seed=seed, tokenizer=tokenizer, **params)
        # the rendered ids go along so each row checks the server's prompt count against them
        return [Session(i, (Turn(r.name, int(r.max_tokens), messages=r.messages,
                                 ids=tuple(rendered_ids(tokenizer, r.messages))),))
                for i, r in enumerate(wl.requests)]
    if workload == "prefix_repetition":
        if tokenizer is None:
            raise RequestError("prefix_repetition sends token ids as text, so it needs the served "
                               "model's tokenizer: pass tokenizer= (a kvlab model, its name or a "
                               "tokenizer)")
        params.setdefault("num_prefixes", 1)
        params["num_prompts"] = users
        wl = round_trip_suffixes(gen(seed=seed, tokenizer=tokenizer, **params), tokenizer, seed)
    elif workload == "multimodal":
        wl = gen(num_requests=users, seed=seed, **params)
    else:
        wl = gen(num_users=users, seed=seed, **params)
    return [Session(i, (_turn(r, tokenizer),)) for i, r in enumerate(wl.requests)]


def _turn(r: Request, tokenizer, as_recorded: bool = False) -> Turn:
    if r.messages is not None:
        messages, images = openai_images(r.messages) if r.has_images else (r.messages, ())
        return Turn(r.name, int(r.max_tokens), messages=messages, tools=r.tools, as_recorded=as_recorded,
                    images=images)
    if tokenizer is None:
        raise RequestError(f"request {r.name!r} is token ids; pass tokenizer= so they can be sent "
                           "as text the server encodes back to the same ids")
    return Turn(r.name, int(r.max_tokens), prompt=decode(tokenizer, r.ids), ids=r.ids)


def openai_images(messages) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    """``messages`` with every image part (``{"type": "image", "image": array | PIL | path}`` or an
    ``image_url``) as OpenAI's ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``
    of the image's decoded pixels, and the pixel hashes (``kvlab.vlm.image_hash``) in order.

    Example:
        >>> msgs, hashes = openai_images(kv.workloads.multimodal(num_requests=2)[1].messages)
        >>> msgs[1]["content"][0]["image_url"]["url"][:22], len(hashes)
        ('data:image/png;base64,', 1)
    """
    import base64
    import io

    from ..vlm.images import image_hash, image_source, load_image

    out, hashes = [], []
    for mi, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, (list, tuple)):
            out.append(dict(m))
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("image", "image_url"):
                img = load_image(image_source(part, f"message {mi}"), f"message {mi}")
                buf = io.BytesIO()
                img.save(buf, format="PNG")  # lossless: the server decodes the same pixels
                url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
                parts.append({"type": "image_url", "image_url": {"url": url}})
                hashes.append(image_hash(img))
            else:
                parts.append(dict(part) if isinstance(part, dict) else part)
        out.append({**m, "content": parts})
    return tuple(out), tuple(hashes)


def round_trip_suffixes(wl: Workload, tokenizer, seed: int = 0) -> Workload:
    """``wl`` (a prefix_repetition workload) with every request's ids encoding back to themselves
    once decoded *whole*: its pieces round-trip one by one, but a prefix and a suffix can merge
    where they meet. Such a request gets a fresh suffix of safe tokens (same length) until the
    whole prompt round-trips; prefixes never change, so the reuse structure is the workload's.

    Example:
        >>> wl = round_trip_suffixes(kv.workloads.prefix_repetition(tokenizer=m, seed=2), m)
    """
    import dataclasses

    from ..primitives.tokens import hf_tokenizer

    hf, n_pre = hf_tokenizer(tokenizer), int(wl.params["prefix_len"])
    rng = np.random.default_rng([seed, 13])
    safe = None
    out = []
    for r in wl.requests:
        ids = list(r.ids)
        for _ in range(20):
            if list(hf.encode(hf.decode(ids), add_special_tokens=False)) == ids:
                break
            safe = safe or safe_ids(tokenizer)
            ids = ids[:n_pre] + [safe[i] for i in rng.integers(0, len(safe), size=len(ids) - n_pre)]
        else:
            raise RequestError(f"request {r.name!r} does not round-trip through the tokenizer even with "
                               "redrawn suffixes; try another seed")
        out.append(r if tuple(ids) == r.ids else dataclasses.replace(r, ids=tuple(ids)))
    return dataclasses.replace(wl, requests=tuple(out))


def decode(tokenizer, ids) -> str:
    """Token ids as text, with the tokenizer's Hugging Face ``decode``."""
    from ..primitives.tokens import hf_tokenizer

    return hf_tokenizer(tokenizer).decode(list(ids))


def block_ids(hash_id: int, n: int, safe: tuple[int, ...]) -> list[int]:
    """The ``n`` token ids of a trace block: seeded by its hash id, so equal ids give equal blocks."""
    rng = np.random.default_rng([int(hash_id), 11])
    return [safe[i] for i in rng.integers(0, len(safe), size=n)]


def trace_sessions(trace, tokenizer, *, block_tokens: int | None = None, time_scale: float = 1.0,
                   max_prompt_tokens: int | None = None) -> list[Session]:
    """One single-turn session per trace row, starting at ``timestamp * time_scale`` (ms -> s).
    ``block_tokens`` shrinks every block (default: the trace's own block size, 512) and each
    prompt in proportion; rows whose prompt would exceed ``max_prompt_tokens`` raise.

    Example:
        >>> ss = trace_sessions(kv.traces.read().head(3), m, block_tokens=16)
        >>> len(ss[0].turns[0].ids)      # 40160 tokens * 16 / 512
        1255
    """
    if tokenizer is None:
        raise TraceError("trace replay synthesises prompts as token ids, so it needs the served "
                         "model's tokenizer: pass tokenizer=")
    if time_scale <= 0:
        raise TraceError(f"time_scale must be > 0, got {time_scale!r}")
    bs = int(trace.block_size)
    bt = int(block_tokens or bs)
    if bt < 1:
        raise TraceError(f"block_tokens must be >= 1, got {block_tokens!r}")
    safe = safe_ids(tokenizer)
    blocks: dict[int, list[int]] = {}
    out = []
    t0 = None
    for i, row in enumerate(trace.frame.iter_rows(named=True)):
        n = max(1, math.ceil(row["input_length"] * bt / bs))
        if max_prompt_tokens is not None and n > max_prompt_tokens:
            raise TraceError(f"trace row {i} needs {n} prompt tokens, over max_prompt_tokens="
                             f"{max_prompt_tokens}; pass a smaller block_tokens or head() the trace")
        ids: list[int] = []
        for h in row["hash_ids"]:
            if len(ids) >= n:
                break
            ids.extend(blocks.setdefault(h, block_ids(h, bt, safe)))
        if len(ids) < n:
            raise TraceError(f"trace row {i}: {len(row['hash_ids'])} hash ids of {bt} tokens cannot "
                             f"cover its {n} prompt tokens; is block_size={bs} right for this trace?")
        ids = ids[:n]
        t0 = row["timestamp"] if t0 is None else t0
        turn = Turn(f"row-{i}", max(1, int(row["output_length"])), prompt=decode(tokenizer, ids),
                    ids=tuple(ids))
        out.append(Session(i, (turn,), at_s=(row["timestamp"] - t0) * time_scale / 1e3))
    return out
