"""The store protocol every prefix-cache design implements, and the values it trades in.

A store maps cache keys (token ids + per-block extra keys + salt) to snapshots. ``lookup`` never
mutates the snapshot it returns; the Engine trims/restores copies. Every state change a store makes
is appended to its event list, which the Engine drains into ``engine.events``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import psutil

from ..errors import BudgetError
from ..snapshots import Snapshot

MATCH_KINDS = ("miss", "exact", "prefix", "lcp", "supersequence")


@dataclass(frozen=True)
class CacheKey:
    """What a cached KV depends on: the ids, extra keys as (token_start, token_end, key) spans
    (e.g. an image's placeholder span and its content hash) and a salt."""

    ids: tuple[int, ...]
    extra_keys: tuple[tuple[int, int, str], ...] = ()
    salt: str | None = None

    def prefix(self, n: int) -> "CacheKey":
        """The key of the first n tokens (extra-key spans that start before n are kept)."""
        return CacheKey(self.ids[:n], tuple(s for s in self.extra_keys if s[0] < n), self.salt)

    def namespace_at(self, n: int) -> tuple:
        """Everything besides ids that decides whether KV of the first n tokens is reusable."""
        return (self.salt, tuple(s for s in self.extra_keys if s[0] < n))

    def __repr__(self) -> str:
        extra = f", {len(self.extra_keys)} extra keys" if self.extra_keys else ""
        salt = f", salt={self.salt!r}" if self.salt else ""
        return f"CacheKey({len(self.ids)} ids{extra}{salt})"


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


@runtime_checkable
class Store(Protocol):
    """One protocol, four designs (radix, paged, system prompt, mlx-lm's LRU).

    ``insert`` of tokens a store already holds refreshes that entry (the Engine inserts after
    every request, hit or not). Optional hook: a store that needs the rendered conversation
    (message spans) sets ``wants_tokens = True``; the Engine then also passes ``tokens=`` (a
    ``kv.Tokens``) to ``lookup`` and ``insert``.
    """

    name: str

    def lookup(self, key: CacheKey, *, limit: int) -> Match: ...

    def insert(self, key: CacheKey, snap: Snapshot, *, kind: str = "prompt") -> None: ...

    def drain_events(self) -> list[dict]: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def entries(self) -> int: ...


@dataclass
class EventLog:
    """Rows a store produced since the Engine last drained it."""

    rows: list = field(default_factory=list)

    def add(self, event: str, *, tokens: int = 0, nbytes: int = 0, entry=None, **extra) -> None:
        self.rows.append({"event": event, "tokens": int(tokens), "bytes": int(nbytes),
                          "entry": None if entry is None else str(entry), "t": time.perf_counter(),
                          **extra})

    def drain(self) -> list[dict]:
        rows, self.rows = self.rows, []
        return rows


class StoreBase:
    """Plumbing every store shares: the event log the Engine drains after each request."""

    log: EventLog

    def drain_events(self) -> list[dict]:
        return self.log.drain()


def default_budget(fraction: float = 0.25) -> int:
    """A fraction of this machine's physical memory, in bytes."""
    return int(psutil.virtual_memory().total * fraction)


def check_budget(budget_bytes) -> int:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise BudgetError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    return budget_bytes


def too_big(store_name: str, need: int, budget: int) -> BudgetError:
    return BudgetError(f"{store_name}: one entry needs {need} bytes but the budget is {budget} bytes; "
                       "raise budget_bytes (or cache shorter prompts)")

