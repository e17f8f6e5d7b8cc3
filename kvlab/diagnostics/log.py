"""FingerprintLog: a bounded, thread-safe memory of recent requests, keyed by the response id a
client will name in its next request (Anthropic's ``previous_message_id``, OpenAI's
``comparison_response_id``). Entries expire after ``ttl_s`` seconds, as the providers' do; an
unknown or expired id is ``None`` (the caller answers the provider's not-found type).

Time is injectable: pass ``now=`` to ``remember``/``get`` or a ``clock`` to the constructor, so a
test moves time forward without sleeping. An entry may name its ``owner`` (a server's tenant):
``log.seen_by(sees)`` is the log as a caller who may read only the owners ``sees(owner)`` allows
reads it: every other id is unknown, exactly like an id never remembered.

Example:
    >>> log = FingerprintLog(max_entries=2, ttl_s=60, clock=lambda: 0.0)
    >>> log.remember("msg_1", None, [1, 2, 3], now=0.0)
    >>> log.get("msg_1", now=59.0).tokens, log.get("msg_1", now=61.0)
    ((1, 2, 3), None)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import DiagnosticsError
from ..primitives import timing
from ..primitives.display import summary_html, table_html
from ..primitives.tokens import Tokens
from .shape import PromptShape


@dataclass(frozen=True)
class Entry:
    """One remembered request: its shape, its rendered prompt (``Tokens`` or a tuple of ids,
    None when unknown) and when it was remembered (the log's clock)."""

    id: str
    shape: PromptShape | None
    tokens: Any
    time: float
    owner: str | None = None

    def __repr__(self) -> str:
        n = "?" if self.tokens is None else len(self.tokens)
        return f"Entry({self.id!r}, {n} tokens, t={self.time:g})"


class FingerprintLog:
    """Remember (id -> shape, tokens, time) for at most ``max_entries`` ids and ``ttl_s``
    seconds; the oldest entry goes first when full. ``clock`` (default ``timing.now``) is
    read when ``now`` is not passed."""

    def __init__(self, max_entries: int = 4096, ttl_s: float = 3600.0,
                 clock: Callable[[], float] = timing.now):
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise DiagnosticsError(f"max_entries must be an integer >= 1, got {max_entries!r}")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s > 0:
            raise DiagnosticsError(f"ttl_s must be a number of seconds > 0, got {ttl_s!r}")
        self.max_entries, self.ttl_s, self.clock = max_entries, float(ttl_s), clock
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, id: str, shape: PromptShape | None, tokens=None, *, now: float | None = None,
                 owner: str | None = None) -> None:
        """Store a request under the id of its response (replacing an earlier one)."""
        if not isinstance(id, str) or not id:
            raise DiagnosticsError(f"a fingerprint id must be a non-empty string, got {id!r}")
        if tokens is not None and not isinstance(tokens, Tokens):
            tokens = tuple(int(t) for t in tokens)
        entry = Entry(id, shape, tokens, self.clock() if now is None else float(now), owner)
        with self._lock:
            self._entries.pop(id, None)
            self._entries[id] = entry
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, id, *, now: float | None = None) -> Entry | None:
        """The entry for ``id``; None when it was never remembered, fell out, or expired."""
        if not isinstance(id, str):
            return None
        t = self.clock() if now is None else float(now)
        with self._lock:
            entry = self._entries.get(id)
            if entry is None:
                return None
            if t - entry.time > self.ttl_s:
                del self._entries[id]
                return None
            return entry

    def seen_by(self, sees: Callable[[str | None], bool]) -> "SeenBy":
        """This log as read by a caller who may see the entries of the owners ``sees`` allows.

        Example:
            >>> log = FingerprintLog(clock=lambda: 0.0)
            >>> log.remember("msg_1", None, [1], owner="alice")
            >>> log.seen_by(lambda owner: owner == "bob").get("msg_1") is None
            True
        """
        return SeenBy(self, sees)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, id) -> bool:
        return self.get(id) is not None

    def __repr__(self) -> str:
        return f"FingerprintLog({len(self)}/{self.max_entries} entries, ttl {self.ttl_s:g} s)"

    def _repr_html_(self) -> str:
        with self._lock:
            entries = list(self._entries.values())
        rows = [(e.id, e.shape.model if e.shape else None, len(e.shape.messages) if e.shape else None,
                 None if e.tokens is None else len(e.tokens), e.time) for e in reversed(entries)]
        return summary_html("FingerprintLog", f"{len(entries)} of {self.max_entries} entries",
                            f"ttl {self.ttl_s:g} s",
                            body=table_html(["id", "model", "messages", "tokens", "time"], rows, limit=20))


class SeenBy:
    """A FingerprintLog as one caller reads it (``FingerprintLog.seen_by``)."""

    def __init__(self, log: FingerprintLog, sees):
        self.log, self.sees = log, sees

    def get(self, id, *, now: float | None = None) -> Entry | None:
        entry = self.log.get(id, now=now)
        return entry if entry is not None and self.sees(entry.owner) else None

    def __contains__(self, id) -> bool:
        return self.get(id) is not None

    def __repr__(self) -> str:
        return f"SeenBy({self.log!r})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


__all__ = ["Entry", "FingerprintLog", "SeenBy"]
