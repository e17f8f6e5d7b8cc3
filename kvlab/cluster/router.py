"""``kvlab route`` / ``kv.cluster.route``: a router in front of several OpenAI/Anthropic-compatible
servers, picking one per request by a rule of kvlab.cluster.routers over a view of what each holds.

It is kvlab's proxy (kvlab.proxying: the same forwarding code, rows, recording and metrics) with
the upstream chosen per request: routes pass through unchanged, streamed or not (usage and the
upstreams' own cache diagnostics included), and every response names its instance in the header
``x-kvlab-upstream``. ``GET /kvlab/route`` lists one row per request: the instance, the rule's
score and the view's match for every instance, what the instance reported reused
(``?since=N``: rows after the first N; ``?sync=1``: first wait until the view holds every batch
of KV events the instances have published).

Views: ``precise`` and ``stale:D`` read the instances' KV events (``kvlab serve --kv-events``: the
endpoint and block size are read from each upstream's ``/kvlab/stats``, or given as
``kv_events=[...]`` for a vLLM), ``approximate`` the router's own record (any server, e.g.
``mlx_lm.server``). A cache-aware rule needs the model's tokenizer (``tokenizer=``): a request's
blocks are the chained hashes (vLLM's, kvlab.primitives.blocks) of its token ids as the server
renders them. Once a response has been relayed, the router waits (at most ``sync_s``) until its
view holds the events its instance had published by then, so the next request of a conversation
sees the previous turn.

Bad input is refused at start: an upstream that does not answer (named), a precise view over an
upstream without KV events, events of another block size than ``block_size`` (every match would
be zero). An instance that stops answering is marked down and its requests go to the others (if it
never received them; one it received and then failed gets a 502, never a second run); with none
left the client gets a 502 naming every instance and why.

Example:
    >>> with kv.serve(m, "paged", kv_events="tcp://127.0.0.1:0") as a, \\
    ...      kv.serve(m, "paged", kv_events="tcp://127.0.0.1:0") as b, \\
    ...      kv.cluster.route([a.url, b.url], "llmd_weighted", tokenizer=m) as r:
    ...     httpx.post(r.url + "/v1/completions", json={...}).headers["x-kvlab-upstream"]
    'http://127.0.0.1:...'
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import urllib.error
import urllib.request

import numpy as np

from ..errors import BlockSizeError, KvlabError
from ..primitives import timing
from ..primitives.blocks import block_hashes
from ..primitives.display import summary_html, table_html
from ..primitives.kv_events import external_hash
from ..proxying.conversation import RAN
from ..proxying.server import Proxy, upstream_of
from .decide import mix64
from .live import LiveRouting

log = logging.getLogger("kvlab.route")
HEADER = "x-kvlab-upstream"
SESSION_HEADER = "x-session-id"


class Router(Proxy):
    """A router over ``upstreams`` (module docstring); ``rows`` are ``GET /kvlab/route``'s,
    ``live`` the routing state (kvlab.cluster.live), ``feed`` the KV-event subscription."""

    answers_diagnostics = False  # the upstream that served the request answers them

    def __init__(self, upstreams, policy: str = "round_robin", view: str = "precise", *, tokenizer=None,
                 block_size: int = 16, kv_events=None, capacity_tokens: int | None = None, service=None,
                 router_params: dict | None = None, seed: int = 0, down_s: float = 10.0, sync_s: float = 5.0,
                 api_key: str | None = None, **proxy_kw):
        if isinstance(upstreams, str) or not upstreams:
            raise KvlabError("give the router a list of upstream base URLs (--upstream URL, once per instance)")
        self.targets = [upstream_of(u, HEADER) for u in upstreams]
        if len({t.url for t in self.targets}) < len(self.targets):
            raise KvlabError(f"an upstream is listed twice: {[t.url for t in self.targets]}")
        super().__init__(self.targets[0].url, tokenizer=tokenizer, block_size=block_size, **proxy_kw)
        self.upstream = ", ".join(t.url for t in self.targets)
        self.block_size = int(block_size)
        self.live = LiveRouting(len(self.targets), policy, view, self.block_size, capacity_tokens=capacity_tokens,
                                service=service, router_params=router_params, seed=seed, down_s=down_s)
        if self.live.info.cache_aware and self.tokenizer is None:
            raise KvlabError(f"{policy} reads each request's blocks: give the router the servers' tokenizer "
                             "(--model M, tokenizer=)")
        if kv_events is not None and len(kv_events) != len(self.targets):
            raise KvlabError(f"kv_events names {len(kv_events)} endpoints for {len(self.targets)} upstreams; "
                             "give one per upstream (None for one without events)")
        self.kv_events = list(kv_events) if kv_events is not None else None
        self.sync_s, self.api_key = float(sync_s), api_key
        self.feed = None
        self.rows: list[dict] = []
        self._decisions: dict[int, object] = {}
        self._refused: dict[int, list] = {}
        self._warned: set[int] = set()
        self._rows_lock = threading.Lock()

    # -- starting ---------------------------------------------------------------------------------
    def start(self) -> "Router":
        """Check every upstream, subscribe to their KV events (precise / stale views), compile the
        rule, then listen; returns self."""
        if self.listener.httpd is not None:
            return self
        for t in self.targets:
            try:
                self._get(t, "/health")
            except (OSError, ValueError) as e:
                raise KvlabError(f"the upstream {t.url} does not answer GET /health ({e}); start it first "
                                 "or drop it from --upstream") from e
        try:
            if self.live.kind != "approximate":
                self._subscribe()
            self.live.warm()
            return super().start()
        except BaseException:
            if self.feed is not None:  # a refusal after subscribing leaves no thread behind
                self.feed.close()
                self.feed = None
            raise

    def _subscribe(self) -> None:
        from .feed import EventFeed

        stats = [self._stats(t) for t in self.targets]
        endpoints = list(self.kv_events) if self.kv_events is not None else [None] * len(self.targets)
        for i, (t, s) in enumerate(zip(self.targets, stats)):
            ev = (s or {}).get("kv_events")
            if endpoints[i] is None and ev is None:
                raise KvlabError(f"the upstream {t.url} publishes no KV events, which the {self.live.view} view "
                                 "reads: start it with `kvlab serve --kv-events tcp://127.0.0.1:0` (or give its "
                                 "endpoint in kv_events), or route with --view approximate")
            if ev is not None:
                if ev["block_size"] != self.block_size:
                    raise BlockSizeError(f"the upstream {t.url} publishes {ev['block_size']}-token blocks and the "
                                         f"router hashes {self.block_size}-token blocks: no block would ever match "
                                         f"(zero hits, silently); start the router with --block-size "
                                         f"{ev['block_size']}")
                endpoints[i] = endpoints[i] or ev["endpoint"]
                if ev["seq"]:
                    log.warning("kvlab route: %s has published %d batches already: the view misses the blocks "
                                "it stored before the router subscribed", t.url, ev["seq"])
        self.feed = EventFeed(endpoints, self._on_batch)
        for i, (t, s) in enumerate(zip(self.targets, stats)):
            if s and s.get("kv_events"):  # kvlab serve counts subscriptions: wait until ours is in
                before, deadline = s["kv_events"]["subscribed"], timing.deadline(10.0)
                while self._stats(t)["kv_events"]["subscribed"] <= before:
                    if deadline.expired():
                        raise KvlabError(f"the KV events of {t.url} at {endpoints[i]} never saw the router "
                                         "subscribe within 10 s; is the endpoint reachable from here?")
                    time.sleep(0.01)

    def _on_batch(self, i: int, events: list) -> None:
        why = self.live.on_events(i, events, timing.now())
        if why:
            log.error("kvlab route: %s refused: %s", self.targets[i].url, why)

    # -- what the forwarding handler calls (kvlab.proxying.forward) -------------------------------
    def choose(self, route, ex):
        now = timing.now()
        if ex is None:  # GET /health, /v1/models: any instance that is up
            up = [i for i, s in enumerate(self.live.state()) if s["up"]]
            return self.targets[up[0]] if up else None
        blocks, prompt, out, session = self._request(ex)
        d = self.live.choose(blocks, prompt, out, session, now)
        with self._rows_lock:
            self._decisions[ex.id] = d
            self._refused[ex.id] = []
        return None if d is None else self.targets[d.instance]

    def refused(self, target, ex, cause, sent):
        i = self.targets.index(target)
        now = timing.now()
        log.warning("kvlab route: %s failed a request (%s): marked down", target.url, cause)
        if ex is None:
            self.live.mark_down(i, cause, now)
            return None if sent else self.choose(None, None)
        with self._rows_lock:
            d = self._decisions.pop(ex.id, None)
            self._refused[ex.id].append(target.url)
        if sent:  # it may have run the request: not sent again elsewhere; a 502 names it
            if d is not None:
                self.live.done(d)
            self.live.mark_down(i, cause, now)
            return None
        nxt = self.live.refused(d, cause, now) if d is not None else None
        with self._rows_lock:
            self._decisions[ex.id] = nxt
        return None if nxt is None else self.targets[nxt.instance]

    def unreachable(self, tried) -> str:
        state = self.live.state()
        down = [f"{t.url} (down: {s['down_because']})" for t, s in zip(self.targets, state) if not s["up"]]
        return (f"no instance could take the request: {'; '.join(down) or 'none is up'}; check that they "
                "are running (GET /kvlab/route lists them)")

    def answer_get(self, route, query):
        if route != "/kvlab/route":
            return None
        since = query.get("since", ["0"])[0]
        if not since.isdigit():
            return 400, {"error": {"message": f"since must be a row count (an integer >= 0), got {since!r}"}}
        caught_up = self.sync() if query.get("sync", ["0"])[0] not in ("0", "") else None
        return 200, {**self.describe(), "caught_up": caught_up, "rows": self.listing(int(since))}

    def finish(self, ex, **kw) -> dict:
        row = super().finish(ex, **kw)
        with self._rows_lock:
            d = self._decisions.pop(ex.id, None)
            refused = self._refused.pop(ex.id, [])
        behind = agrees = None
        bs = self.block_size
        if d is not None:
            self.live.done(d)
            if row["status"] in RAN and self.feed is not None:
                behind = not self._sync_one(d.instance)
            agrees = self._agrees(d, row["reused_tokens"])
        with self._rows_lock:
            self.rows.append({
                "id": ex.id, "instance": None if d is None else d.instance,
                "upstream": None if d is None else self.targets[d.instance].url, "status": row["status"],
                "http_status": row["http_status"], "prompt_tokens": None if d is None else d.prompt_tokens,
                "hittable_tokens": None if d is None else d.hittable * bs,
                "view_match_tokens": None if d is None else d.match[d.instance] * bs,
                "reused_tokens": row["reused_tokens"], "scores": None if d is None else d.scores,
                "match_tokens": None if d is None else [m * bs for m in d.match], "refused_by": refused,
                "ttft_s": row["ttft_s"], "view_behind": behind, "view_agrees": agrees})
        return row

    def _agrees(self, d, reused) -> bool | None:
        """Whether what the instance reused fits what the precise view said it held: at least the
        view's blocks, and one block or more only if the view had one. A disagreement with nothing
        else in flight means the view lagged or the router's hashes are not the instance's (a salt,
        image keys): said once per instance (a row's ``view_agrees`` says it every time)."""
        if self.live.kind != "precise" or reused is None:
            return None
        held = d.match[d.instance] * self.block_size
        ok = held <= reused and (held > 0 or reused < self.block_size)
        if not ok and d.busy == 0 and d.instance not in self._warned:
            self._warned.add(d.instance)
            log.warning("kvlab route: %s reused %d tokens where the view saw %d: its view lagged, or its block "
                        "hashes are not the router's (a salt, image keys, another hash)", self.targets[d.instance].url,
                        reused, held)
        return ok

    # -- the view's freshness ---------------------------------------------------------------------
    def sync(self) -> bool:
        """Wait until the view holds every KV-event batch each instance has published so far (at
        most ``sync_s`` each); False if one did not arrive in time. True without events."""
        if self.feed is None:
            return True
        return all([self._sync_one(i) for i in range(len(self.targets)) if self.feed.endpoints[i]])

    def _sync_one(self, i: int) -> bool:
        try:
            ev = self._stats(self.targets[i])["kv_events"]
        except (OSError, ValueError, KeyError, TypeError):
            return False  # not kvlab serve (an explicit endpoint), or gone: nothing to wait for
        return ev["seq"] == 0 or self.feed.wait(i, ev["seq"] - 1, self.sync_s)

    # -- internals --------------------------------------------------------------------------------
    def _request(self, ex) -> tuple[list, int, int, int]:
        """(full-block hashes, prompt tokens, max output tokens, session key) of a request."""
        body = ex.prompt.body or {}
        out = next((body[k] for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")
                    if isinstance(body.get(k), int)), 0)
        ids = self.tracker.ids(ex) if self.tokenizer is not None else None
        blocks = [] if ids is None else [external_hash(h) for h in block_hashes(list(ids), self.block_size)]
        prompt = 0 if ids is None else len(ids)
        name = body.get("user") if isinstance(body.get("user"), str) else None
        if name:
            key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")
        else:
            key = blocks[0] if blocks else 0
        return blocks, prompt, int(out), int(mix64(np.array([key], np.uint64))[0])

    def _get(self, target, path: str):
        req = urllib.request.Request(target.url + path)
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read() or b"null") if path != "/health" else r.status

    def _stats(self, target) -> dict | None:
        try:
            return self._get(target, "/kvlab/stats")
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None  # not kvlab serve
            raise KvlabError(f"GET {target.url}/kvlab/stats answered {e.code}; give the router the upstream's "
                             "key (--upstream-key) if it has one") from e

    # -- reading ----------------------------------------------------------------------------------
    def listing(self, since: int = 0) -> list[dict]:
        with self._rows_lock:
            return [dict(r) for r in self.rows[since:]]

    def route_frame(self):
        """``rows`` as a polars DataFrame, one row a request."""
        import polars as pl

        return pl.DataFrame(self.listing(), infer_schema_length=None)

    def describe(self) -> dict:
        return {"policy": self.live.router, "view": self.live.view, "block_size": self.block_size,
                "instances": [{"url": t.url, **s, "events": None if self.feed is None else self.feed.endpoints[i],
                               "event_gaps": None if self.feed is None else self.feed.gaps[i]}
                              for i, (t, s) in enumerate(zip(self.targets, self.live.state()))]}

    def stop(self) -> None:
        super().stop()
        if self.feed is not None:
            self.feed.close()
            self.feed = None

    def __repr__(self) -> str:
        up = sum(s["up"] for s in self.live.state())
        return (f"Router({self.url} -> {up} of {len(self.targets)} instances up, {self.live.router}/"
                f"{self.live.view}, {self.listener.state}, {len(self.rows)} requests)")

    def _repr_html_(self) -> str:
        facts = [("url", self.url), ("policy / view", f"{self.live.router} / {self.live.view}"),
                 ("requests", len(self.rows))]
        inst = [[t.url, s["up"], s["running"], s["view_blocks"], s["down_because"] or ""]
                for t, s in zip(self.targets, self.live.state())]
        return summary_html("kvlab Router", body=table_html(None, facts) + table_html(
            ("instance", "up", "running", "view blocks", "down because"), inst))


def route(upstreams, policy: str = "round_robin", view: str = "precise", port: int = 0, **kwargs) -> Router:
    """A started :class:`Router` on loopback in front of ``upstreams``; use it as a context manager
    so it stops. Keywords: ``tokenizer``, ``block_size``, ``kv_events``, ``capacity_tokens``,
    ``service``, ``router_params``, ``seed``, ``down_s``, ``sync_s``, ``api_key`` and the proxy's
    (``host``, ``record``, ``timeout``, ...).

    Example:
        >>> with kv.cluster.route([a.url, b.url], "sglang_cache_aware", "approximate", tokenizer="tiny") as r:
        ...     r.url
        'http://127.0.0.1:...'
    """
    return Router(upstreams, policy, view, port=port, **kwargs).start()
