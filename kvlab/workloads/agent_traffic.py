"""Agent conversations that miss the prompt cache, one generator per cause users reported, each
with ``fixed=True`` for the recovered traffic (``kvlab.workloads.agent_causes`` names and
diagnoses them).

Every generator but ``billing_header`` (which is ``agentic_loop``) shares one seeded agent loop:
a system prompt, a task, then one step per turn: an assistant message with an OpenAI-style tool
call (after ``<think>`` reasoning) and the tool's result. Request k holds the first k steps; the
tool schemas travel in ``Request.tools``. Each cause changes one thing between requests.

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
from dataclasses import dataclass

import numpy as np

from ..errors import RequestError
from ..primitives.normalisation import DEFAULT_RULES, Rule, normalise
from ..request import Request, Workload
from .generators import agentic_loop
from .text import check_positive, prose, question, tool_args, tool_result, tool_schemas

TTL_S = 300.0  # Anthropic's default prompt-cache time-to-live: five minutes
START = datetime.datetime(2026, 11, 26, 9, 0, 0, tzinfo=datetime.timezone.utc)
TIMESTAMP_RULE = Rule("timestamp_to_date", r"(Current time: \d{4}-\d{2}-\d{2})T\d{2}:\d{2}:\d{2}Z",
                      r"\1", ("system", "developer"))
BREAKPOINT = "<cache_breakpoint/>"
BREAKPOINT_RULE = Rule("cache_breakpoint", r"\n?" + re.escape(BREAKPOINT))
CLEARED = "[result cleared]"


@dataclass(frozen=True)
class AgentLoop:
    """The seeded conversation every cause edits: ``system`` is ``head`` + ``tail`` (live state
    goes between them), ``steps`` one (assistant tool call, tool result) pair per turn,
    ``thoughts`` the ``<think>`` block before each call."""

    head: str
    tail: str
    task: dict
    tools: tuple[dict, ...]
    steps: tuple[tuple[dict, dict], ...]
    thoughts: tuple[str, ...]
    params: dict

    def system(self, env: str = "") -> dict:
        return {"role": "system", "content": "\n\n".join(p for p in (self.head, env, self.tail) if p)}

    def history(self, k: int) -> list[dict]:
        """The task and the first ``k`` steps."""
        return [self.task, *(m for step in self.steps[:k] for m in step)]


def agent_loop(turns: int = 4, seed: int = 0, *, system_tokens: int = 300, tools: int = 4,
               result_tokens: int = 60, think_tokens: int = 24, max_tokens: int = 32) -> AgentLoop:
    """The shared conversation of ``turns`` steps (the causes' generators edit it).

    Example:
        >>> loop = agent_loop(turns=2)
        >>> [m["role"] for m in loop.history(2)], loop.steps[0][0]["tool_calls"][0]["id"]
        (['user', 'assistant', 'tool', 'assistant', 'tool'], 'call_1')
    """
    check_positive(turns=turns, system_tokens=system_tokens, tools=tools, result_tokens=result_tokens,
                   think_tokens=think_tokens, max_tokens=max_tokens)
    rng = np.random.default_rng([seed, 19])
    schemas = tool_schemas()[: min(tools, len(tool_schemas()))]
    functions = tuple({"type": "function", "function": {"name": s["name"], "description": s["description"],
                                                        "parameters": s["input_schema"]}} for s in schemas)
    head = "You are an autonomous coding agent. Read before you edit; run the tests when done."
    tail = "# Guidelines\n" + prose(rng, system_tokens)
    task = {"role": "user", "content": "Task: " + question(rng, 40)}
    steps, thoughts = [], []
    for i in range(turns):
        name = schemas[int(rng.integers(len(schemas)))]["name"]
        thoughts.append("<think>\n" + prose(rng, think_tokens) + "\n</think>\n\n")
        call = {"id": f"call_{i + 1}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(tool_args(rng, name))}}
        steps.append(({"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": call["id"], "name": name,
                       "content": tool_result(rng, name, result_tokens)}))
    sizes = dict(system_tokens=system_tokens, tools=tools, result_tokens=result_tokens,
                 think_tokens=think_tokens, max_tokens=max_tokens)
    return AgentLoop(head, tail, task, functions, tuple(steps), tuple(thoughts),
                     dict(turns=turns, seed=seed, **sizes))


def _workload(name: str, loop: AgentLoop, bodies, fixed: bool, description: str, **extra) -> Workload:
    """A Workload of (messages, tools) bodies, one request per turn."""
    requests = tuple(Request(messages=tuple(msgs), tools=tools, max_tokens=loop.params["max_tokens"],
                             name=f"step-{k + 1}") for k, (msgs, tools) in enumerate(bodies))
    return Workload(name + ("+fix" if fixed else ""), requests, {**loop.params, **extra, "fixed": fixed},
                    description)


def _append(message: dict, text: str) -> dict:
    return {**message, "content": message["content"] + text}


def normalised(workload: Workload, rules) -> Workload:
    """``workload`` as a server that applies normalisation ``rules`` to every request sees it.

    Example:
        >>> wl = normalised(billing_header(turns=2), kv.DEFAULT_RULES)
        >>> wl[0].messages[0]["content"].startswith("x-anthropic")
        False
    """
    requests = tuple(dataclasses.replace(r, messages=tuple(normalise(r.messages, rules)))
                     for r in workload)
    return dataclasses.replace(workload, requests=requests)


def sort_tools(request: Request) -> Request:
    """The client-side fix for a reordered tool list: tools sorted by function name.

    Example:
        >>> r = sort_tools(tools_reordered(turns=2)[1])
        >>> [t["function"]["name"] for t in r.tools]
        ['Bash', 'Edit', 'Read', 'Write']
    """
    if request.tools is None:
        return request
    return dataclasses.replace(request, tools=tuple(sorted(
        request.tools, key=lambda t: t.get("function", t).get("name", ""))))


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
    the date only, server-side."""
    loop = agent_loop(turns, seed, **sizes)
    rng = np.random.default_rng([seed, 19, 2])
    seconds = np.concatenate([[0], np.cumsum(rng.integers(20, 180, size=turns - 1))])
    bodies = [([loop.system(f"Current time: {(START + datetime.timedelta(seconds=int(s))):%Y-%m-%dT%H:%M:%SZ}"),
                *loop.history(k)], loop.tools) for k, s in enumerate(seconds)]
    wl = _workload("timestamp", loop, bodies, fixed, "the time of the request in the system prompt")
    return normalised(wl, [TIMESTAMP_RULE]) if fixed else wl


def tools_reordered(turns: int = 4, seed: int = 0, *, fixed: bool = False, **sizes) -> Workload:
    """The tool list in another order every request (tools gathered from a set or from MCP
    servers that connect in any order); fixed: the client sorts them (``sort_tools``)."""
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
    wl = _workload("tools_reordered", loop, bodies, fixed, "the tool list reordered between requests")
    return dataclasses.replace(wl, requests=tuple(sort_tools(r) for r in wl)) if fixed else wl


def thinking_dropped(turns: int = 4, seed: int = 0, *, fixed: bool = False, **sizes) -> Workload:
    """Each call follows ``<think>`` reasoning; the client sends it back with the latest call
    only and drops it from older ones; fixed: the client keeps thinking in history."""
    loop = agent_loop(turns, seed, **sizes)
    bodies = []
    for k in range(turns):
        history = loop.history(k)
        for i in range(k):
            if fixed or i == k - 1:
                history[1 + 2 * i] = {**history[1 + 2 * i], "content": loop.thoughts[i]}
        bodies.append(([loop.system(), *history], loop.tools))
    return _workload("thinking_dropped", loop, bodies, fixed, "thinking dropped from older assistant turns")


def _status(loop: AgentLoop, k: int) -> str:
    """``git status`` after the first k steps: every step leaves one more changed file."""
    lines = []
    for i, (call, _) in enumerate(loop.steps[:k]):
        args = json.loads(call["tool_calls"][0]["function"]["arguments"])
        lines.append(f" M src/{args.get('file_path', f'/step{i + 1}.py').rsplit('/', 1)[-1]}")
    return "gitStatus: current branch main\n" + ("\n".join(lines) or "(clean)")


def live_state(turns: int = 4, seed: int = 0, *, fixed: bool = False, **sizes) -> Workload:
    """``git status`` in the system prompt, changed by every step; fixed: the client appends each
    snapshot as a ``<system-reminder>`` to the newest message and leaves it there."""
    loop = agent_loop(turns, seed, **sizes)
    bodies = []
    for k in range(turns):
        if fixed:
            history = loop.history(k)
            for j in range(k + 1):  # the snapshot taken at request j stays where it was sent
                history[2 * j] = _append(history[2 * j], f"\n\n<system-reminder>\n{_status(loop, j)}\n</system-reminder>")
            bodies.append(([loop.system(), *history], loop.tools))
        else:
            bodies.append(([loop.system(_status(loop, k)), *loop.history(k)], loop.tools))
    return _workload("live_state", loop, bodies, fixed, "git status in the system prompt")


def moving_reminder(turns: int = 4, seed: int = 0, *, fixed: bool = False, **sizes) -> Workload:
    """A ``<system-reminder>`` appended to the latest message, removed from the one before;
    fixed: each reminder stays in the message it was first sent with."""
    loop = agent_loop(turns, seed, **sizes)
    bodies = []
    for k in range(turns):
        history = loop.history(k)
        for j in range(k + 1) if fixed else (k,):
            history[2 * j] = _append(history[2 * j], f"\n\n<system-reminder>\n{j} of {turns} steps done; "
                                     "keep the todo list current.\n</system-reminder>")
        bodies.append(([loop.system(), *history], loop.tools))
    return _workload("moving_reminder", loop, bodies, fixed, "a system reminder on the latest message")


def micro_compaction(turns: int = 5, seed: int = 0, *, fixed: bool = False, keep: int = 2,
                     keep_lines: int = 2, **sizes) -> Workload:
    """Tool results older than ``keep`` steps replaced by ``[result cleared]``; fixed: the client
    cuts each result to ``keep_lines`` lines once, when it enters the history, and never again."""
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
    return _workload("micro_compaction", loop, bodies, fixed, "old tool results cleared in place",
                     keep=keep, keep_lines=keep_lines)


def compaction(turns: int = 4, seed: int = 0, *, fixed: bool = False, compact_at: int | None = None,
               **sizes) -> Workload:
    """At turn ``compact_at`` (default ``turns // 2``, 1-based index of the step) the history is
    replaced by a summary; fixed: the summary is appended as a marker and the history kept (the
    context does not shrink: use it while the context fits)."""
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
    return _workload("compaction", loop, bodies, fixed, "the history replaced by a summary", compact_at=at)


def rolling_breakpoint(turns: int = 4, seed: int = 0, *, fixed: bool = False, **sizes) -> Workload:
    """The client marks the end of what it expects cached (the previous request's last message)
    with ``<cache_breakpoint/>`` and removes the older mark; fixed: ``BREAKPOINT_RULE`` strips
    the marks server-side."""
    loop = agent_loop(turns, seed, **sizes)
    bodies = []
    for k in range(turns):
        history = loop.history(k)
        if k:
            history[2 * k - 2] = _append(history[2 * k - 2], "\n" + BREAKPOINT)
        bodies.append(([loop.system(), *history], loop.tools))
    wl = _workload("rolling_breakpoint", loop, bodies, fixed, "a cache-breakpoint mark rewritten every turn")
    return normalised(wl, [BREAKPOINT_RULE]) if fixed else wl


def idle_gap(turns: int = 4, seed: int = 0, *, fixed: bool = False, ttl_s: float = TTL_S,
             **sizes) -> Workload:
    """Unchanged, growing prompts separated by idle gaps longer than ``ttl_s``:
    ``params["idle_s"][i]`` is the idle time before request i (no structural change: a miss
    here is expiry). Fixed: the client re-sends the last request (``max_tokens=1``) before the
    time-to-live runs out (``keepalive-*`` requests)."""
    if not ttl_s > 0:
        raise RequestError(f"ttl_s must be > 0 seconds, got {ttl_s!r}")
    loop = agent_loop(turns, seed, **sizes)
    rng = np.random.default_rng([seed, 19, 10])
    gaps = [0.0, *(float(ttl_s + rng.integers(60, 900)) for _ in range(turns - 1))]
    wl = _workload("idle_gap", loop, [([loop.system(), *loop.history(k)], loop.tools) for k in range(turns)],
                   fixed, "idle gaps longer than the cache time-to-live", ttl_s=ttl_s)
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


GENERATORS = {f.__name__: f for f in (billing_header, timestamp, tools_reordered, thinking_dropped,
                                      live_state, moving_reminder, micro_compaction, compaction,
                                      rolling_breakpoint, idle_gap)}
