"""StoreAdapter: any kvlab store behind mlx-lm's prompt-cache interface, so ``mlx_lm.server``'s
``ResponseGenerator(model_provider, prompt_cache)`` batches requests over a kvlab store.

mlx-lm calls, all on its generation thread: ``fetch_nearest_cache(model_key, tokens)`` once per
request after tokenising it (-> ``(cache or None, tokens still to prefill)``), ``insert_cache(
model_key, tokens, cache, cache_type=...)`` at each prompt segment boundary (``system``,
``user``) and when a request finishes (``assistant``: prompt + output), ``trim_to(n_bytes=...)``
only when ``--prompt-cache-bytes`` is set, and ``nbytes`` / ``len`` / ``stats_by_type()`` to log.
HTTP threads read stats concurrently, so every store call runs under one lock.

Every step is the reuse core's (``kvlab.reuse.PrefixCache``), the Engine's own: lookup, the
same-model and KV-format checks, cutting a match back only where every layer can be cut exactly,
fresh cache objects for mlx-lm (never the store's own arrays: pitfall 3 in the README), a reason
for every missed token, insert and the store's events. This module only translates: keys are
``kv.cache_key`` of ``kv.tokens.from_ids(ids)`` (with message spans recovered from ChatML markers
for a store whose capabilities say it needs them), an insert's ``cache_type`` becomes its kind, and
each call is attributed to the request it belongs to. A lookup may reuse at most n - 1 tokens
(mlx-lm needs one token to prefill).

Tenants (kvlab.tenants): the handler assigns each request its namespace before mlx-lm sees it
(``assign``); every key of the request, looked up or inserted, carries that namespace's salt, and
its misses are explained from its tenant's memory alone. A call whose namespace is unknown (on a
server of tenants: any unattributed call; once a request was salted: a request's call after it
ended) is neither looked up nor inserted: it could only be keyed unsalted. Each event row names
the tenant it belongs to: a store's removal the tenant whose entry left (an entry nobody here
inserted: no tenant, only the admin sees it).

Example:
    >>> adapter = StoreAdapter(kv.make_store("radix"), kv.load("tiny"), ServerEvents())
    >>> ResponseGenerator(provider, adapter)
"""

from __future__ import annotations

import logging
import threading

from ..compressing import check_press
from ..errors import KvlabError
from ..tenants import Tenancy
from ..primitives.display import summary_html
from ..primitives.snapshots import snapshot
from ..primitives.tokens import from_ids
from ..reuse import PrefixCache
from .events import ServerEvents
from .pressing import Pressing

SEGMENTS = ("assistant", "user", "system")  # mlx-lm's cache types, in its eviction order
# kvlab insert kinds: a segment's end is a snapshot taken while prefilling, what kv.Engine offers
# as a "checkpoint" (a paged store lets a deeper one supersede its window; mlx-lm's LRU types it
# "system"); prompt + output is what the Engine keys with keying="prompt+output"
KIND = {"system": "checkpoint", "user": "checkpoint", "assistant": "prompt+output"}
ADDS, REMOVES = ("insert", "block_stored"), ("evict", "block_removed")
# the paged store's recurrent checkpoints and window KV, counted on the block they belong to
PARTS = {"checkpoint_stored": 1, "window_stored": 1, "checkpoint_removed": -1, "window_released": -1}
# store events about an entry that may be another tenant's: the row is that entry's tenant's
LEAVES = ("evict", "block_removed", "demote", "checkpoint_removed", "window_released", "corrupt")
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
        self.finishing_space = None
        self.spaces: dict[int, object] = {}  # rid -> its Namespace, from the handler's assign()
        self.salting = False  # some request was salted: a request's call after its end is not keyed
        self.ending: dict[int, object] = {}  # rid -> what hands its end to its client (finishing)
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

    def assign(self, rid, namespace) -> None:
        """Request ``rid``'s namespace (kvlab.tenants.Namespace), before mlx-lm takes it."""
        with self.lock:
            self.spaces[rid] = namespace
            self.salting = self.salting or getattr(namespace, "salt", None) is not None

    def space(self, rid):
        """The namespace of request ``rid`` (the finishing one's after it ended); None if unknown."""
        with self.lock:
            if rid is not None and rid == self.finishing_rid and self.finishing_space is not None:
                return self.finishing_space
            return self.spaces.get(rid)

    def finishing(self, rid, release=None) -> None:
        """mlx-lm ended request ``rid``: its prompt + output offer comes next (every loop offers it
        right after the end). ``release()`` hands the end to the client once that offer's rows
        are in the event log, so a client that has its whole response finds all its rows."""
        with self.lock:
            self.finishing_rid = rid
            self.finishing_space = self.spaces.get(rid)
            if rid is not None and release is not None:
                self.ending[rid], release = release, None
        if release is not None:
            release()

    def final_offered(self, rid) -> None:
        """Request ``rid``'s prompt + output offer is done (its rows are in): release its end."""
        with self.lock:
            release = self.ending.pop(rid, None)
        if release is not None:
            release()

    def end(self, rid) -> None:
        """The request is over (finished, failed or its client left): it references nothing."""
        with self.lock:
            self.inflight.pop(rid, None)
            self.spaces.pop(rid, None)

    def request_info(self, rid) -> dict:
        with self.lock:
            return {**self.requests.pop(rid, {}), "evictions": self.evicted.pop(rid, 0)}

    def count_eviction(self, rid) -> None:
        if rid is not None:
            self.evicted[rid] = self.evicted.get(rid, 0) + 1

    def owner(self, tokens, cache_type) -> int | None:
        if cache_type == "assistant" and self.finishing_rid is not None:
            return self.finishing_rid  # cleared once its insert is keyed (insert_cache)
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


