"""proxy(): a recording, diagnosing proxy in front of any OpenAI- or Anthropic-compatible server
(mlx_lm.server, vllm-mlx, LM Studio, kvlab serve), in a background thread (notebooks, tests) or in
the foreground (``kvlab proxy``).

Requests pass through unchanged (kvlab.proxying.forward); each one becomes a row (kvlab.proxying.
conversation: which earlier request it extends, where the prompts part, what the upstream
reported reused) and, with ``record``, a line of kvlab's trace format (kvlab.proxying.recording).
Binds 127.0.0.1 unless told otherwise; ``port=0`` picks a free port. ``upstream`` is the server's
base URL (a trailing ``/v1`` is dropped: the routes carry it). ``users`` (kvlab.proxying.users)
makes the proxy the door: each user's key in, the user's upstream credential out, a per-user
``cache_salt`` injected with ``cache_salt=True``, and rows, diagnostics and ``/metrics`` scoped to
the user (``admin_key`` reads all).

Example:
    >>> with kv.serve("tiny", "radix") as upstream, kv.proxy(upstream.url, tokenizer="tiny") as p:
    ...     openai.OpenAI(base_url=p.url + "/v1", api_key="none").chat.completions.create(...)
    ...     p.requests_frame()
"""

from __future__ import annotations

import http.client
import logging
import os
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..diagnostics import FingerprintLog
from ..errors import KvlabError
from ..primitives.display import summary_html, table_html
from ..serving.listener import Listener, Listening
from ..serving.prometheus import ProxyMetrics
from . import diagnosing
from .conversation import RAN, Tracker, jsonable
from .forward import bind_handler
from .recording import ProxyRecorder
from .users import ProxyUsers
from .view import LiveView

log = logging.getLogger("kvlab.proxy")


class _Keep:
    # http.client drops ``sock`` once a close-delimited response owns it: keep it, so stop() can cut it
    raw = None

    def connect(self):
        super().connect()
        self.raw = self.sock


class _HTTP(_Keep, http.client.HTTPConnection):
    pass


class _HTTPS(_Keep, http.client.HTTPSConnection):
    pass


