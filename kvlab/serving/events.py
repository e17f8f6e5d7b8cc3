"""ServerEvents: the thread-safe event log of a live server (lookups, hits, inserts with their
segment type, evictions, first tokens, finishes), each row with request id, batch step and time.

The generation thread (mlx-lm's batching loop, through the prompt-cache adapter) and the HTTP
handler threads both append; readers (``/kvlab/events``, ``server.events``) copy under the lock.
Rows have the Engine's event columns (``request, event, tokens, bytes, entry, t, detail``) plus
``seq`` (0, 1, 2, ... for ``?since=``), ``step`` (mlx-lm batch steps run so far),
``segment`` (mlx-lm's cache type of the insert that caused the row: system, user, assistant) and
``tenant`` (whose row it is, kvlab.tenants; None: the server's own, which only an admin reads).
A tenant reads its rows with ``request`` blanked where another tenant's request caused them (an
insert of another tenant's that evicted its entry).

Example:
    >>> log = ServerEvents()
    >>> log.add("lookup", request=1, tokens=40, detail="miss")
    >>> log.frame()["event"].to_list()
    ['lookup']
"""

from __future__ import annotations

import threading
from collections import deque

import polars as pl
from ..primitives import timing
from ..primitives.display import summary_html

EVENT_SCHEMA = {"seq": pl.Int64, "request": pl.Int64, "step": pl.Int64, "event": pl.Utf8,
                "tokens": pl.Int64, "bytes": pl.Int64, "entry": pl.Utf8, "t": pl.Float64,
                "detail": pl.Utf8, "segment": pl.Utf8, "tenant": pl.Utf8}
MAX_EVENTS = 1_000_000  # a long-running server keeps the newest rows; seq numbers never repeat


class ServerEvents:
    """Append-only (bounded) event rows shared by the server's threads (see module docstring).

    ``step`` counts mlx-lm batch steps: the adapter's time budget advances it once per
    ``BatchGenerator.next()`` call, on the generation thread.
    """

    def __init__(self, max_events: int = MAX_EVENTS):
        self._rows: deque = deque(maxlen=max_events)
        self._lock = threading.Lock()
        self._seq = 0
        self.step = 0
        self.t0 = timing.now()

    def advance_step(self) -> int:
        with self._lock:
            self.step += 1
            return self.step

    def add(self, event: str, *, request: int | None = None, tokens: int = 0, nbytes: int = 0,
            entry=None, detail: str | None = None, segment: str | None = None,
            step: int | None = None, tenant: str | None = None, by: str | None = None) -> int:
        """Append one row; returns its ``seq`` (``by``: the tenant of the request that caused it,
        when that is not ``tenant``)."""
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._rows.append({"seq": seq, "request": request,
                               "step": self.step if step is None else step, "event": event,
                               "tokens": int(tokens), "bytes": int(nbytes),
                               "entry": None if entry is None else str(entry),
                               "t": timing.now() - self.t0, "detail": detail,
                               "segment": segment, "tenant": tenant, "by": by})
            return seq

    def since(self, seq: int = 0, caller=None) -> list[dict]:
        """Rows with ``seq >= seq`` that are still held (copies); with ``caller`` (a
        kvlab.tenants.Caller) only the rows it may see."""
        with self._lock:
            if not self._rows or seq <= self._rows[0]["seq"]:
                rows = list(self._rows)
            else:
                start = seq - self._rows[0]["seq"]
                rows = [self._rows[i] for i in range(start, len(self._rows))]
        out = []
        for r in rows:
            if caller is None or caller.sees(r["tenant"]):
                row = dict(r)
                if row.pop("by") is not None and caller is not None and not caller.admin:
                    row["request"] = None  # another tenant's request: not even its number
                out.append(row)
        return out

    @property
    def next_seq(self) -> int:
        with self._lock:
            return self._seq

    def frame(self, since: int = 0) -> pl.DataFrame:
        return pl.DataFrame(self.since(since), schema=EVENT_SCHEMA)

    def __len__(self) -> int:
        with self._lock:
            return len(self._rows)

    def __repr__(self) -> str:
        return f"ServerEvents({len(self)} rows, step {self.step})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)