class StoreAdapter(Pressing, Attribution):
    """A kvlab store (``radix``, ``paged``, ``system``, ``mlx-lru``, ... or None: caching off)
    speaking mlx-lm's prompt-cache interface through the reuse core (see module docstring)."""

    def __init__(self, store, model, events: ServerEvents, tenancy: Tenancy | None = None, press=None):
        super().__init__(events)
        self.store = store
        self.model = model
        self.press = check_press(press, model, store)  # kvlab.compressing: fresh prefills compressed
        self.tenancy = tenancy if tenancy is not None else Tenancy.configure()
        self.owners: dict[str, str] = {}  # store entry -> the tenant whose request stored it
        self.name = "none" if store is None else store.name
        self.budget_bytes = None if store is None else store.capabilities.budget_bytes
        self.core = PrefixCache(store, model, emit=self._emit)
        self._entries: dict[str, tuple[str, int]] = {}  # store entry -> (segment, bytes)
        self.positionless = model.layout.kind_set <= {"recurrent"}
        self.peak_bytes = 0
        self.listeners: list = []  # fn(rid, key, store events, offered) after each drain (kvlab.serving.kv_publisher)

    # -- mlx-lm's interface -----------------------------------------------------------------------
    def fetch_nearest_cache(self, model_key, tokens):
        with self.lock:
            ids = list(tokens)
            if self.press is not None:
                return self.compressed(self.current, ids)
            toks = self._tokens(ids)
            key = self.key_for(self.current, toks)  # text: no images
            if key is None:
                return None, ids
            cache, reused = self.lookup(self.current, toks, key)
            return cache, ids[reused:]

    def insert_cache(self, model_key, tokens, prompt_cache, *, cache_type: str = "assistant"):
        with self.lock:
            rid = self.owner(tokens, cache_type)
            if self.press is not None:
                return self.compressed_offer(rid, tokens, cache_type)
            ids = list(tokens)
            toks = self._tokens(ids) if self.store is not None else None
            key = None if toks is None else self.key_for(rid, toks)
            if cache_type == "assistant":
                self.finishing_rid = self.finishing_space = None
            if toks is not None and key is None:  # not attributable: never stored unsalted
                if cache_type == "assistant":
                    self.final_offered(rid)  # the client's end is still released
                return
            self.offer(rid, toks, key, prompt_cache, ids, cache_type=cache_type)

    def key_for(self, rid, toks):
        """Request ``rid``'s key of ``toks`` in its namespace (``kv.cache_key``'s, images
        included, on a server without tenants); None on a server of tenants when ``rid`` has no
        namespace."""
        ns = self.space(rid)
        # a request's call after its end (its client left mid-prefill) may have been salted
        if ns is None and (self.tenancy.isolated or (self.salting and rid is not None)):
            self.events.add("error", request=rid, detail="a prompt-cache call no request of a known "
                            "tenant owns: not looked up, not stored")
            return None
        return self.tenancy.key(toks, ns)

    def scope(self, rid):
        """The tenant whose memory explains request ``rid``'s misses (None: one memory)."""
        ns = self.space(rid)
        return ns.tenant if ns is not None and self.tenancy.isolated else None

    # -- the same steps for a caller that keys its own tokens (a VLM request: image hashes) -------
    def lookup(self, rid, toks, key, *, limit: int | None = None, whole: bool = False) -> tuple[list | None, int]:
        """Look ``key`` up for request ``rid`` through the reuse core: (fresh cache or None, tokens
        reused), at most ``limit`` (default ``len(key) - 1``; ``whole``: exactly ``limit``, a
        compressed context); what it found is kept for the ledger."""
        with self.lock:
            self.lookups += 1
            try:
                limit = len(key.ids) - 1 if limit is None else limit
                found = self.core.lookup(rid, key, toks, limit=limit, whole=whole, scope=self.scope(rid))
                cache, reused = found.cache, found.reused
                info = {"kind": found.kind, "why": found.why, "scoped_why": found.scoped_why,
                        "key": key, "entry": found.match.entry_id,
                        "entry_tokens": found.match.entry_tokens, "lookup_s": found.lookup_s,
                        "restore_s": found.restore_s, "miss_reasons": found.missed.reasons,
                        "diverged_at": found.missed.diverged_at, "evicted_by": found.missed.evicted_by}
            except Exception as e:  # noqa: BLE001  a store bug must not kill mlx-lm's generation thread
                self._error("lookup", rid, e)
                why = f"lookup failed: {e}"
                cache, reused, info = None, 0, {"kind": "miss", "why": why, "scoped_why": why, "key": key}
            self.hits += reused > 0
            self.reused_tokens += reused
            self._drain(rid, None, key, offered=False)
            if rid is not None:
                self.requests[rid] = {**info, "reused": reused}
            return cache, reused

    def found(self, rid) -> dict:
        """What request ``rid``'s lookup found (a copy; empty before its lookup)."""
        with self.lock:
            return dict(self.requests.get(rid) or {})

    def note(self, rid, why: str) -> None:
        """Add ``why`` to what request ``rid``'s lookup says (read by the ledger and /kvlab/requests)."""
        with self.lock:
            info = self.requests.get(rid)
            if info is not None and why:
                for field in ("why", "scoped_why"):
                    info[field] = "; ".join(w for w in (info.get(field), why) if w)

    def offer(self, rid, toks, key, prompt_cache, ids, *, cache_type: str = "assistant",
              kind: str | None = None) -> None:
        """Offer ``prompt_cache`` (holding ``ids``, keyed ``key``) to the store for request ``rid``
        (as ``kind``, default by ``cache_type``); ``cache_type="assistant"`` (prompt + output) is a
        request's last offer."""
        try:
            self._offer(rid, toks, key, prompt_cache, ids, cache_type, kind)
        finally:
            if cache_type == "assistant":
                self.final_offered(rid)

    def _offer(self, rid, toks, key, prompt_cache, ids, cache_type: str, kind: str | None = None) -> None:
        with self.lock:
            if self.store is None:
                self.events.add("offer", request=rid, tokens=len(ids), detail=cache_type, segment=cache_type,
                                tenant=self._tenant(rid, "offer", None))
                return
            try:
                # A recurrent-only cache (mamba2, rwkv7) does not say how many tokens it has run;
                # mlx-lm's tokens are exactly what it ran (its BatchGenerator keeps them so, and
                # the sequential path runs every yielded token before stopping).
                snap = snapshot(prompt_cache, tokens=list(ids) if self.positionless else None, model=self.model)
                self.core.offer(rid, key, toks, snap, kind=kind or KIND.get(cache_type, "prompt"), segment=cache_type)
            except Exception as e:  # noqa: BLE001
                self._error(f"insert ({cache_type})", rid, e)
            self._drain(rid, cache_type, key)

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
    def _emit(self, request, event, tokens, nbytes, entry, detail, segment=None):
        tenant, ns = self._tenant(request, event, entry), self.space(request)
        by = ns.tenant if ns is not None and ns.tenant != tenant else None
        self.events.add(event, request=request, tokens=tokens, nbytes=nbytes, entry=entry, detail=detail,
                        segment=segment, tenant=tenant, by=by)

    def _tenant(self, request, event, entry) -> str | None:
        """Whose row an event is: a removal its entry's owner's (None if unknown: admin only),
        anything else the request's; an entry stored is owned by the request's tenant."""
        ns = self.space(request)
        mine = ns.tenant if ns is not None else None
        if entry is None:
            return mine
        name = str(entry)
        if event in LEAVES:
            owner = self.owners.get(name)
            if event in REMOVES:
                self.owners.pop(name, None)
            return owner
        if event in ADDS and mine is not None:
            self.owners.setdefault(name, mine)
        return mine

    def _tokens(self, ids):
        # Message spans cost a decode per token (~50 ms for 1,500 tokens, on mlx-lm's generation
        # thread): recovered only for a store that reads them.
        return from_ids(ids, self.model.tokenizer, chatml_spans=True) if self.core.needs_spans else from_ids(ids)

    def _drain(self, rid, segment, key, *, offered: bool = True) -> None:
        events = self.core.drain(rid, key, offered=offered, scope=self.scope(rid), segment=segment)
        for fn in self.listeners:
            try:
                fn(rid, key, events, offered)
            except Exception as e:  # noqa: BLE001  a listener must not kill mlx-lm's generation thread
                self._error("store event listener", rid, e)
        for ev in events:
            if ev.event in ADDS:
                self._entries[str(ev.entry)] = (segment or "user", ev.nbytes)
            elif ev.event in REMOVES:
                self._entries.pop(str(ev.entry), None)
            elif ev.event in PARTS:
                seg, held = self._entries.get(str(ev.entry), (segment or "user", 0))
                self._entries[str(ev.entry)] = (seg, held + PARTS[ev.event] * ev.nbytes)
            if ev.capacity:
                self.count_eviction(rid)
        if self.store is not None:
            self.peak_bytes = max(self.peak_bytes, int(self.store.nbytes))

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
        return summary_html(repr(self), code=True)


def _referenced_blocks(store) -> int:
    """Paged blocks still referenced (ref_cnt > 0); other stores reference nothing between calls."""
    if store is None or "blocks" not in store.capabilities.views:
        return 0
    frame = store.frame("blocks")
    return int((frame["ref_cnt"] > 0).sum()) if frame.height else 0
