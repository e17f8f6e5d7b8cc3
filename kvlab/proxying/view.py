"""What ``kv.Inspector`` reads from a live source, for a proxy: each finished row as a ``kv.Result``
(the Engine's and kvlab serve's type), the proxy's events, ``stats()`` and ``on_result``.

The proxy sees no store: a Result's ``reused_tokens`` is what the upstream reported (0 when it
reported nothing), ``prompt_ids`` the prompt as the proxy tokenised it (empty without a
tokenizer), ``diverged_at`` where it parted from the request it extends and ``why`` the row's
structural diagnosis. Listeners run on a thread of their own, so a notebook widget never holds
up a response.

Example:
    >>> with kv.proxy(upstream.url, tokenizer="tiny") as p:
    ...     ins = kv.Inspector(p)          # follows the proxy live, like a kvlab server
"""

from __future__ import annotations

import logging
import queue
import threading

from ..primitives.display import summary_html
from ..result import Result, hit_rates
from ..serving.events import ServerEvents

log = logging.getLogger("kvlab.proxy")


class LiveView:
    """Results, events and listeners of a proxy (module docstring)."""

    def __init__(self):
        self.results: list[Result] = []
        self.events_log = ServerEvents()  # kvlab serve's event rows: arrive, finish
        self._listeners: list = []
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._notify, name="kvlab-proxy-listeners", daemon=True)
        self._thread.start()

    def add(self, source, row: dict, prompt_ids) -> Result:
        """The Result of a finished row (``prompt_ids``: its token ids or None); listeners are
        called with ``(source, result)``."""
        ttft = row["ttft_s"] if row["ttft_s"] is not None else row["e2e_s"]
        prompt = row["prompt_tokens"] or row["upstream_prompt_tokens"] or 0
        reused = min(row["reused_tokens"] or 0, prompt)
        diagnosis = row["diagnosis"] if isinstance(row["diagnosis"], dict) else {}
        result = Result(request_id=row["id"], prompt_tokens=prompt, reused_tokens=reused,
                        prefilled_tokens=prompt - reused, match="hit" if reused else "miss", ttft_s=ttft,
                        lookup_s=0.0, restore_s=0.0, prefill_s=ttft, decode_s=max(0.0, row["e2e_s"] - ttft),
                        output_ids=(), text="", store_bytes=0, evictions=0,
                        why=diagnosis.get("description") or "", prompt_ids=tuple(prompt_ids or ()),
                        diverged_at=row["diverged_at"])
        with self._lock:
            self.results.append(result)
        self.events_log.add("arrive", request=row["id"], tokens=prompt, detail=row["route"])
        self.events_log.add("finish", request=row["id"], tokens=int(row["output_tokens"] or 0), detail=row["status"])
        if self._listeners:
            self._queue.put((source, result))
        return result

    def on_result(self, callback) -> None:
        self._listeners.append(callback)

    @property
    def events(self):
        return self.events_log.frame()

    def stats(self) -> dict:
        with self._lock:
            results = list(self.results)
        return {"requests": len(results), "prompt_tokens": sum(r.prompt_tokens for r in results),
                "reused_tokens": sum(r.reused_tokens for r in results),
                **hit_rates((r.prompt_tokens, r.reused_tokens) for r in results), "bytes": 0, "entries": 0,
                "evictions": 0, "miss_reasons": {}}

    def _notify(self) -> None:
        while True:
            source, result = self._queue.get()
            for callback in list(self._listeners):
                try:
                    callback(source, result)
                except Exception:  # noqa: BLE001  a widget's bug must not stop the others
                    log.warning("kvlab proxy: an on_result listener failed", exc_info=True)

    def __repr__(self) -> str:
        return f"LiveView({len(self.results)} results, {len(self._listeners)} listeners)"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)
