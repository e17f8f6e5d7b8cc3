"""Ledger: what each request of a live server did, from arrival to its last token.

The HTTP thread opens a request (arrival time, API, messages); mlx-lm's generation thread reports
its prompt ids, the cached tokens mlx-lm counted, every token and the end (through the response
queue the server observes); a client that leaves ends it from the HTTP thread. Each finished
request becomes a ``kv.Result`` (the Engine's type, so ``kv.Inspector`` reads it), a recorded line
(``--record``) and a call to every ``on_result`` listener, on a listener thread of its own so a
slow notebook widget never holds up serving.

Each request belongs to a tenant (kvlab.tenants; one tenant on a server without tenants). Besides
the server's own lists, every tenant has its own: its results and ``/kvlab/requests`` rows,
numbered from 0 for it, in which a miss is explained only by what it may know: ``evicted_by``
only when the evicting request is its own, and ``why`` without what the store said about
other tenants' entries (``kvlab.reuse.Reuse.scoped_why``).

Example:
    >>> ledger = Ledger(adapter, events, model)
    >>> ledger.results[-1].reused_tokens
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from dataclasses import replace

from ..primitives import timing
from ..primitives.display import summary_html
from ..result import Result, hit_rates
from .diagnosing import request_row

log = logging.getLogger("kvlab.serving")
RECORDED = ("ok", "disconnected")  # statuses written to the recording: the request ran


class Ledger:
    """Per-request bookkeeping shared by the server's threads (see module docstring)."""

    def __init__(self, adapter, events, model, *, recorder=None, meta: dict | None = None):
        self.adapter = adapter
        self.events = events
        self.model = model
        self.recorder = recorder
        self.meta = dict(meta or {})
        self.results: list[Result] = []
        self.rows: list[dict] = []  # one /kvlab/requests row per finished request, in finish order
        self.failed = 0
        self.tenant_of: dict[int, str | None] = {}  # rid -> its tenant, for every request opened
        self._tenants: dict[str | None, dict] = {}  # tenant -> its own results, rows, failures
        self._open: dict[int, dict] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._listeners: list = []
        self._notify: queue.Queue = queue.Queue()
        self._notifier = threading.Thread(target=self._run_listeners, name="kvlab-listeners", daemon=True)
        self._notifier.start()

    # -- the HTTP thread --------------------------------------------------------------------------
    def open(self, *, api: str, stream: bool, messages=None, normalised: bool = False,
             response_id: str | None = None, tenant: str | None = None) -> int:
        rid = next(self._ids)
        with self._lock:
            self.tenant_of[rid] = tenant
            self._open[rid] = {"arrival": timing.wall(), "t0": timing.now(), "api": api,
                               "stream": bool(stream), "messages": messages, "normalised": normalised,
                               "prompt": None, "reused": 0, "first": None, "tokens": [],
                               "finish_reason": None, "response_id": response_id, "lookup": None,
                               "tenant": tenant}
        self.events.add("arrive", request=rid, detail=api, tenant=tenant)
        return rid

    # -- the generation thread --------------------------------------------------------------------
    def tokenized(self, rid, prompt, images=()) -> None:
        """Request ``rid``'s prompt ids (and a VLM request's image keys: (start, end, pixel hash))."""
        with self._lock:
            if rid in self._open:
                self._open[rid]["prompt"] = tuple(prompt)
                self._open[rid]["images"] = tuple(images)

    def admitted(self, rid, ctx) -> None:
        # the lookup is done (the context is passed on only after it): keep what it found for
        # the handler's diagnostics, which may run after done() took the adapter's copy
        with self.adapter.lock:
            lookup = dict(self.adapter.requests.get(rid) or {})
        with self._lock:
            if rid in self._open:
                self._open[rid]["reused"] = max(0, int(ctx.prompt_cache_count))
                self._open[rid]["prompt"] = tuple(ctx.prompt)
                self._open[rid]["lookup"] = lookup

    def live(self, rid) -> dict | None:
        """Request ``rid``'s own record while it runs (the same dict stays readable after it
        finishes): the handler reads its prompt ids and lookup from it."""
        with self._lock:
            return self._open.get(rid)

    def token(self, rid, response) -> None:
        first = False
        with self._lock:
            r = self._open.get(rid)
            if r is None:
                return
            if r["first"] is None:
                r["first"], first = timing.now(), True
            r["tokens"].append(int(response.token))
            if response.finish_reason is not None:
                r["finish_reason"] = response.finish_reason
        if first:
            self.events.add("first_token", request=rid, tenant=r["tenant"])
        if self.on_token is not None:
            self.on_token(rid, response)

    # -- either thread ----------------------------------------------------------------------------
    def done(self, rid, status: str = "ok", error: str | None = None) -> Result | None:
        """End request ``rid`` (idempotent: the first call wins). Returns its Result, if it ran."""
        with self._lock:
            r = self._open.pop(rid, None)
        if r is None:
            return None
        end = timing.now()
        self.adapter.end(rid)
        info = self.adapter.request_info(rid)
        tenant = r["tenant"]
        self.events.add("finish", request=rid, tokens=len(r["tokens"]), detail=status if error is None
                        else f"{status}: {error}", tenant=tenant)
        if r["prompt"] is None or status not in RECORDED:
            with self._lock:
                self.failed += 1
                self._own(tenant)["failed"] += 1
            return None
        if "reused" in info:  # the lookup's own count: mlx-lm's sequential path sets its ctx's later
            r["reused"] = info["reused"]
        result = self._result(rid, r, info, end)
        rec = self._record(rid, r, info, result, status, end)
        with self._lock:
            self.results.append(result)
            self.rows.append(request_row(len(self.rows), result, r["api"], r["response_id"], r["stream"], tenant))
            own = self._own(tenant)
            # what the tenant may read: its own evicting requests, the store's word on its own keys
            theirs = replace(result, why=info.get("scoped_why", result.why), evicted_by=(
                result.evicted_by if self.tenant_of.get(result.evicted_by, tenant) == tenant else None))
            own["results"].append(theirs)
            own["rows"].append(request_row(len(own["rows"]), theirs, r["api"], r["response_id"], r["stream"], tenant))
            item = (result, theirs, tenant)
        if self.recorder is not None:
            try:
                self.recorder.write(rec)
            except Exception as e:  # noqa: BLE001  a full disk must not stop serving; say so loudly
                log.error("kvlab serve: could not record request %s: %s", rid, e)
                self.events.add("error", request=rid, detail=f"record: {e}")  # the operator's row
        if self._listeners:
            self._notify.put(item)
        return result

    def _result(self, rid, r, info, end) -> Result:
        prompt, out, reused = r["prompt"], tuple(r["tokens"]), r["reused"]
        ttft = (r["first"] - r["t0"]) if r["first"] is not None else end - r["t0"]
        lookup, restore = info.get("lookup_s", 0.0), info.get("restore_s", 0.0)
        text = self.model.tokenizer.decode(list(out)) if out else ""
        return Result(
            request_id=rid, prompt_tokens=len(prompt), reused_tokens=reused,
            prefilled_tokens=len(prompt) - reused, match=info.get("kind", "miss") if reused else "miss",
            ttft_s=ttft, lookup_s=lookup, restore_s=restore, prefill_s=max(0.0, ttft - lookup - restore),
            decode_s=max(0.0, end - r["t0"] - ttft), output_ids=out, text=text,
            store_bytes=self.adapter.nbytes, evictions=info.get("evictions", 0), why=info.get("why", ""),
            entry_tokens=info.get("entry_tokens", 0) or 0, prompt_ids=prompt,
            miss_reasons=info.get("miss_reasons") or {}, diverged_at=info.get("diverged_at"),
            evicted_by=info.get("evicted_by"))

    def _own(self, tenant) -> dict:
        """``tenant``'s own lists (under the lock)."""
        if tenant not in self._tenants:
            self._tenants[tenant] = {"results": [], "rows": [], "failed": 0}
        return self._tenants[tenant]

    def _record(self, rid, r, info, result: Result, status, end) -> dict:
        return {"request": rid, "tenant": r["tenant"], "key": info.get("key"), "arrival": r["arrival"],
                "finish": r["arrival"] + (end - r["t0"]),
                "ttft_s": result.ttft_s, "e2e_s": end - r["t0"], "reused_tokens": r["reused"],
                "match": result.match, "status": status, "finish_reason": r["finish_reason"],
                "api": r["api"], "stream": r["stream"], "normalise": r["normalised"], **self.meta,
                "prompt_ids": r["prompt"], "output_ids": result.output_ids, "messages": r["messages"],
                "text": result.text}

    # -- listeners --------------------------------------------------------------------------------
    def on_result(self, callback, caller=None) -> None:
        """Call ``callback(owner, result)`` for every finished request (a non-admin ``caller``:
        its tenant's, as that tenant may read them)."""
        self._listeners.append((callback, caller))

    def _run_listeners(self) -> None:
        while True:
            item = self._notify.get()
            if item is None:
                return
            result, theirs, tenant = item
            for fn, caller in list(self._listeners):
                if not _everything(caller) and caller.tenant != tenant:
                    continue
                try:
                    fn(self.owner, result if _everything(caller) else theirs)
                except Exception as e:  # noqa: BLE001  a listener's bug must not stop the others
                    log.warning("kvlab serve: on_result listener failed: %s", e)

    owner = None  # what listeners receive as their first argument (the Server)
    on_token = None  # called (rid, response) on the generation thread for each token (ITL)

    def close(self) -> None:
        """Stop the listener thread after it has delivered every finished request."""
        self._notify.put(None)
        self._notifier.join(timeout=30)

    def rows_since(self, since: int = 0, caller=None) -> list[dict]:
        """The ``/kvlab/requests`` rows from number ``since`` on (per request, not cumulative):
        every request's, or with a non-admin ``caller`` (kvlab.tenants.Caller) its tenant's own."""
        with self._lock:
            rows = self.rows if _everything(caller) else self._own(caller.tenant)["rows"]
            return rows[max(0, since):]

    def finished(self, caller=None) -> list[Result]:
        """Every finished request's Result, or a non-admin ``caller``'s tenant's own."""
        with self._lock:
            return list(self.results if _everything(caller) else self._own(caller.tenant)["results"])

    @property
    def inflight(self) -> list[int]:
        with self._lock:
            return sorted(self._open)

    def stats(self, caller=None) -> dict:
        """Both hit-rate definitions, named, over finished requests (as ``Engine.stats``): every
        request's, or a non-admin ``caller``'s tenant's."""
        with self._lock:
            if _everything(caller):
                results, failed = list(self.results), self.failed
            else:
                own = self._own(caller.tenant)
                results, failed = list(own["results"]), own["failed"]
        return {"requests": len(results), "failed": failed,
                "prompt_tokens": sum(r.prompt_tokens for r in results),
                "reused_tokens": sum(r.reused_tokens for r in results),
                **hit_rates((r.prompt_tokens, r.reused_tokens) for r in results),
                "evictions": sum(r.evictions for r in results)}

    def __repr__(self) -> str:
        s = self.stats()
        return f"Ledger({s['requests']} finished, {len(self.inflight)} running)"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def _everything(caller) -> bool:
    return caller is None or caller.admin
