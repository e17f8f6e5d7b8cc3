"""Client-side tracking of the requests a proxy forwards: which earlier request each one extends,
where their prompts part, and what the upstream said it reused, one row a request.

With a tokenizer, a prompt is its rendered token ids (``kv.tokenise``, as the upstream renders
it); without one, a sequence of structural hashes, one per message (``Prompt.structure``), and
positions count messages, not tokens (the row's ``unit`` says which). A request *extends* the
earlier request whose prompt shares the longest prefix with its own (ties: the latest; without a
tokenizer, then the most messages equal at the same place, so an edited system prompt still
names its conversation), if that prefix (or that count) holds at least ``min_common`` units.
``kv.diverge`` then names the first differing token and the message of *this* request it falls
in (``message_index`` counts the rendered conversation: a system prompt is message 0) with its
role. A prompt is tokenised when its row is made, after the response has gone through, so
tokenising never delays forwarding; only the ids of the last ``history`` requests are kept.

With users (kvlab.proxying.users) a request is compared only with the same user's earlier
requests, and a user's listing holds its own rows, numbered for it: no row says what another
user's prompt shared with it.

``diagnose(previous, current)`` is the hook for a structural diagnosis (two ``Exchange`` objects;
their ``prompt.body`` and ``prompt.kind`` are the requests, ``Tracker.ids(ex)`` their ids): whatever it returns is the row's
``diagnosis``. kvlab.diagnostics plugs in here, e.g.
``lambda a, b: dx.compare(dx.shape_of(a.prompt.body, ...), dx.shape_of(b.prompt.body, ...))``.

Example:
    >>> t = Tracker(tokenizer=kv.load("tiny"))
    >>> a = t.open("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
    >>> t.close(a, status="ok")["extends"] is None
    True
"""

from __future__ import annotations

import itertools
import json
from array import array
import logging
import threading
from collections import deque
from dataclasses import dataclass, field

from ..errors import KvlabError
from ..primitives import timing
from ..primitives.display import summary_html, table_html
from ..primitives.divergence import diverge
from ..primitives.tokens import common_prefix_len
from .prompt import Prompt, prompt_of
from .usage import Watch

log = logging.getLogger("kvlab.proxy")
COLUMNS = ("id", "response_id", "route", "model", "stream", "status", "http_status", "unit", "prompt_tokens",
           "upstream_prompt_tokens", "reused_tokens", "output_tokens", "extends", "common_prefix",
           "diverged_at", "message_index", "role", "finish_reason", "arrival", "ttft_s", "e2e_s",
           "diagnosis", "error", "user")
RAN = ("ok", "disconnected")  # statuses of requests the upstream ran (and recorded)


