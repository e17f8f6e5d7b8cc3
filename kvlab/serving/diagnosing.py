"""The providers' cache diagnostics on ``kvlab serve``: per-server glue between the HTTP handler,
the ledger and the model-free ``kvlab.diagnostics``.

Every answered chat completion and Messages request is remembered in a ``FingerprintLog`` under
the id of its response (mlx-lm's ``chatcmpl-<uuid4>``, kvlab's ``msg_<96 random bits>``), with its
``PromptShape`` and its rendered prompt ids, before the first byte of the response is written
(so a client can never name an id the server has not remembered yet). A request that asks gets:

- ``/v1/messages`` with ``"diagnostics": {"previous_message_id": ...}`` (the beta header
  ``cache-diagnosis-2026-04-07`` is accepted, not required): the message's ``diagnostics``
  exactly as Anthropic's (null on the first turn and when nothing diverged; else
  ``{"cache_miss_reason": {"type": ..., "cache_missed_input_tokens": N}}``;
  ``previous_message_not_found`` for an unknown or expired id), in the JSON message and, streamed,
  in the ``message_start`` event's message. kvlab's detail is in ``diagnostics["kvlab"]``; when
  Anthropic's value is null it goes in a top-level ``kvlab_diagnostics`` field beside it.
- ``/v1/chat/completions`` with ``"prompt_cache_options": {"comparison_response_id": ...}``:
  ``prompt_cache_diagnostics`` (OpenAI's Responses object, field for field) at the top level of
  the completion object and, streamed, of the *first* chunk. OpenAI documents the object for
  Responses only (there it is read from the ``response.completed`` event); chat completions has
  no such event, and the first chunk is where a streaming client first reads the completion's
  own fields (``id``, ``model``), so kvlab puts it there. kvlab's detail is in its ``kvlab`` key.

kvlab's detail (``kvlab.diagnostics.extension``, plus ``store``): the structural comparison, the
token index where the two rendered prompts diverge with the text around it, the token counts,
and what the store did for this request: match kind, reused tokens, the missed tokens by reason
(``miss_reasons``, only the non-zero ones: the tokens lost to each), ``diverged_at``,
``evicted_by`` (the ledger's request id whose insert evicted the first lost token),
``eviction_policy`` (the store's policy name) and ``why`` (a refused lookup names the layer kind). Both prompts' token
ids are known before the first streamed event: mlx-lm tokenises and looks up a request before it
hands the handler its generation context, and the ledger keeps what the lookup found.

Tenants (kvlab.tenants): each remembered response belongs to its request's tenant. A caller who
names another tenant's response id gets the providers' not-found answer, exactly as for an id
never answered (never its text, its length or the fact that it exists); its own store detail says
``evicted_by`` only for its own requests and no ``why`` the store gave about other tenants' entries.
An admin caller compares with any response.

Example:
    >>> served = ServedDiagnostics(model, "radix")
    >>> pending = served.request(body, "anthropic", headers)   # DiagnosticsError -> 400
    >>> served.answer(pending, ledger.live(rid))                # {"diagnostics": ..., ...}
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..diagnostics import (FingerprintLog, anthropic_request, anthropic_unavailable, answer, not_found,
                           openai_request, openai_unavailable, shape_of)
from ..errors import DiagnosticsError
from ..primitives.display import summary_html, table_html
from ..primitives.tokens import Tokens, from_ids
from .image_diagnostics import with_images

log = logging.getLogger("kvlab.serving")
ROW_FIELDS = ("seq", "request_id", "response_id", "api", "stream", "prompt_tokens", "reused_tokens",
              "missed_tokens", "main_reason", "miss_reasons", "diverged_at", "evicted_by", "why", "ttft_s",
              "tenant")


@dataclass
class Pending:
    """What one request asked for: its ``api`` (``"chat"`` or ``"anthropic"``), its shape (None
    when it could not be read and nothing was asked), whether it ``wants`` diagnostics and the id
    it compares with (None: the first turn)."""

    api: str
    shape: object
    wants: bool = False
    previous_id: str | None = None


def nonzero(reasons) -> dict:
    """The reasons that cost tokens, largest first (ties in the store's order)."""
    items = [(k, int(v)) for k, v in (reasons or {}).items() if v]
    return dict(sorted(items, key=lambda kv: -kv[1]))


def request_row(seq: int, result, api: str, response_id: str | None, stream: bool,
                tenant: str | None = None) -> dict:
    """One ``/kvlab/requests`` row: what this request alone reused and missed, and why (``why``:
    the lookup's own sentence, e.g. which image of a VLM request differs from the cached one),
    and the tenant it belongs to (kvlab.tenants).

    Example:
        >>> row = request_row(0, server.results[0], "chat", "chatcmpl-1", False)
        >>> row["missed_tokens"] == row["prompt_tokens"] - row["reused_tokens"]
        True
    """
    reasons = nonzero(result.miss_reasons)
    return {"seq": seq, "request_id": result.request_id, "response_id": response_id, "api": api,
            "stream": bool(stream), "prompt_tokens": result.prompt_tokens,
            "reused_tokens": result.reused_tokens, "missed_tokens": result.prompt_tokens - result.reused_tokens,
            "main_reason": next(iter(reasons), None), "miss_reasons": reasons,
            "diverged_at": result.diverged_at, "evicted_by": result.evicted_by, "why": result.why,
            "ttft_s": result.ttft_s, "tenant": tenant}


class ServedDiagnostics:
    """Remembers a server's answered requests and computes the provider objects (module
    docstring). ``max_entries`` bounds memory: each entry holds a reference to its prompt ids
    (the same tuple the ledger's ``Result`` keeps), ``ttl_s`` is how long an id stays comparable."""

    def __init__(self, model, store_name: str = "", *, store=None, max_entries: int = 1024,
                 ttl_s: float = 3600.0):
        self.model, self.store_name = model, store_name
        self.policy = store.capabilities.eviction_policy if store is not None else None
        self.log = FingerprintLog(max_entries=max_entries, ttl_s=ttl_s)
        self.images: OrderedDict[str, tuple] = OrderedDict()  # response id -> a VLM request's image keys
        self.tenant_of = lambda rid: None  # request id -> tenant (the server sets its ledger's)
        self.max_entries = max_entries
        self.asked = self.not_found = 0
        self._count = threading.Lock()  # handler threads answer concurrently

    def request(self, body, api: str, headers=None) -> Pending | None:
        """What ``body`` asks for; DiagnosticsError (the caller answers 400) when its diagnostics
        object is malformed. None when the body cannot be remembered and asks for nothing."""
        if api == "anthropic":
            wants, previous = anthropic_request(body, headers)
        else:
            wants, previous = openai_request(body)
        try:
            shape = shape_of(body, api)
        except DiagnosticsError:
            if wants:
                raise
            return None  # mlx-lm or to_chat judge the request; only diagnostics need its shape
        return Pending(api, shape, wants, previous)

    def answer(self, pending: Pending | None, live: dict | None, caller=None) -> dict:
        """The fields to add to the response (``{}`` when nothing was asked), computed from the
        request's ``live`` ledger record (its prompt ids and lookup); remembers the request
        under its response id first. ``caller`` (a kvlab.tenants.Caller; None: sees all) may
        compare only with its tenant's responses. Never raises: a failure answers the provider's
        ``unavailable``."""
        if pending is None or live is None or live.get("prompt") is None:
            return {}
        prompt, rid = live["prompt"], live.get("response_id")
        if rid:
            # a Tokens without text shares the ledger's tuple: no second copy of the ids
            self.log.remember(rid, pending.shape, Tokens(prompt, ""), owner=live.get("tenant"))
        seen = self.log if caller is None else self.log.seen_by(caller.sees)
        images = tuple(live.get("images") or ())
        with self._count:
            if rid and images:
                self.images[rid] = images
                while len(self.images) > self.max_entries:
                    self.images.popitem(last=False)
            visible = pending.previous_id is not None and pending.previous_id in seen
            previous = self.images.get(pending.previous_id, ()) if visible else ()
        if not pending.wants:
            return {}
        with self._count:
            self.asked += 1
        store = self.store_detail(prompt, live.get("lookup") or {}, caller)
        try:
            # identical ids with other pixels: cut the id comparison back to the image
            return with_images(self._answer(pending, prompt, store, seen), previous, images)
        except Exception as e:  # noqa: BLE001  diagnostics must never fail the request they ride on
            log.warning("kvlab serve: diagnostics failed for %s: %s: %s", rid, type(e).__name__, e, exc_info=True)
            ext = {"store": store, "error": f"{type(e).__name__}: {e}"}
            if pending.api == "anthropic":
                return {"diagnostics": anthropic_unavailable(ext)}
            return {"prompt_cache_diagnostics": openai_unavailable(ext)}

    def _answer(self, pending: Pending, prompt, store: dict, log) -> dict:
        tok = self.model.tokenizer
        current = from_ids(prompt, tok, chatml_spans=True)
        obj, beside = answer(log, pending.previous_id, pending.shape, current,
                             cached_tokens=int(store["reused_tokens"]),
                             provider="anthropic" if pending.api == "anthropic" else "openai",
                             extra={"store": store}, render=lambda t: from_ids(t.ids, tok, chatml_spans=True))
        if not_found(obj):
            with self._count:
                self.not_found += 1
        if pending.api == "anthropic":
            return {"diagnostics": obj} if beside is None else {"diagnostics": None, "kvlab_diagnostics": beside}
        return {"prompt_cache_diagnostics": obj}

    def store_detail(self, prompt, lookup: dict, caller=None) -> dict:
        """What the store did for a request, from the adapter's lookup info, as ``caller`` (a
        kvlab.tenants.Caller; None: sees all) may read it."""
        reused = int(lookup.get("reused", 0) or 0)
        reasons = nonzero(lookup.get("miss_reasons"))
        why, evicted_by = lookup.get("why", ""), lookup.get("evicted_by")
        if caller is not None and not caller.admin:
            why = lookup.get("scoped_why", why)
            evicted_by = evicted_by if evicted_by is None or caller.sees(self.tenant_of(evicted_by)) else None
        return {"store": self.store_name, "match": lookup.get("kind", "miss") if reused else "miss",
                "reused_tokens": reused, "missed_tokens": len(prompt) - reused,
                "main_reason": next(iter(reasons), None), "miss_reasons": reasons,
                "diverged_at": lookup.get("diverged_at"), "evicted_by": evicted_by,
                "eviction_policy": self.policy, "why": why}

    def __repr__(self) -> str:
        return (f"ServedDiagnostics({len(self.log)} remembered, {self.asked} asked, "
                f"{self.not_found} not found)")

    def _repr_html_(self) -> str:
        rows = [("remembered", len(self.log)), ("asked", self.asked), ("not found", self.not_found),
                ("ttl", f"{self.log.ttl_s:g} s")]
        return summary_html("ServedDiagnostics", self.store_name, body=table_html(None, rows, row_headers=True))


__all__ = ["Pending", "ROW_FIELDS", "ServedDiagnostics", "nonzero", "request_row"]
