"""StoreAdapter: any kvlab store behind mlx-lm's prompt-cache interface, so ``mlx_lm.server``'s
``ResponseGenerator(model_provider, prompt_cache)`` batches requests over a kvlab store.

mlx-lm calls, all on its generation thread: ``fetch_nearest_cache(model_key, tokens)`` once per
request after tokenising it (-> ``(cache or None, tokens still to prefill)``), ``insert_cache(
model_key, tokens, cache, cache_type=...)`` at each prompt segment boundary (``system``,
``user``) and when a request finishes (``assistant``: prompt + output), ``trim_to(n_bytes=...)``
only when ``--prompt-cache-bytes`` is set, and ``nbytes`` / ``len`` / ``stats_by_type()`` to log.
HTTP threads read stats concurrently, so every store call runs under one lock.

Keys are ``kv.cache_key`` of ``kv.tokens.from_ids(ids, tokenizer, chatml_spans=True)`` (message
spans recovered from ChatML markers, so the system-prompt store finds its boundary; stores that key
on ids alone get ``from_ids(ids)``, which skips the per-token decode). A lookup may
reuse at most n - 1 tokens (mlx-lm needs one token to prefill). What is handed to mlx-lm is
``kv.restore`` of the (trimmed) snapshot: fresh cache objects over copy-on-write views, never the
store's own arrays (pitfall 3 in the README).

Each lookup also says why the prompt's other tokens missed (``kvlab.miss_reasons``, the Engine's
definitions), from a memory of what this store cached and lost; the ledger puts the reasons in the
request's ``kv.Result``.

Example:
    >>> adapter = StoreAdapter(kv.make_store("radix"), kv.load("tiny"), ServerEvents())
    >>> ResponseGenerator(provider, adapter)
"""

from __future__ import annotations

import html
import logging
import threading
import time
from dataclasses import replace

from ..errors import KvlabError
from ..keys import cache_key
from ..miss_reasons import MissIndex
from ..primitives.snapshots import make_cache, non_trimmable_layers, restore, snapshot, trim
from ..primitives.tokens import from_ids
from .events import ServerEvents

SEGMENTS = ("assistant", "user", "system")  # mlx-lm's cache types, in its eviction order
KIND = {"system": "system", "user": "prompt", "assistant": "prompt+output"}  # kvlab insert kinds
ADDS, REMOVES = ("insert", "block_stored"), ("evict", "block_removed")
log = logging.getLogger("kvlab.serving")


class Attribution:
    """Which request a prompt-cache call belongs to: mlx-lm passes no request id, so the server's
    generator names the request being tokenised (``begin``) and the one finishing (``finishing``,
    set right before mlx-lm's final insert); a segment insert is the in-flight request whose
    prompt starts with its tokens and has a segment boundary at its length."""

    def __init__(self, events: ServerEvents):
        self.events = events
        self.lock = threading.RLock()
        self.current: int | None = None
        self.finishing_rid: int | None = None
        self.inflight: dict[int, tuple[tuple[int, ...], set[int]]] = {}
        self.requests: dict[int, dict] = {}  # rid -> what its lookup found (read by the ledger)
        self.evicted: dict[int, int] = {}  # rid -> entries evicted for room during its calls
        self.lookups = self.hits = self.reused_tokens = self.errors = 0

    def begin(self, rid, prompt, segments) -> None:
        ends, n = set(), 0
        for seg in segments:
            n += len(seg)
            ends.add(n)
        ends.add(len(prompt) - 1)  # mlx-lm splits the last token into its own segment
        with self.lock:
            self.current = rid
            if rid is not None:
                self.inflight[rid] = (tuple(prompt), ends)

    def finishing(self, rid) -> None:
        with self.lock:
            self.finishing_rid = rid

    def end(self, rid) -> None:
        """The request is over (finished, failed or its client left): it references nothing."""
        with self.lock:
            self.inflight.pop(rid, None)

    def request_info(self, rid) -> dict:
        with self.lock:
            return {**self.requests.pop(rid, {}), "evictions": self.evicted.pop(rid, 0)}

    def count_eviction(self, rid) -> None:
        if rid is not None:
            self.evicted[rid] = self.evicted.get(rid, 0) + 1

    def owner(self, tokens, cache_type) -> int | None:
        if cache_type == "assistant" and self.finishing_rid is not None:
            rid, self.finishing_rid = self.finishing_rid, None
            return rid
        n, t = len(tokens), tuple(tokens)
        for rid, (prompt, ends) in self.inflight.items():
            if n in ends and prompt[:n] == t:
                ends.discard(n)
                return rid
        return None

    def _error(self, what: str, rid, e: Exception) -> None:
        self.errors += 1
        log.warning("kvlab adapter: %s failed for request %s: %s: %s", what, rid, type(e).__name__, e,
                    exc_info=not isinstance(e, KvlabError))
        self.events.add("error", request=rid, detail=f"{what}: {type(e).__name__}: {e}")


