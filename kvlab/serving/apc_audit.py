"""Audit mlx-vlm's APC: what its ``/v1/cache/stats`` reports against what it reused.

A deterministic ordered sequence goes to the APC server one request at a time (text, the same
text again, an image, the same image again, a different image of the same size with identical
token ids), reading the stats route before and after each. Per request kvlab puts side by side:

- ``reusable_tokens``: the exact shared prefix with any earlier request, from ``kv.tokenise``
  on the same messages (an image's tokens match only if its pixel hash does), at most n - 1;
- ``apc_matched`` / ``apc_reused``: what APC's documented rules give (dense KV, block mode):
  blocks of ``block_size`` tokens chained over ``ids[:-1]``, every block salted with one hash of
  *all* the request's images; a matched prefix that contains image tokens is dropped
  (``prefix_has_media`` in ``apc_lookup_plan``) after the lookup has counted it;
- what the server said: ``lookups_hit``, ``matched_tokens``, ``restored_tokens``,
  ``stored_tokens`` (deltas) and usage ``cached_tokens``;
- the reply, and with an APC-off server the APC-off reply (greedy decoding: a wrong reuse changes
  it). The tiny VLM runs float32 on CPU, where warm and cold prefill agreed exactly here; mlx-vlm
  warns that batch non-invariant attention kernels can make them differ on GPU.

Example:
    >>> with start_mlx_vlm("tiny-vlm") as on, start_mlx_vlm("tiny-vlm", apc=False) as off:
    ...     audit = audit_apc(on, off)
    >>> audit.frame.select("step", "matched_tokens", "restored_tokens").rows()[3]
    ('image-a-repeat', 80, 0)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from ..errors import KvlabError
from ..primitives.display import summary_html, table_html
from .peer_server import PeerServer
from .sessions import openai_images

STEPS = ("text", "text-repeat", "image-a", "image-a-repeat", "image-b")
STAT_KEYS = ("lookups_hit", "lookups_miss", "matched_tokens", "restored_tokens", "stored_tokens")


def audit_sequence(seed: int = 0, system_tokens: int = 48, image_size: int = 56) -> list[tuple[str, tuple]]:
    """The ordered (step, OpenAI messages) of :data:`STEPS`, from ``kv.workloads.multimodal``:
    image-a and image-b are two seeded images of one size under the same question.

    Example:
        >>> [s for s, _ in audit_sequence()]
        ['text', 'text-repeat', 'image-a', 'image-a-repeat', 'image-b']
    """
    from ..workloads.multimodal import multimodal

    wl = multimodal(num_requests=4, seed=seed, traffic="mixed", image_every=2, distinct_images=2,
                    image_size=image_size, system_tokens=system_tokens)
    text, a, _, b = (openai_images(r.messages)[0] for r in wl.requests)
    return [("text", text), ("text-repeat", text), ("image-a", a), ("image-a-repeat", a), ("image-b", b)]


def reusable_prefix(ids, images, earlier) -> int:
    """Longest prefix of ``ids`` an exact cache could reuse from any of ``earlier`` (``(ids,
    images)`` pairs; images as ``(hash, token_start)``): the common token prefix, cut at the first
    image that differs, at most ``len(ids) - 1`` (the last prompt token is always computed).

    Example:
        >>> reusable_prefix([1, 9, 9, 2], [("a", 1)], [([1, 9, 9, 2], [("b", 1)])])
        1
    """
    best = 0
    for ids_j, images_j in earlier:
        n = next((k for k, (x, y) in enumerate(zip(ids, ids_j)) if x != y), min(len(ids), len(ids_j)))
        for k, img in enumerate(images):
            if img[1] < n and (k >= len(images_j) or images_j[k] != img):
                n = img[1]
        best = max(best, n)
    return min(best, len(ids) - 1)


def apc_block_rules(requests, block_size: int, media_ids) -> list[dict]:
    """What mlx-vlm's APC (dense KV, block mode) matches, reuses and stores for each of
    ``requests`` (``(ids, extra)`` in order; ``extra`` is the request's image salt, e.g. the tuple
    of its image hashes): ``matched`` = full blocks of ``ids[:-1]`` already stored under the same
    salt; ``hit`` = matched > 0; ``reused`` = matched unless those tokens hold an image token
    (then 0); ``stored`` = the request's full prompt blocks not stored before.

    Example:
        >>> [r["matched"] for r in apc_block_rules([((1,) * 40, ()), ((1,) * 40, ())], 16, {7})]
        [0, 32]
    """
    stored: set = set()
    out = []
    for ids, extra in requests:
        ids = tuple(ids)
        chain = [(extra, ids[:(k + 1) * block_size]) for k in range(len(ids) // block_size)]
        probe = [(extra, ids[:(k + 1) * block_size]) for k in range((len(ids) - 1) // block_size)]
        matched = block_size * next((k for k, key in enumerate(probe) if key not in stored), len(probe))
        reused = 0 if any(t in media_ids for t in ids[:matched]) else matched
        new = [key for key in chain if key not in stored]
        stored.update(chain)
        out.append({"matched": matched, "hit": matched > 0, "reused": reused, "stored": block_size * len(new)})
    return out


@dataclass(frozen=True, eq=False)
class ApcAudit:
    """One audit: ``frame`` has a row a step (see the module docstring); ``settings`` are the APC
    server's reported settings."""

    frame: pl.DataFrame
    settings: dict = field(default_factory=dict)

    def disagreements(self) -> pl.DataFrame:
        """Steps where APC's counters, its rules as documented, its usage or its answers disagree."""
        f = self.frame
        bad = (f["matched_tokens"] != f["restored_tokens"]) | (f["cached_tokens"] != f["restored_tokens"])
        if f["apc_matched"].null_count() < f.height:  # a dense model: APC's block rules apply
            bad = bad | (f["matched_tokens"] != f["apc_matched"]) | (f["restored_tokens"] != f["apc_reused"])
        if "same_reply" in f.columns:
            bad = bad | ~f["same_reply"]
        return f.filter(bad)

    def findings(self) -> list[str]:
        """One sentence per thing the audit found, disagreements first, then where APC reused."""
        out = []
        for r in self.frame.iter_rows(named=True):
            s = r["step"]
            if r["matched_tokens"] > r["restored_tokens"]:
                out.append(f"{s}: APC's stats count a {'hit' if r['lookups_hit'] else 'lookup'} of "
                           f"{r['matched_tokens']} matched tokens but it restored {r['restored_tokens']} "
                           f"(usage cached_tokens {r['cached_tokens']}): its matched_tokens and "
                           "token_hit_rate count tokens it did not reuse")
            if r["reusable_tokens"] > r["restored_tokens"]:
                out.append(f"{s}: {r['reusable_tokens']} of {r['prompt_tokens_kvlab']} prompt tokens were "
                           f"reusable exactly (kv.tokenise); APC reused {r['restored_tokens']}")
            if r.get("same_reply") is False:
                out.append(f"{s}: the APC-on answer differs from the APC-off answer (greedy)")
            if r["restored_tokens"] > 0:
                out.append(f"{s}: APC reused {r['restored_tokens']} tokens")
            if r["other_image_same_ids"] and r["restored_tokens"] <= r["reusable_tokens"]:
                out.append(f"{s}: same token ids as an earlier request with another image, and APC reused "
                           f"{r['restored_tokens']} tokens, none past the image: it never replays the "
                           "wrong image's KV (pitfall 2)")
        return out

    def __repr__(self) -> str:
        return (f"ApcAudit({self.frame.height} steps, {self.disagreements().height} disagreeing, "
                f"block_size={self.settings.get('apc_block_size')})")

    def _repr_html_(self) -> str:
        cols = ("step", "prompt_tokens", "reusable_tokens", "apc_matched", "apc_reused", "lookups_hit",
                "matched_tokens", "restored_tokens", "cached_tokens")
        rows = [tuple(r[c] for c in cols) for r in self.frame.iter_rows(named=True)]
        body = table_html(cols, rows) + "<ul>" + "".join(f"<li>{x}</li>" for x in self.findings()) + "</ul>"
        return summary_html(repr(self), body=body)


