"""The causes of agent prompt-cache misses users reported, each a :class:`Cause`: what users see,
a seeded workload that reproduces it (``generate``), the Anthropic cache-diagnostics type a
structural comparison of consecutive requests gives (``expected``), and the fix (``fix``: server
normalisation rules or a client change) with the recovered traffic (``fixed``).

``structural_change(before, after)`` is that comparison: model is not part of a Request, so it
looks at tools, system and messages, in the provider's prompt order.

Example:
    >>> cause = CAUSES["tools_reordered"]
    >>> wl = cause.generate(turns=3)
    >>> [c.type for c in cause.diagnose(wl)]
    ['tools_changed', 'tools_changed']
    >>> [c.type for c in cause.diagnose(cause.fixed(turns=3))]
    [None, None]
    >>> CAUSES["idle_gap"].diagnose(CAUSES["idle_gap"].generate(turns=2))
    (StructuralChange(no structural change),)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import RequestError
from ..primitives.display import summary_html, table_html
from ..primitives.normalisation import DEFAULT_RULES, Rule
from ..request import Request, Workload, canonical_json
from . import agent_traffic as traffic

SYSTEM_ROLES = ("system", "developer")
TYPES = ("tools_changed", "system_changed", "messages_changed")


@dataclass(frozen=True)
class StructuralChange:
    """The first structural difference between two requests of a conversation: ``type`` is the
    Anthropic cache-diagnostics ``cache_miss_reason.type`` (None: no structural change, the later
    request extends the earlier one), ``message_index`` the first message that differs (None for
    tools), ``detail`` what differs."""

    type: str | None
    message_index: int | None = None
    detail: str = ""

    def __repr__(self) -> str:
        if self.type is None:
            return "StructuralChange(no structural change)"
        where = "" if self.message_index is None else f" at message {self.message_index}"
        return f"StructuralChange({self.type}{where})"

    def _repr_html_(self) -> str:
        return summary_html("StructuralChange", self.type or "no structural change",
                            None if self.message_index is None else f"message {self.message_index}",
                            note=self.detail)


def _same(a, b) -> bool:
    return canonical_json(a) == canonical_json(b)


def structural_change(before: Request, after: Request) -> StructuralChange:
    """Compare two chat requests as a provider's cache diagnostics do: tools, then the leading
    system (or developer) messages, then whether ``after``'s other messages extend ``before``'s.

    Example:
        >>> a = Request(messages=({"role": "system", "content": "Be brief."},
        ...                       {"role": "user", "content": "Hi"}))
        >>> b = Request(messages=({"role": "system", "content": "Be brief!"},
        ...                       {"role": "user", "content": "Hi"}))
        >>> structural_change(a, b), structural_change(a, a)
        (StructuralChange(system_changed at message 0), StructuralChange(no structural change))
    """
    if before.messages is None or after.messages is None:
        raise RequestError("structural_change compares chat requests (messages=...); token-id "
                           "requests have no structure: compare them with kv.diverge")
    if not _same(before.tools, after.tools):
        names = [sorted(canonical_json(t) for t in r.tools or ()) for r in (before, after)]
        return StructuralChange("tools_changed", None, "the same tools in another order"
                                if names[0] == names[1] else "the tool definitions differ")
    cut = [next((i for i, m in enumerate(r.messages) if m.get("role") not in SYSTEM_ROLES),
                len(r.messages)) for r in (before, after)]
    sys_a, sys_b = before.messages[:cut[0]], after.messages[:cut[1]]
    if not _same(sys_a, sys_b):
        i = next((i for i, (x, y) in enumerate(zip(sys_a, sys_b)) if not _same(x, y)), min(cut))
        return StructuralChange("system_changed", i, f"system message {i} differs")
    rest_a, rest_b = before.messages[cut[0]:], after.messages[cut[1]:]
    for i, m in enumerate(rest_a):
        if i >= len(rest_b) or not _same(m, rest_b[i]):
            return StructuralChange("messages_changed", cut[0] + i,
                                    f"message {cut[0] + i} ({m.get('role')}) was "
                                    + ("dropped" if i >= len(rest_b) else "edited or replaced"))
    return StructuralChange(None, None, "the later request extends the earlier one")


@dataclass(frozen=True)
class Fix:
    """How to recover: ``side`` "server" (normalisation ``rules`` applied before caching, e.g.
    ``kv.normalise``) or "client" (what the client should send instead), said in ``summary``."""

    side: str
    summary: str
    rules: tuple[Rule, ...] = ()

    def __repr__(self) -> str:
        rules = f" rules={[r.name for r in self.rules]}" if self.rules else ""
        return f"Fix({self.side}: {self.summary}{rules})"

    def _repr_html_(self) -> str:
        return summary_html("Fix", self.side, ", ".join(r.name for r in self.rules), note=self.summary)


@dataclass(frozen=True)
class Cause:
    """One reported cause of agent cache misses. ``generate(turns=, seed=, **sizes)`` reproduces
    it, ``fixed(...)`` gives the traffic after ``fix``; ``expected`` is the diagnostics type
    between consecutive requests where it strikes (None for ``idle_gap``: nothing structural
    changes, the entry expired).

    Example:
        >>> CAUSES["timestamp"]      # doctest: +NORMALIZE_WHITESPACE
        Cause(timestamp: system_changed;
              Fix(server: keep the date, drop the time of day rules=['timestamp_to_date']))
    """

    name: str
    description: str
    expected: str | None
    fix: Fix
    generator: Callable[..., Workload] = field(repr=False, compare=False)

    def generate(self, turns: int = 4, seed: int = 0, **sizes) -> Workload:
        """The traffic that misses."""
        return self.generator(turns, seed, **sizes)

    def fixed(self, turns: int = 4, seed: int = 0, **sizes) -> Workload:
        """The same conversation after the fix."""
        return self.generator(turns, seed, fixed=True, **sizes)

    def diagnose(self, workload: Workload) -> tuple[StructuralChange, ...]:
        """``structural_change`` of every request against the one before it."""
        return tuple(structural_change(a, b) for a, b in zip(workload.requests, workload.requests[1:]))

    def __repr__(self) -> str:
        return f"Cause({self.name}: {self.expected or 'no structural change'}; {self.fix!r})"

    def _repr_html_(self) -> str:
        rows = [("expected", self.expected or "None (no structural change)"), ("fix", repr(self.fix))]
        return summary_html("Cause", self.name, note=self.description,
                            body=table_html(None, rows, row_headers=True))


def _cause(generator, expected, fix, description) -> Cause:
    return Cause(generator.__name__, description, expected, fix, generator)


CAUSES: dict[str, Cause] = {c.name: c for c in (
    _cause(traffic.billing_header, "system_changed", Fix("server", "strip the header line", DEFAULT_RULES),
           "A per-request x-anthropic-billing-header line (cch= hashes the body) opens the system "
           "prompt, so every request differs a few dozen tokens in and nothing after it is reused."),
    _cause(traffic.timestamp, "system_changed",
           Fix("server", "keep the date, drop the time of day", (traffic.TIMESTAMP_RULE,)),
           "The current time, to the second, in the system prompt: each request's prompt differs "
           "there, and the tools, history and the rest of the system prompt are prefilled again."),
    _cause(traffic.tools_reordered, "tools_changed", Fix("client", "send the tools sorted by name"),
           "The tool list arrives in another order (gathered from a set, MCP servers connecting in "
           "any order); the template renders tools before the history, so all of it misses."),
    _cause(traffic.thinking_dropped, "messages_changed",
           Fix("client", "send <think> reasoning back with every assistant turn"),
           "The client (or the chat template) drops <think> reasoning from older assistant turns, "
           "so the re-rendered history stops matching what was cached where thinking was."),
    _cause(traffic.live_state, "system_changed",
           Fix("client", "append live state to the newest message as a reminder; never move it"),
           "git status (or other live state) in the system prompt changes whenever the agent edits "
           "a file, and the whole conversation after it is prefilled again."),
    _cause(traffic.moving_reminder, "messages_changed",
           Fix("client", "leave each reminder in the message it was sent with"),
           "A <system-reminder> rides on the latest message and is removed from the one before, "
           "so the previous request's last message changes every turn."),
    _cause(traffic.micro_compaction, "messages_changed",
           Fix("client", "cut tool results once, when they enter the history"),
           "Old tool results are replaced by '[result cleared]' stubs as they age: each turn edits "
           "a message deep in the history, and everything after it misses."),
    _cause(traffic.compaction, "messages_changed",
           Fix("client", "append the summary as a marker and keep the history (while it fits)"),
           "The whole history is replaced by a summary: only the system prompt and tools survive."),
    _cause(traffic.rolling_breakpoint, "messages_changed",
           Fix("server", "strip the breakpoint marks", (traffic.BREAKPOINT_RULE,)),
           "The client moves a cache-breakpoint mark to the end of the last request and removes "
           "the older one: an earlier message's text is rewritten every turn."),
    _cause(traffic.idle_gap, None,
           Fix("client", "re-send the last request before the time-to-live runs out"),
           "Turns separated by idle gaps longer than the cache's time-to-live: the prompt is "
           "unchanged (no structural change), the entry expired or was evicted."),
)}