class Proxy(Listening):
    """A running (or ready) proxy: ``url``, ``upstream``, ``requests`` (rows), ``requests_frame()``
    (polars), ``wait(n)``, ``tracker``, ``recorder``, ``metrics`` (``GET /metrics``); ``stop()`` or use it
    as a context manager.
    ``tokenizer``: a kvlab model name or folder (loaded with ``kv.load``), a loaded model or a
    tokenizer, for token ids; ``diagnose(previous, current)``: the structural-diagnosis hook (see
    kvlab.proxying.conversation). Made by :func:`proxy`."""

    def __init__(self, upstream: str, *, host: str = "127.0.0.1", port: int = 0, record=None,
                 record_text: bool = False, tokenizer=None, diagnose=None, timeout: float = 600.0,
                 block_size: int = 16, min_common: int = 1, history: int = 128, users=None,
                 admin_key: str | None = None, cache_salt: bool = False, tenant_secret=None):
        self.target = upstream_of(upstream)
        self.upstream = self.target.url
        self.users = ProxyUsers(users, admin_key=admin_key, cache_salt=cache_salt, secret=tenant_secret)
        self.listener = Listener(host, port, "kvlab proxy", log)
        self.timeout = float(timeout)
        self.tokenizer = _tokenizer(tokenizer)
        self.tracker = Tracker(self.tokenizer, diagnose=diagnose or diagnosing.structural, min_common=min_common,
                               history=history)
        self.metrics = ProxyMetrics(self.tracker)  # GET /metrics (kvlab.serving.prometheus)
        self.fingerprints = FingerprintLog(max_entries=history)  # responses a client may compare with
        self.view = LiveView()  # what kv.Inspector reads
        self.store = None  # the proxy holds no cache: the upstream does
        self.recorder = (ProxyRecorder(record, record_text=record_text, block_size=block_size)
                         if record else None)
        self._lock = threading.Lock()
        self._clients: set = set()
        self._upstreams: set = set()

    # -- running ----------------------------------------------------------------------------------
    def start(self) -> "Proxy":
        """Listen and serve in a background thread; returns self once the port is bound."""
        if self.listener.httpd is None:
            self.listener.listen(bind_handler(self), exposed=f" (and {self.upstream} through it)")
        return self

    def stop(self) -> None:
        """Stop accepting, close client and upstream connections, join every thread, free the port
        and close the recording (every finished request is already in it). Idempotent."""
        if not self.listener.shutdown():
            return
        with self._lock:
            socks = list(self._clients) + [c.raw for c in self._upstreams if c.raw is not None]
        self.listener.close(socks)
        if self.recorder is not None:
            self.recorder.close()

    def wait_stopped(self) -> None:
        """Block until :meth:`stop` is called (the CLI's foreground mode)."""
        self.listener.stopped.wait()

    # -- what the handler calls -------------------------------------------------------------------
    def track(self, sock, alive: bool) -> None:
        with self._lock:
            (self._clients.add if alive else self._clients.discard)(sock)

    answers_diagnostics = True  # a router (kvlab.cluster.router) passes its upstreams' own through

    def choose(self, route: str, ex) -> "Upstream | None":
        """Where a request goes (a proxy has one upstream; a router picks one per request)."""
        return self.target

    def refused(self, target: "Upstream", ex, cause: str, sent: bool) -> "Upstream | None":
        """Where a request goes after ``target`` could not be reached (``sent``: after it received
        the request): nowhere (a 502)."""
        return None

    def unreachable(self, tried: list) -> str:
        """The 502's message, ``tried`` the (url, cause) of each upstream the request could not reach."""
        url, cause = tried[-1] if tried else (self.upstream, "not tried")
        return f"the upstream {url} cannot be reached: {cause}; check that it is running and that --upstream names it"

    def answer_get(self, route: str, query: dict) -> "tuple[int, object] | None":
        """(status, JSON) for a GET route of its own beyond /kvlab/requests and /metrics (None: 404)."""
        return None

    def connect(self, target: "Upstream | None" = None) -> http.client.HTTPConnection:
        """A new connection to ``target`` (default: the upstream; closed by :meth:`release`;
        :meth:`stop` cuts it)."""
        target = target or self.target
        conn = (_HTTPS if target.scheme == "https" else _HTTP)(target.netloc, timeout=self.timeout)
        with self._lock:
            self._upstreams.add(conn)
        return conn

    def release(self, conn) -> None:
        conn.close()
        with self._lock:
            self._upstreams.discard(conn)

    def finish(self, ex, **kw) -> dict:
        """Make ``ex``'s row and, for a request the upstream ran, record it."""
        row = self.tracker.close(ex, **kw)
        self.metrics.finished(ex.id, row["status"])
        if row["status"] in RAN:
            diagnosing.remember(self.fingerprints, self.tracker, ex, row["response_id"], owner=ex.user)
            self.view.add(self, row, self.tracker.ids(ex) if self.tokenizer is not None else None)
        if self.recorder is not None and row["status"] in RAN:
            ids = self.tracker.ids(ex) if self.tokenizer is not None else None
            rec = {**row, "upstream": ex.upstream or self.upstream, "prompt_ids": None if ids is None else list(ids),
                   "messages": list(ex.prompt.messages) if ex.prompt.messages is not None else None,
                   "key": self.users.key(ids, ex.caller)}
            rec["diagnosis"] = jsonable(row["diagnosis"])
            try:
                self.recorder.write(rec)
            except Exception as e:  # noqa: BLE001  a full disk must not stop forwarding; say so loudly
                log.error("kvlab proxy: could not record request %s: %s", ex.id, e)
        return row

    # -- reading ----------------------------------------------------------------------------------
    @property
    def requests(self) -> list[dict]:
        """One row per finished request, in the order they finished (``GET /kvlab/requests``)."""
        return self.tracker.listing()

    def requests_of(self, caller, since: int = 0) -> list[dict]:
        """The rows ``caller`` (kvlab.tenants.Caller) may read: its user's, numbered for it, or
        every row for the admin."""
        return self.tracker.listing(since, user=None if caller.admin else caller.tenant)

    def requests_frame(self):
        """The rows as a polars DataFrame (columns: kvlab.proxying.conversation.COLUMNS).

        Example:
            >>> p.requests_frame().select("id", "extends", "diverged_at", "reused_tokens")
        """
        return self.tracker.frame()

    # -- what kv.Inspector reads (kvlab.proxying.view) ----------------------------------------------
    @property
    def results(self) -> list:
        """One ``kv.Result`` per request the upstream ran (reused: what it reported)."""
        return list(self.view.results)

    @property
    def events(self):
        return self.view.events

    def stats(self) -> dict:
        return {**self.view.stats(), "url": self.url, "upstream": self.upstream}

    def on_result(self, callback) -> None:
        """Call ``callback(proxy, result)`` after every finished request, on a listener thread."""
        self.view.on_result(callback)

    @property
    def model(self):
        return self.tokenizer

    def wait(self, n: int, timeout: float = 60.0) -> list[dict]:
        """Block until ``n`` requests have rows (KvlabError after ``timeout`` s)."""
        return self.tracker.wait(n, timeout)

    def __repr__(self) -> str:
        state = self.listener.state
        return f"Proxy({self.url} -> {self.upstream} {state}, {len(self.tracker.rows)} requests)"

    def _repr_html_(self) -> str:
        rows = self.tracker.rows
        reused = sum(r["reused_tokens"] or 0 for r in rows)
        prompt = sum(r["upstream_prompt_tokens"] or 0 for r in rows)
        facts = [("url", self.url), ("upstream", self.upstream), ("requests", len(rows)),
                 ("reported reused", f"{reused} of {prompt} prompt tokens"),
                 ("recording", str(self.recorder.path) if self.recorder else "off")]
        return summary_html("kvlab Proxy", body=table_html(None, facts) + self.tracker._repr_html_())


