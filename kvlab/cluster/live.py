"""The state a real router keeps to call kvlab.cluster.decide once per request, as the simulator's
kernel calls it: what each instance is running, its modelled prefill queue (a ServiceModel, as in
the simulator), Preble's window of routed prefill work, Dynamo's active blocks, which instances
are up, and a view (kvlab.cluster.views) fed by the instances' KV events or by the router's own
record. Thread-safe: a router's handler threads call it at once.

One decision: the view is brought to now; each instance's match is the leading run of the
request's hittable blocks (full blocks within its first n - 1 tokens) the view says it holds;
decide gets running, wait (the modelled queue: FCFS prefill of the tokens the view did not hold),
usage (the view's blocks over ``capacity_tokens``; 0 without it), vsize (the view's blocks), work,
active and up. The chosen instance's load goes up and the approximate view records the request's
full blocks there; ``done`` takes the load off. An instance that refuses a connection is marked
down for ``down_s`` seconds (its view cleared: a restarted server holds nothing) and the request
is decided again among the others; one whose events break the contract (another block size) is
down for good, with the reason.

Example:
    >>> lr = LiveRouting(2, "llmd_weighted", "precise", block_size=16)
    >>> lr.views.stored(0.0, 1, [7, 8])
    >>> d = lr.choose([7, 8, 9], 3 * 16 + 5, out_tokens=8, session=0, now=1.0)
    >>> d.instance, d.match
    (1, [0, 2])
"""

from __future__ import annotations

import html
import math
import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..errors import KvlabError
from .decide import decide, prefill_s, session_ring
from .routers import approximate_view, check_router, check_view, rule_params
from .service import ServiceModel
from .views import BlockViews


@dataclass
class Decision:
    """Where one request went and why: the ``instance``, the rule's ``scores`` and the view's
    ``match`` (blocks) per instance, the request's ``hittable`` blocks, its prompt and output
    tokens, when, the instances that refused it first (``refused``) and the requests already in
    flight on the instance (``busy``)."""

    instance: int
    scores: list
    match: list
    hittable: int
    prompt_tokens: int
    out_tokens: int
    t: float
    blocks: list = field(default_factory=list, repr=False)
    session: int = 0
    refused: list = field(default_factory=list)
    busy: int = 0  # requests in flight on the chosen instance when it was chosen

    def __repr__(self) -> str:
        return f"Decision(instance {self.instance}, match {self.match}, refused {self.refused})"

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"