class StoreAdapter(Attribution):
    """A kvlab store (``radix``, ``paged``, ``system``, ... or None: caching off) speaking
    mlx-lm's prompt-cache interface (see module docstring)."""

    def __init__(self, store, model, events: ServerEvents, *, budget_bytes: int | None = None):
        super().__init__(events)
        self.store = store
        self.model = model
        self.budget_bytes = budget_bytes if budget_bytes is not None else getattr(store, "budget_bytes", None)
        self.name = "none" if store is None else store.name
        self._entries: dict[str, tuple[str, int]] = {}  # store entry -> (segment, bytes)
        # Message spans cost a decode per token (~50 ms for 1,500 tokens, on mlx-lm's generation
        # thread); only the system-prompt store reads them, the others key on ids alone.
        self._spans = getattr(store, "name", "") == "system_prompt"
        self.peak_bytes = 0
        probe = snapshot(make_cache(model))
        self.trimmable = not non_trimmable_layers(probe) if probe.layers else True
        self.misses = MissIndex(getattr(store, "block_size", None),
                                unstorable=not self.trimmable and getattr(store, "slices_kv", False))

    # -- mlx-lm's interface -----------------------------------------------------------------------
    def fetch_nearest_cache(self, model_key, tokens):
        with self.lock:
            rid, start = self.current, time.perf_counter()
            self.lookups += 1
            try:
                cache, reused, info = self._fetch(list(tokens))
            except Exception as e:  # noqa: BLE001  a store bug must not kill mlx-lm's generation thread
                self._error("lookup", rid, e)
                cache, reused, info = None, 0, {"kind": "miss", "why": f"lookup failed: {e}"}
            info["lookup_s"] = time.perf_counter() - start
            self.hits += reused > 0
            self.reused_tokens += reused
            self.events.add("lookup", request=rid, tokens=len(tokens), detail=info["kind"])
            self.events.add("hit" if reused else "miss", request=rid, tokens=reused,
                            entry=info.get("entry"), detail=info["kind"])
            self._drain(rid, None, self._key(tokens))
            if rid is not None:
                self.requests[rid] = {**info, "reused": reused}
            return cache, list(tokens[reused:])

    def insert_cache(self, model_key, tokens, prompt_cache, *, cache_type: str = "assistant"):
        with self.lock:
            rid = self.owner(tokens, cache_type)
            self.events.add("offer", request=rid, tokens=len(tokens), detail=cache_type,
                            segment=cache_type)
            if self.store is None:
                return
            try:
                self._insert(list(tokens), prompt_cache, cache_type)
            except Exception as e:  # noqa: BLE001
                self._error(f"insert ({cache_type})", rid, e)
            self._drain(rid, cache_type, self._key(tokens))

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        # The Store protocol has no eviction call: a kvlab store keeps itself within budget_bytes
        # on every insert. The server never sets --prompt-cache-bytes for kvlab stores, so mlx-lm
        # does not call this; if something does, say so rather than pretend to have trimmed.
        self.events.add("trim_ignored", detail=f"n_sequences={n_sequences} n_bytes={n_bytes}: "
                        "kvlab stores enforce budget_bytes on insert")

    @property
    def nbytes(self) -> int:
        with self.lock:
            return 0 if self.store is None else int(self.store.nbytes)

    def __len__(self) -> int:
        with self.lock:
            return 0 if self.store is None else int(self.store.entries)

    def stats_by_type(self) -> dict:
        """mlx-lm's per-segment view: entries and bytes by the cache type that inserted them."""
        with self.lock:
            out = {t: {"n_sequences": 0, "n_bytes": 0} for t in SEGMENTS}
            for segment, nbytes in self._entries.values():
                out[segment]["n_sequences"] += 1
                out[segment]["n_bytes"] += nbytes
            return out

    # -- internals --------------------------------------------------------------------------------
    def _fetch(self, ids):
        if self.store is None or len(ids) < 2:
            return None, 0, {"kind": "miss", "why": "no store" if self.store is None else "one token"}
        toks = self._tokens(ids)
        key = cache_key(toks)
        match = self.store.lookup(key, toks, limit=len(ids) - 1)
        info = {"kind": match.kind, "why": match.why, "entry": match.entry_id,
                "entry_tokens": match.entry_tokens}
        reused = match.tokens if match.snapshot is not None and match.tokens > 0 else 0
        missed = self.misses.explain(key, reused, untrimmable=not self.trimmable)
        info.update(miss_reasons=missed.reasons, diverged_at=missed.diverged_at, evicted_by=missed.evicted_by)
        if not reused:
            return None, 0, {**info, "kind": "miss"}
        t = time.perf_counter()
        snap = match.snapshot
        if snap.offset > match.tokens:
            snap = trim(snap, snap.offset - match.tokens)
        cache = restore(snap)  # fresh objects: mlx-lm never writes into the store's arrays
        info["restore_s"] = time.perf_counter() - t
        return cache, match.tokens, info

    def _insert(self, ids, prompt_cache, cache_type) -> None:
        snap = snapshot(prompt_cache, model=self.model)
        n = min(snap.offset, len(ids))
        if n < 1:
            return
        if snap.offset > n:  # mlx-lm's cache ran one token ahead of the ids it reports
            snap = trim(snap, snap.offset - n)
        snap = replace(snap, token_ids=tuple(ids[:n]))
        toks = self._tokens(ids[:n])
        self.store.insert(cache_key(toks), toks, snap, kind=KIND.get(cache_type, "prompt"))

    def _key(self, ids):
        return cache_key(from_ids(list(ids)))  # as the lookup keys it: the server has no salts or images

    def _tokens(self, ids):
        return from_ids(ids, self.model.tokenizer, chatml_spans=True) if self._spans else from_ids(ids)

    def _drain(self, rid, segment, key) -> None:
        events = self.store.drain_events() if self.store is not None else []
        for ev in events:
            if ev.event in ADDS:
                self._entries[str(ev.entry)] = (segment or "user", ev.nbytes)
            elif ev.event in REMOVES:
                self._entries.pop(str(ev.entry), None)
            if ev.capacity:
                self.count_eviction(rid)
            self.events.add(ev.event, request=rid, tokens=ev.tokens, nbytes=ev.nbytes, entry=ev.entry,
                            detail=ev.detail, segment=segment)
        if self.store is not None:
            self.peak_bytes = max(self.peak_bytes, int(self.store.nbytes))
            self.misses.record(rid if rid is not None else -1, key, events, offered=key)

    # -- checking ---------------------------------------------------------------------------------
    def invariants(self) -> dict:
        """What must hold whenever no request is running: the store's bytes equal the sum of its
        entries (as its events account them), the budget was never exceeded, and no request that
        is over is still registered (so nothing is referenced on its behalf)."""
        with self.lock:
            listed = sum(b for _, b in self._entries.values())
            held = 0 if self.store is None else int(self.store.nbytes)
            refs = _referenced_blocks(self.store)
            return {"bytes": held, "entries_bytes": listed, "bytes_match": listed == held,
                    "peak_bytes": self.peak_bytes, "budget_bytes": self.budget_bytes,
                    "within_budget": self.budget_bytes is None or self.peak_bytes <= self.budget_bytes,
                    "inflight": sorted(self.inflight), "referenced_blocks": refs,
                    "ok": listed == held and not refs and not self.inflight
                    and (self.budget_bytes is None or self.peak_bytes <= self.budget_bytes)}

    def __repr__(self) -> str:
        return (f"StoreAdapter({self.name}: {len(self)} entries, {self.nbytes} B, {self.lookups} "
                f"lookups, {self.hits} hits)")

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"


def _referenced_blocks(store) -> int:
    """Paged blocks still referenced (ref_cnt > 0); other stores reference nothing between calls."""
    frame = store.blocks_frame() if hasattr(store, "blocks_frame") else None
    return 0 if frame is None or not frame.height else int((frame["ref_cnt"] > 0).sum())
