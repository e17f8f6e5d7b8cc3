"""The seeded agent conversation the agent causes edit (``kvlab.workloads.agent_traffic``): a
system prompt, a task, then one step per turn, an assistant message with an OpenAI-style tool
call (after ``<think>`` reasoning) and the tool's result; and the helpers that turn its edits into
workloads, apply server rules and sort tools.

Example:
    >>> loop = agent_loop(turns=3)
    >>> loop, [m["role"] for m in loop.history(1)]
    (AgentLoop(3 steps, 4 tools, seed=0), ['user', 'assistant', 'tool'])
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np

from ..primitives.display import summary_html, table_html
from ..primitives.normalisation import normalise
from ..request import Request, Workload
from .text import check_positive, prose, question, tool_args, tool_result, tool_schemas


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

    def __repr__(self) -> str:
        return f"AgentLoop({len(self.steps)} steps, {len(self.tools)} tools, seed={self.params['seed']})"

    def _repr_html_(self) -> str:
        rows = [(i + 1, a["tool_calls"][0]["function"]["name"], len(t["content"]))
                for i, (a, t) in enumerate(self.steps)]
        return summary_html("AgentLoop", repr(self), body=table_html(("step", "tool", "result chars"), rows))

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


def loop_workload(name: str, loop: AgentLoop, bodies, fixed: bool, description: str, **extra) -> Workload:
    """A Workload of (messages, tools) bodies, one request per turn, named ``step-<k>``."""
    requests = tuple(Request(messages=tuple(msgs), tools=tools, max_tokens=loop.params["max_tokens"],
                             name=f"step-{k + 1}") for k, (msgs, tools) in enumerate(bodies))
    return Workload(name + ("+fix" if fixed else ""), requests, {**loop.params, **extra, "fixed": fixed},
                    description)


def append_text(message: dict, text: str) -> dict:
    """A copy of ``message`` with ``text`` added to its content."""
    return {**message, "content": message["content"] + text}


def normalised(workload: Workload, rules) -> Workload:
    """``workload`` as a server that applies normalisation ``rules`` to every request sees it.

    Example:
        >>> wl = normalised(kv.workloads.agent_traffic.billing_header(turns=2), kv.DEFAULT_RULES)
        >>> wl[0].messages[0]["content"].startswith("x-anthropic")
        False
    """
    requests = tuple(dataclasses.replace(r, messages=tuple(normalise(r.messages, rules)))
                     for r in workload)
    return dataclasses.replace(workload, requests=requests)


def sort_tools(request: Request) -> Request:
    """The client-side fix for a reordered tool list: tools sorted by function name.

    Example:
        >>> r = sort_tools(kv.workloads.agent_traffic.tools_reordered(turns=2)[1])
        >>> [t["function"]["name"] for t in r.tools]
        ['Bash', 'Edit', 'Read', 'Write']
    """
    if request.tools is None:
        return request
    return dataclasses.replace(request, tools=tuple(sorted(
        request.tools, key=lambda t: t.get("function", t).get("name", ""))))
