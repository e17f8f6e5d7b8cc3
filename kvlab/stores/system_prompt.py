"""SystemPromptStore: seed 003's single-entry system-prompt cache.

The conversation is cut after its leading system message(s) with ``kv.split_at_boundary``; when the
cut is clean, the KV of that prefix is kept under a hash of the prefix ids (and of the salt and
extra keys before the cut: ``CacheKey.digest``). A request with the same system prompt reuses
exactly the prefix; a different one replaces the entry (event ``evict``, reason ``invalidated``).
One entry at a time.

The cut comes from the rendered conversation (the ``tokens`` every store is given). Requests made
of raw ids or text have no system message and always miss, with a ``why``.

Example:
    >>> store = kv.SystemPromptStore()
    >>> engine = kv.Engine(kv.load("tiny"), store)
    >>> engine.run(kv.workloads.shared_system_prompt(num_users=2)[0]).reused_tokens
    0
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..primitives.boundary import split_at_boundary
from ..errors import BoundaryError
from ..keys import CacheKey
from ..primitives.snapshots import Snapshot, compact, non_trimmable_layers, trim
from ..primitives.tokens import Tokens
from ..primitives.display import summary_html
from .base import Capabilities, EventLog, Match, StoreBase, check_budget, default_budget, too_big


@dataclass(eq=False)
class SystemEntry:
    id: int
    hash: str
    tokens: int
    snapshot: Snapshot
    hits: int = 0

    @property
    def nbytes(self) -> int:
        return self.snapshot.nbytes

    def __repr__(self) -> str:
        return f"SystemEntry(#{self.id} {self.tokens} tokens, {self.nbytes} B, {self.hits} hits)"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


class SystemPromptStore(StoreBase):
    """One cached system prompt (see module docstring). ``budget_bytes`` defaults to 25% of the
    device's memory (``kvlab.device``)."""

    name = "system"

    def __init__(self, budget_bytes: int | None = None):
        self.budget_bytes = check_budget(budget_bytes if budget_bytes is not None else default_budget())
        self.entry: SystemEntry | None = None
        self.refused = ""  # why the last offer could not be kept
        self.evictions = 0
        self._ids = itertools.count(1)
        self.log = EventLog()

    # -- protocol ---------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.entry.nbytes if self.entry is not None else 0

    @property
    def entries(self) -> int:
        return int(self.entry is not None)


    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(budget_bytes=self.budget_bytes, needs_spans=True)

    def lookup(self, key: CacheKey, tokens: Tokens, *, limit: int) -> Match:
        cut, why = self._cut(tokens)
        if why:
            return Match("miss", why=why)
        if self.entry is None:
            return Match("miss", why="no system prompt cached yet" + (f"; the last offer was refused: "
                                                                      f"{self.refused}" if self.refused else ""))
        if key.digest(cut) != self.entry.hash:
            return Match("miss", why=f"the system prompt ({cut} tokens) differs from the cached one "
                                     f"({self.entry.tokens} tokens); it will replace it")
        self.entry.hits += 1
        return Match("prefix", min(cut, limit), self.entry.snapshot, cut, self.entry.id)

    def insert(self, key: CacheKey, tokens: Tokens, snap: Snapshot, *, kind: str = "prompt") -> None:
        cut, why = self._cut(tokens)
        if why or snap.offset < cut:
            return  # nothing to keep, or a checkpoint taken before the boundary
        h = key.digest(cut)
        if self.entry is not None and self.entry.hash == h:
            return
        if snap.offset > cut:
            bad = non_trimmable_layers(snap, cut)
            if bad:  # a checkpoint at the boundary may still come (the Engine takes one)
                i, cls, why = bad[0]
                self.refused = f"layer {i} ({cls}) cannot be cut back to the system boundary at {cut}: {why}"
                self.log.add("refuse", tokens=cut, reason=self.refused)
                return
            snap = trim(snap, snap.offset - cut)
        snap = compact(snap)  # exact-size copies: the views would keep the request's whole buffer alive
        if snap.nbytes > self.budget_bytes:
            raise too_big(self.name, snap.nbytes, self.budget_bytes)
        if self.entry is not None:
            old = self.entry
            self.log.add("evict", tokens=old.tokens, nbytes=old.nbytes, entry=old.id, reason="invalidated")
            self.evictions += 1
        self.entry, self.refused = SystemEntry(next(self._ids), h, cut, snap), ""
        self.log.add("insert", tokens=cut, nbytes=self.entry.nbytes, entry=self.entry.id, kind="system")

    # -- internals --------------------------------------------------------------------------------
    @staticmethod
    def _cut(tokens: Tokens) -> tuple[int, str]:
        """(token index of the clean system boundary, "") or (0, why there is none)."""
        if not tokens.messages:
            return _span_cut(tokens)
        try:
            split = split_at_boundary(tokens, at="system")
        except BoundaryError as e:
            return 0, str(e)
        if not split.clean:
            return 0, f"the system boundary is not clean: {split.reason}"
        return split.index, ""

    def __repr__(self) -> str:
        if self.entry is None:
            return "SystemPromptStore(empty)"
        return (f"SystemPromptStore({self.entry.tokens} tokens, {self.entry.nbytes / 2**20:.1f} MiB, "
                f"{self.entry.hits} hits, {self.evictions} invalidations)")

    def _repr_html_(self) -> str:
        return summary_html("SystemPromptStore", repr(self)[len("SystemPromptStore"):])


def _span_cut(tokens: Tokens) -> tuple[int, str]:
    """The boundary of ids whose message spans came from ChatML markers (``kv.tokens.from_ids(...,
    chatml_spans=True)``: a server sees ids, not messages): where the first message after the
    leading system ones starts. It starts with the special token ``<|im_start|>``, which never
    merges with its neighbours, so the cut is clean."""
    spans = tokens.spans
    k = 0
    while k < len(spans) and spans[k].role == "system":
        k += 1
    if k == 0:
        return 0, ("SystemPromptStore needs a chat conversation (messages, or ids with ChatML "
                   "message markers) that starts with a system message")
    return (spans[k].token_start if k < len(spans) else spans[k - 1].token_end), ""