def audit_apc(on, off=None, vlm="tiny-vlm", *, sequence=None, max_tokens: int = 8,
              timeout: float = 120.0) -> ApcAudit:
    """Send ``sequence`` (default :func:`audit_sequence`) one request at a time to the APC server
    ``on`` (a PeerServer or URL) and, if given, to the APC-off server ``off``; tokenise each with
    ``vlm`` (a kvlab VLModel or name, the model the servers run) and return the audit.

    Example:
        >>> audit_apc(on, off).findings()[0]
        'image-a-repeat: APC's stats count a hit of 80 matched tokens but it restored 0 ...'
    """
    import httpx

    from ..primitives.tokens import tokenise
    from ..vlm import load_vlm

    vlm = load_vlm(vlm) if isinstance(vlm, str) else vlm
    seq = sequence or audit_sequence()
    urls = {"on": _url(on), "off": _url(off) if off is not None else None}
    with httpx.Client(timeout=timeout) as http:
        models = {k: _model(http, u) for k, u in urls.items() if u}
        stats = _stats(http, urls["on"])
        if not stats.get("enabled"):
            raise KvlabError(f"{urls['on']}/v1/cache/stats reports APC disabled: audit a server started "
                             "with APC on (start_mlx_vlm(model, apc=True))")
        bs = int(stats["block_size"])
        rows, seen, plan = [], [], []
        for step, messages in seq:
            toks = tokenise(vlm, list(messages))
            images = [(im.hash, im.token_start) for im in toks.images]
            before = stats
            reply, usage = _chat(http, urls["on"], models["on"], messages, max_tokens)
            stats = _stats(http, urls["on"])
            row = {"step": step, "prompt_tokens": usage.get("prompt_tokens"),
                   "prompt_tokens_kvlab": len(toks.ids),
                   "reusable_tokens": reusable_prefix(list(toks.ids), images, seen) if seen else 0,
                   **{k: int(stats[k]) - int(before[k]) for k in STAT_KEYS},
                   "cached_tokens": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                   "reply": reply}
            if urls["off"]:
                row["reply_off"] = _chat(http, urls["off"], models["off"], messages, max_tokens)[0]
                row["same_reply"] = row["reply_off"] == reply
            row["other_image_same_ids"] = any(ids == list(toks.ids) and imgs != images for ids, imgs in seen)
            rows.append(row)
            seen.append((list(toks.ids), images))
            plan.append((tuple(toks.ids), tuple(h for h, _ in images)))
    # APC's block rules are its dense-KV mode; windowed, recurrent and composite caches go through
    # its checkpoints instead, which the rules do not model: no predicted column there
    dense = vlm.layout.restores_anywhere
    rules = apc_block_rules(plan, bs, {vlm.image_token_id}) if dense else [{}] * len(rows)
    for row, rule in zip(rows, rules):
        row.update(apc_matched=rule.get("matched"), apc_hit=rule.get("hit"), apc_reused=rule.get("reused"),
                   apc_stored=rule.get("stored"))
    return ApcAudit(pl.DataFrame(rows), dict(on.settings.get("reported", {})) if isinstance(on, PeerServer) else {})


def _url(server) -> str:
    return server.url if isinstance(server, PeerServer) else str(server).rstrip("/")


def _model(http, url: str) -> str:
    data = http.get(f"{url}/v1/models").json().get("data") or []
    if not data:
        raise KvlabError(f"{url}/v1/models lists no model; is the mlx-vlm server's --model loaded?")
    return str(data[0]["id"])


def _stats(http, url: str) -> dict:
    r = http.get(f"{url}/v1/cache/stats")
    if r.status_code != 200:
        raise KvlabError(f"{url}/v1/cache/stats answered HTTP {r.status_code}; audit an mlx-vlm server")
    return r.json()


def _chat(http, url: str, model: str, messages, max_tokens: int) -> tuple[str, dict]:
    body = {"model": model, "messages": list(messages), "max_tokens": max_tokens, "temperature": 0.0,
            "stream": False}
    r = http.post(f"{url}/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise KvlabError(f"{url} answered HTTP {r.status_code} to an audit request: {r.text[:300]}")
    data = r.json()
    return data["choices"][0]["message"]["content"] or "", data.get("usage") or {}
