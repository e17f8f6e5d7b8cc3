"""Agent conversations that miss the prompt cache, one generator per cause users reported, each
with ``fixed=True`` for the recovered traffic (``kvlab.workloads.agent_causes`` names and
diagnoses them).

Every generator but ``billing_header`` (which is ``agentic_loop``) edits one seeded agent loop
(``kvlab.workloads.agent_conversation``): request k holds the first k tool-call steps, the tool
schemas travel in ``Request.tools``, and each cause changes one thing between requests.

Example:
    >>> wl = timestamp(turns=2)
    >>> [r.messages[0]["content"].split("\\n")[2] for r in wl]
    ['Current time: 2026-11-26T09:00:00Z', 'Current time: 2026-11-26T09:00:24Z']
    >>> {r.messages[0]["content"].split("\\n")[2] for r in timestamp(turns=2, fixed=True)}
    {'Current time: 2026-11-26'}
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import re

import numpy as np

from ..errors import RequestError
from ..primitives.normalisation import DEFAULT_RULES, Rule
from ..request import Workload
from .agent_conversation import AgentLoop, agent_loop, append_text, loop_workload, normalised, sort_tools
from .generators import agentic_loop
from .text import check_positive, prose

TTL_S = 300.0  # Anthropic's default prompt-cache time-to-live: five minutes
START = datetime.datetime(2026, 11, 26, 9, 0, 0, tzinfo=datetime.timezone.utc)
TIMESTAMP_RULE = Rule("timestamp_to_date", r"(Current time: \d{4}-\d{2}-\d{2})T\d{2}:\d{2}:\d{2}Z",
                      r"\1", ("system", "developer"))
BREAKPOINT = "<cache_breakpoint/>"
BREAKPOINT_RULE = Rule("cache_breakpoint", r"\n?" + re.escape(BREAKPOINT))
CLEARED = "[result cleared]"


def billing_header(turns: int = 4, seed: int = 0, *, fixed: bool = False, system_tokens: int = 300,
                   tools: int = 4, result_tokens: int = 60, think_tokens: int = 0,
                   max_tokens: int = 32) -> Workload:
    """``agentic_loop`` with its per-request ``x-anthropic-billing-header`` line (``cch`` hashes
    the body); fixed: kvlab's ``DEFAULT_RULES`` strip the line server-side. Its tool schemas are
    text in the system prompt, as ``agentic_loop`` has them; ``think_tokens`` is accepted (the
    causes share sizes) and unused: this loop does not think.

    Example:
        >>> billing_header(turns=2)[1].messages[0]["content"][:27]
        'x-anthropic-billing-header:'
    """
    wl = agentic_loop(turns, seed, system_tokens=system_tokens, tools=tools, result_tokens=result_tokens,
                      billing_header=True, max_tokens=max_tokens)
    wl = dataclasses.replace(wl, name="billing_header", params={**wl.params, "fixed": fixed})
    return dataclasses.replace(normalised(wl, DEFAULT_RULES), name="billing_header+fix") if fixed else wl


def timestamp(turns: int = 4, seed: int = 0, *, fixed: bool = False, **sizes) -> Workload:
    """The current time (to the second) in the system prompt; fixed: ``TIMESTAMP_RULE`` keeps
    the date only, server-side (examples in the module docstring)."""
    loop = agent_loop(turns, seed, **sizes)
    rng = np.random.default_rng([seed, 19, 2])
    seconds = np.concatenate([[0], np.cumsum(rng.integers(20, 180, size=turns - 1))])
    stamps = [f"{START + datetime.timedelta(seconds=int(s)):%Y-%m-%dT%H:%M:%SZ}" for s in seconds]
    bodies = [([loop.system(f"Current time: {stamp}"), *loop.history(k)], loop.tools)
              for k, stamp in enumerate(stamps)]
    wl = loop_workload("timestamp", loop, bodies, fixed, "the time of the request in the system prompt")
    return normalised(wl, [TIMESTAMP_RULE]) if fixed else wl


def tools_reordered(turns: int = 4, seed: int = 0, *, fixed: bool = False, **sizes) -> Workload:
    """The tool list in another order every request (tools gathered from a set or from MCP
    servers that connect in any order); fixed: the client sorts them (``sort_tools``).

    Example:
        >>> [[t["function"]["name"] for t in r.tools] for r in tools_reordered(turns=2)]
        [['Write', 'Bash', 'Edit', 'Read'], ['Write', 'Bash', 'Read', 'Edit']]
    """
    loop = agent_loop(turns, seed, **sizes)
    rng = np.random.default_rng([seed, 19, 3])
    orders, prev = [], tuple(range(len(loop.tools)))
    for _ in range(turns):
        order = prev
        while order == prev and len(prev) > 1:  # always another order, so every turn misses
            order = tuple(int(i) for i in rng.permutation(len(prev)))
        orders.append(order)
        prev = order
    bodies = [([loop.system(), *loop.history(k)], tuple(loop.tools[i] for i in order))
              for k, order in enumerate(orders)]
    wl = loop_workload("tools_reordered", loop, bodies, fixed, "the tool list reordered between requests")
    return dataclasses.replace(wl, requests=tuple(sort_tools(r) for r in wl)) if fixed else wl


def thinking_dropped(turns: int = 4, seed: int = 0, *, fixed: bool = False, **sizes) -> Workload:
    """Each call follows ``<think>`` reasoning; the client sends it back with the latest call
    only and drops it from older ones; fixed: the client keeps thinking in history.

    Example:
        >>> [m["content"][:7] for m in thinking_dropped(turns=3)[2].messages if m["role"] == "assistant"]
        ['', '<think>']
    """
    loop = agent_loop(turns, seed, **sizes)
    bodies = []
    for k in range(turns):
        history = loop.history(k)
        for i in range(k):
            if fixed or i == k - 1:
                history[1 + 2 * i] = {**history[1 + 2 * i], "content": loop.thoughts[i]}
        bodies.append(([loop.system(), *history], loop.tools))
    return loop_workload("thinking_dropped", loop, bodies, fixed,
                         "thinking dropped from older assistant turns")


def _status(loop: AgentLoop, k: int) -> str:
    """``git status`` after the first k steps: every step leaves one more changed file."""
    lines = []
    for i, (call, _) in enumerate(loop.steps[:k]):
        args = json.loads(call["tool_calls"][0]["function"]["arguments"])
        lines.append(f" M src/{args.get('file_path', f'/step{i + 1}.py').rsplit('/', 1)[-1]}")
    return "gitStatus: current branch main\n" + ("\n".join(lines) or "(clean)")


def live_state(turns: int = 4, seed: int = 0, *, fixed: bool = False, **sizes) -> Workload:
    """``git status`` in the system prompt, changed by every step; fixed: the client appends each
    snapshot as a ``<system-reminder>`` to the newest message and leaves it there.

    Example:
        >>> live_state(turns=2)[1].messages[0]["content"].splitlines()[2:4]
        ['gitStatus: current branch main', ' M src/step1.py']
    """
    loop = agent_loop(turns, seed, **sizes)
    bodies = []
    for k in range(turns):
        if fixed:
            history = loop.history(k)
            for j in range(k + 1):  # the snapshot taken at request j stays where it was sent
                reminder = f"\n\n<system-reminder>\n{_status(loop, j)}\n</system-reminder>"
                history[2 * j] = append_text(history[2 * j], reminder)
            bodies.append(([loop.system(), *history], loop.tools))
        else:
            bodies.append(([loop.system(_status(loop, k)), *loop.history(k)], loop.tools))
    return loop_workload("live_state", loop, bodies, fixed, "git status in the system prompt")


def moving_reminder(turns: int = 4, seed: int = 0, *, fixed: bool = False, **sizes) -> Workload:
    """A ``<system-reminder>`` appended to the latest message, removed from the one before;
    fixed: each reminder stays in the message it was first sent with.

    Example:
        >>> last = moving_reminder(turns=3)[2]
        >>> [i for i, m in enumerate(last.messages) if "<system-reminder>" in m["content"]]
        [5]
    """
    loop = agent_loop(turns, seed, **sizes)
    bodies = []
    for k in range(turns):
        history = loop.history(k)
        for j in range(k + 1) if fixed else (k,):
            history[2 * j] = append_text(history[2 * j], f"\n\n<system-reminder>\n{j} of {turns} steps done; "
                                     "keep the todo list current.\n</system-reminder>")
        bodies.append(([loop.system(), *history], loop.tools))
    return loop_workload("moving_reminder", loop, bodies, fixed, "a system reminder on the latest message")


def micro_compaction(turns: int = 5, seed: int = 0, *, fixed: bool = False, keep: int = 2,
                     keep_lines: int = 2, **sizes) -> Workload:
    """Tool results older than ``keep`` steps replaced by ``[result cleared]``; fixed: the client
    cuts each result to ``keep_lines`` lines once, when it enters the history, and never again.

    Example:
        >>> [m["content"] == CLEARED for m in micro_compaction(turns=4)[3].messages if m["role"] == "tool"]
        [True, False, False]
    """
    check_positive(keep=keep, keep_lines=keep_lines)
    loop = agent_loop(turns, seed, **sizes)
    bodies = []
    for k in range(turns):
        history = loop.history(k)
        for i in range(k):
            tool = history[2 + 2 * i]
            if fixed:
                lines = tool["content"].split("\n")
                cut = "\n".join(lines[:keep_lines]) + f"\n[{len(lines) - keep_lines} more lines cleared]"
                history[2 + 2 * i] = {**tool, "content": cut} if len(lines) > keep_lines else tool
            elif i < k - keep:
                history[2 + 2 * i] = {**tool, "content": CLEARED}
        bodies.append(([loop.system(), *history], loop.tools))
    return loop_workload("micro_compaction", loop, bodies, fixed, "old tool results cleared in place",
                     keep=keep, keep_lines=keep_lines)


def compaction(turns: int = 4, seed: int = 0, *, fixed: bool = False, compact_at: int | None = None,
               **sizes) -> Workload:
    """At turn ``compact_at`` (default ``turns // 2``, 1-based index of the step) the history is
    replaced by a summary; fixed: the summary is appended as a marker and the history kept (the
    context does not shrink: use it while the context fits).

    Example:
        >>> [len(r.messages) for r in compaction(4)], [len(r.messages) for r in compaction(4, fixed=True)]
        ([2, 4, 2, 4], [2, 4, 7, 9])
    """
    at = max(1, turns // 2) if compact_at is None else compact_at
    check_positive(compact_at=at)
    loop = agent_loop(turns, seed, **sizes)
    summary = {"role": "user", "content": "[compaction] Summary of the conversation so far: "
               + prose(np.random.default_rng([seed, 19, 8]), 40) + " Continue the task."}
    bodies = []
    for k in range(turns):
        if k < at:
            history = loop.history(k)
        elif fixed:
            history = [*loop.history(at), summary, *loop.history(k)[1 + 2 * at:]]
        else:
            history = [summary, *loop.history(k)[1 + 2 * at:]]
        bodies.append(([loop.system(), *history], loop.tools))
    return loop_workload("compaction", loop, bodies, fixed, "the history replaced by a summary",
                         compact_at=at)


def rolling_breakpoint(turns: int = 4, seed: int = 0, *, fixed: bool = False, **sizes) -> Workload:
    """The client marks the end of what it expects cached (the previous request's last message)
    with ``<cache_breakpoint/>`` and removes the older mark; fixed: ``BREAKPOINT_RULE`` strips
    the marks server-side.

    Example:
        >>> [[i for i, m in enumerate(r.messages) if BREAKPOINT in m["content"]]
        ...  for r in rolling_breakpoint(turns=3)]
        [[], [1], [3]]
    """
    loop = agent_loop(turns, seed, **sizes)
    bodies = []
    for k in range(turns):
        history = loop.history(k)
        if k:
            history[2 * k - 2] = append_text(history[2 * k - 2], "\n" + BREAKPOINT)
        bodies.append(([loop.system(), *history], loop.tools))
    wl = loop_workload("rolling_breakpoint", loop, bodies, fixed,
                       "a cache-breakpoint mark rewritten every turn")
    return normalised(wl, [BREAKPOINT_RULE]) if fixed else wl


def idle_gap(turns: int = 4, seed: int = 0, *, fixed: bool = False, ttl_s: float = TTL_S,
             **sizes) -> Workload:
    """Unchanged, growing prompts separated by idle gaps longer than ``ttl_s``:
    ``params["idle_s"][i]`` is the idle time before request i (no structural change: a miss
    here is expiry). Fixed: the client re-sends the last request (``max_tokens=1``) before the
    time-to-live runs out (``keepalive-*`` requests).

    Example:
        >>> idle_gap(turns=2).params["idle_s"], [r.name for r in idle_gap(turns=2, fixed=True)]
        ((0.0, 554.0), ['step-1', 'keepalive-1.1', 'keepalive-1.2', 'step-2'])
    """
    if not ttl_s > 0:
        raise RequestError(f"ttl_s must be > 0 seconds, got {ttl_s!r}")
    loop = agent_loop(turns, seed, **sizes)
    rng = np.random.default_rng([seed, 19, 10])
    gaps = [0.0, *(float(ttl_s + rng.integers(60, 900)) for _ in range(turns - 1))]
    bodies = [([loop.system(), *loop.history(k)], loop.tools) for k in range(turns)]
    wl = loop_workload("idle_gap", loop, bodies, fixed, "idle gaps longer than the cache time-to-live",
                       ttl_s=ttl_s)
    if not fixed:
        return dataclasses.replace(wl, params={**wl.params, "idle_s": tuple(gaps)})
    requests, idle, every = [], [], 0.8 * ttl_s
    for k, (request, gap) in enumerate(zip(wl, gaps)):
        pings = max(0, math.ceil(gap / every) - 1)
        for j in range(pings):
            requests.append(dataclasses.replace(wl[k - 1], max_tokens=1, name=f"keepalive-{k}.{j + 1}"))
            idle.append(every)
        requests.append(request)
        idle.append(gap - pings * every)
    return dataclasses.replace(wl, requests=tuple(requests), params={**wl.params, "idle_s": tuple(idle)})


def expired(workload: Workload, ttl_s: float | None = None) -> tuple[bool, ...]:
    """Per request: whether the idle time before it (``params["idle_s"]``) exceeds ``ttl_s``
    (default the workload's own ``ttl_s``): what a replayer with a time-to-live expires.

    Example:
        >>> expired(idle_gap(turns=3)), expired(idle_gap(turns=3, fixed=True))[-1]
        ((False, True, True), False)
    """
    idle = workload.params.get("idle_s") or (0.0,) * len(workload)
    ttl = workload.params.get("ttl_s", TTL_S) if ttl_s is None else ttl_s
    return tuple(float(s) > ttl for s in idle)
