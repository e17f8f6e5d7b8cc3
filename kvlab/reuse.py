"""PrefixCache: the one reuse pipeline, shared by the Engine and kvlab's server.

From a key to what to restore and why the rest missed: store lookup -> same-model check -> cut the
matched snapshot back to the match, if every layer can be cut there exactly (the cache layout
decides, ``kvlab.primitives.layout``) -> KV-format check -> fresh cache objects -> a reason for
every missed token. From a finished cache to what the store keeps: snapshot -> cut to the ids it
covers -> insert. Every state change, the store's included, becomes one event row in one schema
(``EVENT_COLUMNS``), sent to the ``emit`` callback of whoever runs requests.

Events (``event`` column; ``detail`` says more):

- ``lookup``: a request's lookup (tokens: prompt tokens; detail: the store's match kind);
- ``hit``: tokens restored (entry: the store entry; detail: the match kind);
- ``miss``: missed tokens, one row per reason (detail: the reason, ``kvlab.policies.reasons``);
- ``refused``: a match that could not be restored exactly (tokens; detail: the layer and why);
- ``offer``: a cache offered to the store (tokens; detail: the insert kind);
- ``offer_refused``: a cache that could not be cut to the ids it was offered with (detail: why);
- the store's own: ``insert``, ``evict``, ``block_stored``, ``block_removed``, ``refuse`` (an
  offer it could not keep: the cache cannot be cut where it would keep it), ``tier_hit``,
  ``promote``, ``demote``, ``persist``, ``corrupt`` (detail: kind, reason or tier);
  ``checkpoint_stored``, ``checkpoint_removed`` (a window or recurrent checkpoint: tokens = its
  position, bytes = its recurrent state, and in SharedRadixStore its window KV too),
  ``window_stored``, ``window_released`` (PagedStore: a block's window KV, kept while some
  checkpoint's window reaches it).

Example:
    >>> core = PrefixCache(kv.RadixStore(), m, emit=print)
    >>> found = core.lookup(1, key, toks, limit=len(toks.ids) - 1)
    >>> found.cache, found.reused, found.missed.reasons
    >>> core.offer(1, key, toks, kv.snapshot(cache, tokens=toks.ids, model=m), kind="prompt")
    >>> core.drain(1, key)  # the store's events, also sent to emit
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import NotTrimmableError, SnapshotError
from .keys import CacheKey
from .miss_reasons import Explained, MissIndex
from .primitives import timing
from .primitives.display import summary_html
from .primitives.kv_format import check_reusable
from .primitives.snapshots import Snapshot, restore, trim
from .stores.base import MISS, Match, StoreEvent

EVENT_COLUMNS = ("request", "event", "tokens", "bytes", "entry", "detail")


@dataclass(frozen=True)
class Reuse:
    """What a lookup restores (``cache``: fresh mlx-lm cache objects holding the first
    ``reused`` tokens, None to start cold) and why the rest missed (``missed``). ``match`` is the
    store's answer as it came; ``refused`` the tokens it offered that could not be restored
    exactly (``why`` names the layer)."""

    key: CacheKey
    cache: list | None
    reused: int
    match: Match
    why: str
    missed: Explained
    refused: int = 0
    lookup_s: float = 0.0
    restore_s: float = 0.0
    why_is_store_wide: bool = False  # ``why`` describes the store beyond this key's namespace

    @property
    def scoped_why(self) -> str:
        """``why`` as a tenant may read it: a miss the store explained by what it holds for
        others (\"nothing cached yet\", the cached system prompt's length) says nothing."""
        return "" if self.why_is_store_wide else self.why

    @property
    def kind(self) -> str:
        """The match kind, or ``miss`` when nothing was restored."""
        return self.match.kind if self.reused else "miss"

    def __repr__(self) -> str:
        return f"Reuse({self.kind}: {self.reused} tokens{', ' + self.why if self.why else ''})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def restorable_limit(model, tokens, n: int) -> tuple[int, str]:
    """(the largest position <= n where ``model``'s cache of ``tokens`` can be restored exactly,
    why it is less than n): the model's own ``restorable_limit`` (a VLM whose image tokens see
    each other: never inside an image), else ``(n, "")``."""
    hook = getattr(model, "restorable_limit", None)
    return hook(tokens, n) if hook is not None else (n, "")


class PrefixCache:
    """A store, the model its KV belongs to, and the rules for reusing it (module docstring).

    ``store`` is any ``kvlab.stores.Store`` (None: no caching). ``model`` gives the cache layout
    and the fingerprint that KV must carry. ``kv`` holds the KV quantization settings
    (``kv_bits``, ``kv_group_size``, ``quantized_kv_start``) that restored KV must match.
    ``emit(request, event, tokens, nbytes, entry, detail, **extra)`` receives every event row.
    """

    def __init__(self, store, model, *, kv: dict | None = None, emit=None):
        self.store = store
        self.model = model
        self.layout = model.layout
        self.kv = {"kv_bits": None, **(kv or {})}  # float KV unless told otherwise
        self.emit = emit or (lambda *a, **k: None)
        caps = store.capabilities if store is not None else None
        # a store that cannot hold this model's cache at all (paged and a hybrid model)
        self.store_refuses = caps.refuses(self.layout) if caps is not None else None
        self.misses = MissIndex(caps.block_size if caps else None, unstorable=self.store_refuses is not None)

    @property
    def needs_spans(self) -> bool:
        return self.store is not None and self.store.capabilities.needs_spans

    # -- lookup -----------------------------------------------------------------------------------
    def lookup(self, request, key: CacheKey, tokens, *, limit: int, whole: bool = False, scope=None) -> Reuse:
        """What to restore for ``key`` (at most ``limit`` tokens: one less than the prompt, whose
        last token is always recomputed) and why every other token missed (``scope``: the
        tenant whose memory explains it; None: one memory for every request). ``whole``: serve
        only an entry of exactly ``limit`` tokens (a compressed context: its kept rows depend on
        every token it was compressed with, so neither a longer entry cut back nor a shorter one
        continued is the compression of this context)."""
        start = timing.timed()
        match, why, store_wide = MISS, "", False
        if self.store is None:
            why = "no store"
        elif limit < 1:
            why = "a one-token prompt has nothing to reuse: its last token is always recomputed"
        else:
            match = self.store.lookup(key, tokens, limit=limit)
            # a store that cannot hold this model's cache misses for that reason, not for its own
            why = self.store_refuses if self.store_refuses and not match.tokens else match.why
            store_wide = not match.tokens and why == match.why and bool(why)
        lookup_s = start.done()
        self.emit(request, "lookup", len(key.ids), 0, None, match.kind)
        t = timing.timed()
        cache, reused, refused = None, 0, 0
        partial = whole and match.snapshot is not None and match.tokens > 0 and \
            not (match.tokens == limit == match.snapshot.offset)
        if partial:
            refused = match.tokens
            why = (f"the store's compressed entry covers {match.snapshot.offset} tokens and matches "
                   f"{match.tokens} of this context's {limit}: a compressed cache is reused only on a "
                   "whole-context hit (its kept rows depend on every token it was compressed with)")
            self.emit(request, "refused", refused, 0, match.entry_id, why)
        elif match.snapshot is not None and match.tokens > 0:
            # a model may forbid some positions (gemma4: inside an image); text models: none
            at, inside = restorable_limit(self.model, tokens, match.tokens)
            try:
                if at < 1:
                    raise NotTrimmableError(inside)
                cache = restore(self._restorable(match.snapshot, at))
                reused = at
                if inside:
                    refused, why = match.tokens, inside
                    self.emit(request, "refused", match.tokens - at, 0, match.entry_id, inside)
            except NotTrimmableError as e:
                refused = match.tokens
                if not inside:
                    why = f"could not trim the matched entry: {e}"
                else:
                    why = inside if at < 1 else f"{inside}, and the entry cannot be cut back to {at}: {e}"
                self.emit(request, "refused", refused, 0, match.entry_id, why if inside else str(e))
        restore_s = t.done([layer.state for layer in cache or ()])
        untrimmable = whole or not self.layout.restores_anywhere or refused > 0
        missed = self.misses.explain(key, reused, untrimmable=untrimmable, refused=refused, scope=scope)
        if reused:
            self.emit(request, "hit", reused, 0, match.entry_id, match.kind)
        for reason, n in missed.reasons.items():
            if n:
                self.emit(request, "miss", n, 0, None, reason)
        return Reuse(key, cache, reused, match, why, missed, refused - reused if refused else 0,
                     lookup_s, restore_s, store_wide)

    def _restorable(self, snap: Snapshot, tokens: int) -> Snapshot:
        """``snap`` cut to its first ``tokens`` tokens, checked to be this model's KV in this
        engine's format; NotTrimmableError when a layer cannot be cut there exactly."""
        mine = self.model.fingerprint
        if snap.fingerprint is not None and snap.fingerprint != mine:
            raise SnapshotError(f"the store returned KV made by model {snap.fingerprint[:12]}, but "
                                f"this model is {mine[:12]}: KV from another model is meaningless; "
                                "give each model its own store")
        if snap.offset > tokens:
            snap = trim(snap, snap.offset - tokens)
        check_reusable(snap, **self.kv)
        return snap

    # -- insert -----------------------------------------------------------------------------------
    def offer(self, request, key: CacheKey, tokens, snap: Snapshot, *, kind: str = "prompt", **extra) -> bool:
        """Offer the KV of ``key``'s ids to the store. A cache that ran past the ids it is
        offered with is cut back to them first; if a layer cannot be cut there, nothing is
        offered (an ``offer_refused`` row says which layer). True when the store was offered it."""
        if self.store is None:
            return False
        n = len(key.ids)
        self.emit(request, "offer", n, 0, None, kind, **extra)
        if snap.offset > n:
            try:
                snap = trim(snap, snap.offset - n)
            except NotTrimmableError as e:
                self.emit(request, "offer_refused", n, 0, None, str(e), **extra)
                return False
        if snap.offset < 1:
            self.emit(request, "offer_refused", n, 0, None, "the cache says it holds no tokens", **extra)
            return False
        if snap.offset < n:  # a cache that has not run the last ids yet covers only its own
            key = key.prefix(snap.offset)
        if snap.token_ids != key.ids:
            snap = replace(snap, token_ids=key.ids)
        self.store.insert(key, tokens, snap, kind=kind)
        return True

    def drain(self, request, key: CacheKey, *, offered: bool = True, scope=None, **extra) -> list[StoreEvent]:
        """Move the store's events into the stream and the miss memory (``key``: the longest key
        the request inserted since the last drain; ``offered``: whether it was offered to the
        store; ``scope``: the request's tenant, as for :meth:`lookup`); returns them."""
        if self.store is None:
            return []
        events = self.store.drain_events()
        for ev in events:
            self.emit(request, ev.event, ev.tokens, ev.nbytes, ev.entry, ev.detail, **extra)
        self.misses.record(-1 if request is None else request, key, events, offered=key if offered else None,
                           scope=scope)
        return events

    def __repr__(self) -> str:
        name = "none" if self.store is None else self.store.name
        return f"PrefixCache({name}, {self.layout.summary()})"

    def _repr_html_(self) -> str:
        return summary_html("PrefixCache", "none" if self.store is None else self.store.name,
                            self.layout.summary(), note=self.store_refuses or "")
