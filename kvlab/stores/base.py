"""The store protocol every prefix-cache design implements, and the values it trades in.

A store maps cache keys (``kv.keys.CacheKey``: token ids, extra keys, salt) to snapshots.
``lookup`` never mutates the snapshot it returns; the Engine trims/restores copies. Every state
change a store makes is a ``StoreEvent``, which the Engine drains into ``engine.events``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from .. import device as devices
from ..errors import BudgetError, KvlabError
from ..keys import CacheKey
from ..primitives import timing
from ..primitives.snapshots import Snapshot
from ..primitives.tokens import Tokens

MATCH_KINDS = ("miss", "exact", "prefix", "lcp", "supersequence")
ALL_LAYER_KINDS = frozenset({"full", "window", "recurrent", "chunked", "compressed", "list", "unknown"})
VIEWS = ("tree", "blocks", "entries")  # the frames a store can draw: tree_frame(), blocks_frame(), entries_frame()
# why an entry left when not for room (for room, the reason is the eviction policy's name)
NON_CAPACITY_REASONS = ("subsumed", "replaced", "invalidated")


@dataclass(frozen=True)
class Match:
    """A lookup's answer. ``tokens`` is how many leading tokens ``snapshot`` covers usefully
    (the engine trims the snapshot to it). ``why`` explains a miss or a shorter-than-possible hit."""

    kind: str
    tokens: int = 0
    snapshot: Snapshot | None = None
    entry_tokens: int = 0
    entry_id: int | None = None
    why: str = ""

    def __repr__(self) -> str:
        return f"Match({self.kind}, {self.tokens} tokens{', ' + self.why if self.why else ''})"


MISS = Match("miss")


@dataclass(frozen=True)
class StoreEvent:
    """One state change inside a store, drained by the Engine after each request.

    ``event``: ``insert``, ``evict`` (an entry left), ``block_stored`` / ``block_removed``
    (paged blocks), ``refuse`` (an offer the store could not keep; ``reason`` says why). ``kind`` is an insert's kind (``prompt``, ``prompt+output``, ``checkpoint``,
    ``system``); ``reason`` says why something left: the eviction policy's name when it left to
    make room (then ``capacity`` is True), else ``subsumed``, ``replaced`` or ``invalidated``.
    ``tier`` names the tier of a tiered store an event belongs to (``ram``, ``disk``; None for
    single-tier stores); ``detail`` falls back to it, so a ``tier_hit`` row says who served.
    """

    event: str
    tokens: int = 0
    nbytes: int = 0
    entry: str | None = None
    kind: str | None = None
    reason: str | None = None
    capacity: bool = False
    t: float = field(default_factory=timing.now)
    tier: str | None = None

    @property
    def detail(self) -> str | None:
        """The Engine's ``detail`` column: the reason for removals, the kind for inserts, else
        the tier (``tier_hit``, ``promote``, ``demote``)."""
        return self.reason or self.kind or self.tier

    def __repr__(self) -> str:
        why = f" {self.detail}" if self.detail else ""
        return f"StoreEvent({self.event}{why}: {self.tokens} tokens, {self.nbytes} B, entry {self.entry})"


@dataclass(frozen=True)
class Capabilities:
    """What a store says it is, so nobody has to probe it.

    ``block_size``: None when it serves any leading run of tokens of an entry (cutting the cache
    back), else the size of the blocks it keeps and serves whole. ``holds``: the layer kinds
    (``kvlab.primitives.layout``) it can keep; a store that cuts KV into blocks or edges holds
    ``full`` KV only. ``budget_bytes``: its byte budget (None: counted in entries, mlx-lm's way).
    ``needs_spans``: it reads the rendered prompt's message spans (the system-prompt store finds
    its boundary there), so a server must recover them. ``views``: the frames ``frame(view)``
    draws (``VIEWS``). ``tiers``: where it keeps entries. ``checkpoint_every``: a store that keeps
    recurrent state only at multiples of it (its block ends) asks whoever prefills a prompt with
    recurrent layers for a snapshot at each one the prompt passes. ``components``: it reports
    its bytes per component (full KV, window KV, recurrent state) through ``components()``.
    ``eviction_policy``: the name of the ``kvlab.policies`` policy choosing what it evicts for
    room (None: it evicts by a rule of its own, or never).
    """

    block_size: int | None = None
    holds: frozenset = ALL_LAYER_KINDS
    budget_bytes: int | None = None
    needs_spans: bool = False
    views: tuple[str, ...] = ()
    tiers: tuple[str, ...] = ("ram",)
    checkpoint_every: int | None = None
    components: bool = False
    eviction_policy: str | None = None

    def refuses(self, layout) -> str | None:
        """Why this store can hold none of a cache of ``layout`` (a ``CacheLayout``), or None."""
        found = layout.first_layer_not_in(self.holds)
        if found is None:
            return None
        i, layer = found
        return (f"layer {i} is a {layer.label}, which this store cannot hold (it keeps "
                f"{', '.join(sorted(self.holds))} layers only)")


@runtime_checkable
class Store(Protocol):
    """What the Engine calls, and all it calls: every store implements exactly this.

    ``capabilities`` says what it is (granularity, the layer kinds it holds, budget, whether it
    needs message spans, which frames it draws). ``lookup`` answers how many leading tokens of ``key`` (at most ``limit``) a resident entry
    can serve, never mutating what it returns; ``insert`` offers the KV of ``key``'s first
    ``snap.offset`` tokens (a store may keep all, part or none of it, and refreshes an entry it
    already holds). ``tokens`` is the rendered prompt ``key`` was built from (message spans,
    images), always passed. ``drain_events`` hands over what changed since the last call.
    """

    name: str

    @property
    def capabilities(self) -> Capabilities: ...

    def lookup(self, key: CacheKey, tokens: Tokens, *, limit: int) -> Match: ...

    def insert(self, key: CacheKey, tokens: Tokens, snap: Snapshot, *, kind: str = "prompt") -> None: ...

    def drain_events(self) -> list[StoreEvent]: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def entries(self) -> int: ...

    def frame(self, view: str): ...

    def flush(self) -> int: ...


class EventLog:
    """The events a store produced since the Engine last drained it."""

    def __init__(self):
        self.rows: list[StoreEvent] = []

    def add(self, event: str, *, tokens: int = 0, nbytes: int = 0, entry=None, kind: str | None = None,
            reason: str | None = None, capacity: bool = False, tier: str | None = None) -> None:
        self.rows.append(StoreEvent(event, int(tokens), int(nbytes),
                                    None if entry is None else str(entry), kind, reason, capacity,
                                    tier=tier))

    def drain(self) -> list[StoreEvent]:
        rows, self.rows = self.rows, []
        return rows


class StoreBase:
    """Plumbing every store shares: the event log the Engine drains after each request, and
    ``frame(view)`` over the views its capabilities declare."""

    log: EventLog

    @property
    def capabilities(self) -> Capabilities:
        """What this store is; a store that declares nothing serves whole entries of any cache."""
        return Capabilities()

    def drain_events(self) -> list[StoreEvent]:
        return self.log.drain()

    def flush(self) -> int:
        """Make what must survive a restart durable (a tiered store writes RAM to disk); the
        count of entries written. Stores kept in RAM only have nothing to do."""
        return 0

    def frame(self, view: str):
        """The store drawn as a polars frame: ``tree``, ``blocks`` or ``entries``, as declared in
        ``capabilities.views``."""
        views = self.capabilities.views
        if view not in views:
            raise KvlabError(f"{self.name} store draws {', '.join(views) or 'no frames'}, not {view!r}")
        return getattr(self, f"{view}_frame")()


def fell_back(entry_tokens: int, shared: int, reuse: int, refusal: str, to: tuple[int, int] | None,
              label: str = "entry") -> str:
    """The why of a lookup whose deepest match cannot be cut back exactly to what it shares with
    the prompt (``refusal``: ``cut_refusal``'s answer), naming what it fell back from and to
    (``to``: tokens reused and the tokens of the ``label`` that served them; None: nothing).

    Example:
        >>> fell_back(665, 615, 615, "layer 0 (ChunkedKVCache) cannot be trimmed to 615 tokens: ...", (585, 585))
        'an entry of 665 tokens shares 615 with this prompt but its cache cannot be trimmed to 615 (layer 0 (ChunkedKVCache) cannot be trimmed to 615 tokens: ...); fell back to the entry of 585 tokens'
    """
    why = (f"an entry of {entry_tokens} tokens shares {shared} with this prompt but its cache cannot "
           f"be trimmed to {reuse} ({refusal})")
    if not to or not to[0]:
        return f"{why}; no entry before it can be restored exactly"
    n, of = to
    return f"{why}; fell back to " + (f"the {label} of {of} tokens" if n == of else f"{n} tokens of the {label} of {of}")


def default_budget(fraction: float = 0.25, device: devices.Device | None = None) -> int:
    """A fraction of the memory the device can use, in bytes (``kvlab.device``: Metal's
    recommended working set, a CUDA GPU's memory, physical RAM on CPU)."""
    return (device or devices.current()).default_budget(fraction)


def check_budget(budget_bytes) -> int:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise BudgetError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    return budget_bytes


def too_big(store_name: str, need: int, budget: int) -> BudgetError:
    return BudgetError(f"{store_name}: one entry needs {need} bytes but the budget is {budget} bytes; "
                       "raise budget_bytes (or cache shorter prompts)")