class LiveRouting:
    """A rule, a view and the loads of ``n`` instances (module docstring)."""

    def __init__(self, n: int, router: str, view: str = "precise", block_size: int = 16, *,
                 capacity_tokens: int | None = None, service: ServiceModel | None = None,
                 router_params: dict | None = None, seed: int = 0, down_s: float = 10.0):
        info = check_router(router)
        if info is None:
            raise KvlabError(f"{router!r} is a ceiling of the simulator (one shared cache, or the offline "
                             "optimum), not a rule a router can run; pick a router such as llmd_weighted")
        kind, delay = check_view(view)
        self.n, self.info, self.router, self.view, self.kind = int(n), info, router, view, kind
        self.block_size = int(block_size)
        self.capacity_tokens = capacity_tokens
        self.cap_blocks = None if capacity_tokens is None else int(capacity_tokens) // self.block_size
        self.service = service or ServiceModel()
        self.prm = np.array(self.service.slots(self.block_size) + rule_params(info, router_params), np.float64)
        self.st = np.array([seed, 0], np.int64)
        self.ring_pos, self.ring_own = session_ring(self.n, int(info.params.get("vnodes", 100)), seed)
        vcap, ttl = approximate_view(info, -1 if self.cap_blocks is None else self.cap_blocks, self.block_size)
        self.views = BlockViews(self.n, kind, delay, vcap, ttl if kind == "approximate" else 0.0)
        self.window_s = float(info.params.get("window_s", 0.0)) or math.inf
        self.running = np.zeros(self.n, np.int64)
        self.active = np.zeros(self.n, np.int64)
        self.free_at = np.zeros(self.n)
        self.work = np.zeros(self.n)
        self.up = np.ones(self.n, np.bool_)
        self.down_until = np.zeros(self.n)
        self.down_why: list[str | None] = [None] * self.n
        self.down_s = float(down_s)
        self._window: deque = deque()  # (time, instance, prefill seconds) within Preble's window
        self._scores = np.zeros(self.n)
        self.lock = threading.RLock()

    # -- deciding ---------------------------------------------------------------------------------
    def choose(self, blocks, prompt_tokens: int, out_tokens: int = 0, session: int = 0, now: float = 0.0,
               refused=()) -> Decision | None:
        """Decide where a request goes: ``blocks`` its full blocks' ids in prompt order (hashes),
        ``prompt_tokens``, ``out_tokens`` (its max_tokens), ``session`` (64-bit). None: none is up."""
        with self.lock:
            self._revive(now)
            self.views.advance(now)
            while self._window and self._window[0][0] < now - self.window_s:
                _, i, pre = self._window.popleft()
                self.work[i] -= pre
            h = min(len(blocks), max(int(prompt_tokens) - 1, 0) // self.block_size)
            match = self.views.match(blocks, h)
            sizes = np.array([self.views.size(i) for i in range(self.n)], np.int64)
            usage = sizes / self.cap_blocks if self.cap_blocks else np.zeros(self.n)
            k = int(decide(self.info.code, self.prm, self.st, match, h, int(prompt_tokens), int(out_tokens),
                           self.running, np.maximum(self.free_at - now, 0.0), usage, sizes, self.work, self.active,
                           self.up, self.ring_pos, self.ring_own, np.uint64(session & ((1 << 64) - 1)),
                           self._scores))
            if k < 0:
                return None
            d = Decision(k, self._scores.tolist(), match.tolist(), h, int(prompt_tokens), int(out_tokens), now,
                         list(blocks), session, list(refused), int(self.running[k]))
            self._admit(d, now)
            return d

    def warm(self) -> None:
        """Compile the rule (numba, or load it from the cache) before the first request needs it."""
        z = np.zeros(self.n)
        decide(self.info.code, self.prm, self.st.copy(), np.zeros(self.n, np.int64), 0, 1, 0, self.running.copy(),
               z, z, np.zeros(self.n, np.int64), z.copy(), self.active.copy(), self.up.copy(), self.ring_pos,
               self.ring_own, np.uint64(0), z.copy())

    def _admit(self, d: Decision, now: float) -> None:
        k, bs = d.instance, self.block_size
        self.running[k] += 1
        self.active[k] += -(-(d.prompt_tokens + d.out_tokens) // bs)
        hit = d.match[k] * bs
        pre = float(prefill_s(self.prm, hit, d.prompt_tokens - hit))
        self.free_at[k] = max(now, self.free_at[k]) + pre
        self.work[k] += pre
        self._window.append((now, k, pre))
        self.views.routed(now, k, d.blocks)

    def done(self, d: Decision) -> None:
        """``d``'s request finished (or failed): its load leaves its instance."""
        with self.lock:
            k = d.instance
            self.running[k] -= 1
            self.active[k] -= -(-(d.prompt_tokens + d.out_tokens) // self.block_size)

    def refused(self, d: Decision, reason: str, now: float) -> Decision | None:
        """``d``'s instance could not be reached: mark it down and decide again among the others."""
        with self.lock:
            self.done(d)
            self.mark_down(d.instance, reason, now)
            return self.choose(d.blocks, d.prompt_tokens, d.out_tokens, d.session, now, d.refused + [d.instance])

    # -- instances --------------------------------------------------------------------------------
    def mark_down(self, i: int, reason: str, now: float, for_good: bool = False) -> None:
        with self.lock:
            self.up[i] = False
            self.down_until[i] = math.inf if for_good else now + self.down_s
            self.down_why[i] = reason
            self.views.clear(i)

    def _revive(self, now: float) -> None:
        for i in np.flatnonzero(~self.up & (self.down_until <= now)):
            self.up[i], self.down_why[i] = True, None  # tried again; refused again, down again

    def on_events(self, i: int, events: list, now: float) -> str | None:
        """Apply one batch of instance ``i``'s KV events (kvlab.primitives.kv_events dicts); a
        block size other than the router's marks it down for good and returns why."""
        from ..primitives.kv_events import CLEARED, REMOVED, STORED, external_hash

        def ints(hs):
            return [external_hash(h) if isinstance(h, (bytes, bytearray)) else int(h) for h in hs]

        with self.lock:
            if not self.up[i] and self.down_until[i] == math.inf:
                return self.down_why[i]
            for ev in events:
                if ev["type"] == STORED:
                    if ev["block_size"] != self.block_size:
                        why = (f"its KV events describe {ev['block_size']}-token blocks and the router hashes "
                               f"{self.block_size}-token blocks, so no block would ever match (zero hits, "
                               f"silently); start the router with --block-size {ev['block_size']}")
                        self.mark_down(i, why, now, for_good=True)
                        return why
                    self.views.stored(now, i, ints(ev["block_hashes"]))
                elif ev["type"] == REMOVED:
                    self.views.removed(now, i, ints(ev["block_hashes"]))
                elif ev["type"] == CLEARED:
                    self.views.cleared(now, i)
            return None

    def blocks(self, i: int, now: float) -> set:
        """The blocks the view says instance ``i`` holds at ``now`` (events due by then applied)."""
        with self.lock:
            self.views.advance(now)
            return set(self.views.held[i])

    def state(self) -> list[dict]:
        """One dict per instance: up, why it is down, running, the view's blocks."""
        with self.lock:
            return [{"up": bool(self.up[i]), "down_because": self.down_why[i], "running": int(self.running[i]),
                     "view_blocks": self.views.size(i)} for i in range(self.n)]

    def __repr__(self) -> str:
        return (f"LiveRouting({self.router}/{self.view} x{self.n}: running {self.running.tolist()}, "
                f"up {self.up.astype(int).tolist()})")

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"