def proxy(upstream: str, port: int = 0, record=None, tokenizer=None, **kwargs) -> Proxy:
    """A started :class:`Proxy` in front of ``upstream`` on loopback; use it as a context manager
    so it stops. Keywords: ``host``, ``record_text``, ``diagnose``, ``timeout`` (seconds to wait
    on the upstream), ``block_size`` (recorded kvlab hash ids), ``min_common``, ``history``,
    ``users`` (a file or ``{key: user or (user, upstream credential)}``), ``admin_key``,
    ``cache_salt`` (inject each user's), ``tenant_secret``.

    Example:
        >>> with kv.proxy("http://127.0.0.1:8080", tokenizer="smollm2") as p:
        ...     p.url
        'http://127.0.0.1:...'
    """
    return Proxy(upstream, port=port, record=record, tokenizer=tokenizer, **kwargs).start()


@dataclass(frozen=True)
class Upstream:
    """A server requests go to: its base ``url`` (no trailing /v1), ``scheme``, ``netloc`` (host:port),
    ``base_path`` and the ``headers`` a response from it gets (a router's ``x-kvlab-upstream``)."""

    url: str
    scheme: str
    netloc: str
    base_path: str
    headers: tuple = ()

    def __repr__(self) -> str:
        return f"Upstream({self.url})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def upstream_of(url: str, header: str | None = None) -> Upstream:
    """The Upstream at ``url`` (a server's base URL; a trailing ``/v1`` is dropped); ``header``
    names it in each response it answers.

    Example:
        >>> upstream_of("http://127.0.0.1:8080/v1").url
        'http://127.0.0.1:8080'
    """
    parts = urlsplit(str(url))
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise KvlabError(f"--upstream must be a server's base URL such as http://127.0.0.1:8080, "
                         f"got {url!r}")
    path = parts.path.rstrip("/")
    path = path[:-3] if path.endswith("/v1") else path
    base = f"{parts.scheme}://{parts.netloc}{path}"
    return Upstream(base, parts.scheme, parts.netloc, path, ((header, base),) if header else ())


def _tokenizer(tok):
    if tok is None or not isinstance(tok, (str, os.PathLike)):
        return tok
    from ..models.loading import load

    return load(os.fspath(tok))