@dataclass(eq=False)
class Exchange:
    """One forwarded request: its ``id`` (1, 2, ... in arrival order), ``route``, the body as
    ``sent`` (bytes, read into ``prompt`` on first use), arrival (epoch s) and ``t0``
    (``timing.now``), the response ``watch``, ``first`` output time and, once closed, its ``row``."""

    id: int
    route: str
    sent: object
    arrival: float
    t0: float
    caller: object = None  # the kvlab.tenants.Caller it came from (None: no users)
    watch: Watch = field(default_factory=Watch)
    first: float | None = None
    row: dict | None = None
    upstream: str | None = None  # the server it went to (a router's choice; a proxy's one upstream)
    _ids: object = field(default=None, repr=False)  # array('q') of token ids or tuple of hashes; () unreadable
    _prompt: Prompt | None = field(default=None, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @property
    def user(self) -> str | None:
        return None if self.caller is None else self.caller.tenant

    @property
    def prompt(self) -> Prompt:
        """The request's prompt, read from the body on first use (after it was forwarded)."""
        with self._lock:
            if self._prompt is None:
                body = self.sent
                if isinstance(body, (bytes, bytearray)):
                    try:
                        body = json.loads(body) if body else None
                    except (ValueError, UnicodeDecodeError):
                        body = None  # the upstream says what is wrong with it
                self._prompt, self.sent = prompt_of(self.route, body), None
            return self._prompt

    def output_seen(self) -> None:
        """Mark the first output (the proxy calls it when a chunk carries it)."""
        if self.first is None:
            self.first = timing.now()

    def __repr__(self) -> str:
        state = self.row["status"] if self.row is not None else "in flight"
        return f"Exchange({self.id} {self.route}, {state})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


class Tracker:
    """The rows of a proxy (module docstring). ``history``: how many earlier requests a new one
    is compared with (the oldest are forgotten first)."""

    def __init__(self, tokenizer=None, *, diagnose=None, min_common: int = 1, history: int = 128):
        if min_common < 1:
            raise KvlabError(f"min_common must be >= 1 (a shared prefix of at least one unit), got {min_common}")
        self.tokenizer = tokenizer
        self.diagnose = diagnose
        self.min_common = int(min_common)
        self.rows: list[dict] = []
        self._recent: deque[Exchange] = deque(maxlen=int(history))
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    @property
    def unit(self) -> str:
        return "tokens" if self.tokenizer is not None else "messages"

    def open(self, route: str, body, caller=None) -> Exchange:
        """Register a request as it arrives, before it is forwarded: ``body`` as sent (bytes) or
        parsed, ``caller`` its user (kvlab.tenants.Caller); nothing is parsed or tokenised here,
        so forwarding waits for nothing."""
        ex = Exchange(next(self._ids), route, body, timing.wall(), timing.now(), caller)
        with self._lock:
            self._recent.append(ex)
        return ex

    def ids(self, ex: Exchange):
        """``ex``'s prompt as token ids (an ``array('q')``, with a tokenizer) or structural hashes
        (a tuple); None if unreadable. Computed once; only these are kept, not the text."""
        with ex._lock:
            if ex._ids is None:
                ex._ids = _compact(self._tokenise(ex.prompt))
            return ex._ids or None

    def tokens(self, ex: Exchange):
        """``ex``'s prompt as Tokens (message spans, text) or structural hashes, computed now."""
        with ex._lock:
            t = self._tokenise(ex.prompt)
            if ex._ids is None:
                ex._ids = _compact(t)
            return t

    def _tokenise(self, p: Prompt):
        if not p.readable:
            return None
        if self.tokenizer is None:
            return p.structure()
        from ..primitives.tokens import from_ids, tokenise

        try:
            if p.ids is not None:
                return from_ids(p.ids, getattr(self.tokenizer, "tokenizer", self.tokenizer))
            if p.text is not None:
                return tokenise(self.tokenizer, p.text)
            return tokenise(self.tokenizer, list(p.messages), **p.template_kwargs)
        except KvlabError as e:
            log.info("kvlab proxy: cannot tokenise request: %s", e)
            return None

    def close(self, ex: Exchange, *, status: str, http_status: int | None = None,
              error: str | None = None) -> dict:
        """Make ``ex``'s row: compare it with the earlier requests, read its usage; returns it."""
        end = timing.now()
        w = ex.watch
        row = {"id": ex.id, "response_id": w.id, "route": ex.route, "model": (ex.prompt.body or {}).get("model"),
               "stream": bool((ex.prompt.body or {}).get("stream")), "status": status,
               "http_status": http_status, "unit": self.unit, "prompt_tokens": None,
               "upstream_prompt_tokens": w.prompt_tokens, "reused_tokens": w.cached_tokens,
               "output_tokens": w.output_tokens if w.output_tokens is not None else (w.outputs or None),
               "extends": None, "common_prefix": None, "diverged_at": None, "message_index": None,
               "role": None, "finish_reason": w.finish_reason, "arrival": ex.arrival,
               "ttft_s": (ex.first - ex.t0) if ex.first is not None else None, "e2e_s": end - ex.t0,
               "diagnosis": None, "error": error, "user": ex.user}
        full = self.tokens(ex)
        if full is not None:
            row["prompt_tokens"] = len(full) if self.tokenizer is not None else w.prompt_tokens
            self._compare(ex, full, row)
        with self._changed:
            ex.row = row
            self.rows.append(row)
            self._changed.notify_all()
        return row

    def _compare(self, ex: Exchange, full, row: dict) -> None:
        with self._lock:
            earlier = [e for e in self._recent if e.id < ex.id and e.user == ex.user]
        mine = self.ids(ex)
        best, best_key = None, (0, 0)
        for e in reversed(earlier):  # latest first, so a tie keeps the latest
            if e.row is not None and e.row["status"] not in RAN:
                continue  # refused or never delivered: the upstream cached nothing of it
            theirs = self.ids(e)
            if theirs is None:
                continue
            key = (common_prefix_len(theirs, mine), 0)
            if self.tokenizer is None:
                # messages equal at the same place: the conversation of an edited system prompt
                key = (key[0], sum(a == b for a, b in zip(theirs, mine)))
            if key > best_key:
                best, best_key = e, key
        best_common = best_key[0]
        if best is None or max(best_key) < self.min_common:
            return
        row.update(extends=best.id, common_prefix=best_common)
        theirs = self.ids(best)
        if self.tokenizer is not None:
            d = diverge(full, list(theirs))  # spans from this request: its message, its role
            row.update(diverged_at=d.token_index, message_index=d.message_index, role=d.role)
        elif best_common < min(len(theirs), len(mine)):
            roles = [m.get("role") for m in ex.prompt.messages or ()]
            row.update(diverged_at=best_common, message_index=best_common,
                       role=roles[best_common] if best_common < len(roles) else None)
        if self.diagnose is not None:
            try:
                row["diagnosis"] = self.diagnose(best, ex)
            except Exception as e:  # noqa: BLE001  a diagnosis bug must not lose the row
                log.warning("kvlab proxy: diagnose failed for request %s: %s", ex.id, e)
                row["diagnosis"] = f"diagnose failed: {e}"

    def find(self, response_id: str) -> Exchange | None:
        """The remembered request whose response carried ``response_id`` (Anthropic's message id,
        OpenAI's chat completion or response id): what a client's ``previous_message_id`` or
        ``comparison_response_id`` names. None when unknown or forgotten (older than ``history``).

        Example:
            >>> t.find("msg_01XFDUDYJgAACzvnptvVoYEL") is None
            True
        """
        with self._lock:
            return next((e for e in reversed(self._recent) if e.watch.id == response_id), None)

    def wait(self, n: int, timeout: float = 60.0) -> list[dict]:
        """Block until ``n`` rows exist (a KvlabError after ``timeout`` s); returns the rows."""
        with self._changed:
            if not self._changed.wait_for(lambda: len(self.rows) >= n, timeout):
                raise KvlabError(f"only {len(self.rows)} of {n} proxied requests finished within "
                                 f"{timeout}s; are they still running upstream?")
        return self.listing()

    def listing(self, since: int = 0, user: str | None = None) -> list[dict]:
        """A JSON-ready copy of the rows from the ``since``-th on (``diagnosis`` through
        :func:`jsonable`); with ``user`` only that user's rows (``since`` counts them)."""
        with self._lock:
            rows = self.rows if user is None else [r for r in self.rows if r["user"] == user]
            return [{**r, "diagnosis": jsonable(r["diagnosis"])} for r in rows[max(0, since):]]

    def frame(self):
        """The rows as a polars DataFrame (``diagnosis`` as JSON text)."""
        import json

        import polars as pl

        rows = [{**r, "diagnosis": None if r["diagnosis"] is None else json.dumps(r["diagnosis"], default=str)}
                for r in self.listing()]
        schema = {c: pl.Int64 for c in COLUMNS}
        schema.update(response_id=pl.String, route=pl.String, model=pl.String, stream=pl.Boolean, status=pl.String,
                      user=pl.String,
                      unit=pl.String, role=pl.String, finish_reason=pl.String, arrival=pl.Float64,
                      ttft_s=pl.Float64, e2e_s=pl.Float64, diagnosis=pl.String, error=pl.String)
        return pl.DataFrame([{c: r.get(c) for c in COLUMNS} for r in rows], schema=schema) if rows else pl.DataFrame(schema=schema)

    def __repr__(self) -> str:
        return f"Tracker({len(self.rows)} requests, positions in {self.unit})"

    def _repr_html_(self) -> str:
        shown = ("id", "route", "status", "prompt_tokens", "reused_tokens", "extends", "diverged_at", "role")
        return summary_html("kvlab proxy requests", f"{len(self.rows)} requests", f"positions in {self.unit}",
                            body=table_html(shown, [[r[c] for c in shown] for r in self.rows[-20:]]))


def jsonable(obj):
    """A diagnosis as JSON can carry it: plain values as they are, an object by its ``to_dict()``,
    anything else as its text.

    Example:
        >>> jsonable({"type": "system_changed"}), jsonable(3.5), jsonable(object)
        ({'type': 'system_changed'}, 3.5, "<class 'object'>")
    """
    if obj is None or isinstance(obj, (str, int, float, bool, list, dict)):
        return obj
    if callable(getattr(obj, "to_dict", None)):
        return obj.to_dict()
    return str(obj)


def _compact(t):
    """What is kept of a prompt: 8 bytes a token id (a Tokens object holds text and offsets too)."""
    if t is None:
        return ()
    return array("q", t.ids) if hasattr(t, "ids") else tuple(t)
