"""The agent-cause generators without a model (issue 19 §3): their structure, the diagnostics
type and message each consecutive pair gets, what the fixes change, and ``Request.tools``.

Each test names the mutant it catches in a comment."""

from __future__ import annotations

import doctest
import hashlib
import json

import pytest

import kvlab as kv
from kvlab.errors import RequestError
from kvlab.request import canonical_json
from kvlab.workloads import CAUSES, Request, StructuralChange, structural_change
from kvlab.workloads import agent_causes, agent_conversation, agent_traffic
from kvlab.workloads.agent_conversation import normalised, sort_tools
from kvlab.workloads.agent_traffic import CLEARED, TTL_S, expired, idle_gap, micro_compaction

SYS, TOOLS, MSGS = "system_changed", "tools_changed", "messages_changed"
# per cause, turns=4: the diagnostics (type, message index) of pairs (1,2), (2,3), (3,4)
PAIRS = {
    "billing_header": [(SYS, 0)] * 3,
    "timestamp": [(SYS, 0)] * 3,
    "tools_reordered": [(TOOLS, None)] * 3,
    "thinking_dropped": [(None, None), (MSGS, 2), (MSGS, 4)],
    "live_state": [(SYS, 0)] * 3,
    "moving_reminder": [(MSGS, 1), (MSGS, 3), (MSGS, 5)],
    "micro_compaction": [(None, None), (None, None), (MSGS, 3)],
    "compaction": [(None, None), (MSGS, 1), (None, None)],
    "rolling_breakpoint": [(MSGS, 1), (MSGS, 1), (MSGS, 3)],
    "idle_gap": [(None, None)] * 3,
}


def test_every_reported_cause_is_registered():
    # mutant: a cause missing from CAUSES, or registered under another name
    assert list(CAUSES) == list(PAIRS)
    assert {c.expected for c in CAUSES.values()} == {SYS, TOOLS, MSGS, None}
    assert [n for n, c in CAUSES.items() if c.expected is None] == ["idle_gap"]


@pytest.mark.parametrize("name", list(PAIRS))
def test_diagnostics_of_each_pair(name):
    # mutant: a generator that changes the wrong message (or none), or structural_change that
    # checks tools after messages / ignores them: the (type, index) per pair differs
    cause = CAUSES[name]
    got = [(c.type, c.message_index) for c in cause.diagnose(cause.generate(turns=4))]
    assert got == PAIRS[name]
    assert {t for t, _ in got} - {None} == ({cause.expected} if cause.expected else set())


@pytest.mark.parametrize("name", list(PAIRS))
def test_fixed_traffic_has_no_structural_change(name):
    # mutant: a fix that ignores fixed=True (thinking still dropped, reminder still moved, ...)
    cause = CAUSES[name]
    fixed = cause.fixed(turns=4)
    assert all(c.type is None for c in cause.diagnose(fixed))
    assert fixed.params["fixed"] is True and cause.generate(turns=4).params["fixed"] is False


@pytest.mark.parametrize("name", list(PAIRS))
def test_generators_are_seeded_and_sized(name):
    # mutant: an unseeded draw (digests differ between calls) or a seed that is ignored
    cause = CAUSES[name]
    a, b, c = (cause.generate(turns=3, seed=s) for s in (1, 1, 2))
    assert a.digest() == b.digest() != c.digest()
    assert len(a) == 3 and [r.name for r in a] == ["step-1", "step-2", "step-3"]
    assert all(r.max_tokens == 32 for r in a)


@pytest.mark.parametrize("name", list(PAIRS))
def test_one_turn_and_bad_sizes(name):
    # mutant: a generator that indexes a previous request that a one-turn workload lacks, or
    # lets turns=0 through as an empty workload
    cause = CAUSES[name]
    assert len(cause.generate(turns=1)) == 1 and cause.diagnose(cause.generate(turns=1)) == ()
    with pytest.raises(RequestError, match="turns must be a positive int, got 0"):
        cause.generate(turns=0)
    if name != "billing_header":
        with pytest.raises(RequestError, match="result_tokens must be a positive int"):
            cause.generate(turns=2, result_tokens=-1)


@pytest.mark.parametrize("name", [n for n in PAIRS if n != "billing_header"])
def test_openai_tool_calls_and_results_pair_up(name):
    # mutant: a tool result whose tool_call_id names no call, or tools left out of the request
    last = CAUSES[name].generate(turns=4)[-1]
    assert [t["function"]["name"] for t in sort_tools(last).tools] == ["Bash", "Edit", "Read", "Write"]
    msgs = last.messages
    calls = [m["tool_calls"][0] for m in msgs if m["role"] == "assistant"]
    results = [m for m in msgs if m["role"] == "tool"]
    assert [c["id"] for c in calls] == [r["tool_call_id"] for r in results]
    assert all(c["type"] == "function" and isinstance(json.loads(c["function"]["arguments"]), dict)
               for c in calls)
    assert [c["function"]["name"] for c in calls] == [r["name"] for r in results]


def test_server_fixes_are_their_rules_applied():
    # mutant: fixed() and fix.rules disagree (the rules a server would install do not recover
    # the traffic the cause's fixed() shows)
    for cause in CAUSES.values():
        if cause.fix.side == "server":
            assert cause.fix.rules
            assert normalised(cause.generate(turns=3), cause.fix.rules) == cause.fixed(turns=3)
        else:
            assert cause.fix.side == "client" and cause.fix.rules == ()


def test_micro_compaction_clears_results_older_than_keep():
    # mutant: off by one in the age test (clears the result of step k - keep too)
    wl = micro_compaction(turns=5, keep=2)
    cleared = [[m["content"] == CLEARED for m in r.messages if m["role"] == "tool"] for r in wl]
    assert cleared == [[], [False], [False, False], [True, False, False], [True, True, False, False]]
    cut = micro_compaction(turns=3, fixed=True, keep_lines=2)[2].messages[3]["content"].split("\n")
    assert len(cut) == 3 and cut[2].endswith("more lines cleared]")


def test_compaction_replaces_history_at_compact_at():
    # mutant: compaction at the wrong turn, or history kept before the summary when not fixed
    wl = CAUSES["compaction"].generate(turns=5, compact_at=3)
    roles = [[m["role"] for m in r.messages] for r in wl]
    assert roles[3] == ["system", "user"] and roles[4] == ["system", "user", "assistant", "tool"]
    assert wl[3].messages[1]["content"].startswith("[compaction]")
    fixed = CAUSES["compaction"].fixed(turns=5, compact_at=3)
    assert len(fixed[3].messages) == 2 + 6 + 1 and fixed[3].messages[-1] == wl[3].messages[1]


def test_idle_gap_expires_and_keepalives_do_not():
    # mutant: keep-alive pings spaced at or past the TTL, or idle_s misaligned with requests
    wl = idle_gap(turns=4)
    idle = wl.params["idle_s"]
    assert len(idle) == len(wl) and idle[0] == 0.0 and all(s > TTL_S for s in idle[1:])
    assert expired(wl) == (False, True, True, True)
    assert expired(wl, ttl_s=10_000) == (False,) * 4
    fixed = idle_gap(turns=4, fixed=True)
    assert len(fixed.params["idle_s"]) == len(fixed) and expired(fixed) == (False,) * len(fixed)
    steps = [r for r in fixed if r.name.startswith("step-")]
    assert steps == list(wl.requests)
    for i, r in enumerate(fixed):
        if r.name.startswith("keepalive-"):
            assert r.messages == fixed[i - 1].messages and r.max_tokens == 1
    # total idle time is kept: the pings split each gap, they do not shorten it
    assert sum(fixed.params["idle_s"]) == pytest.approx(sum(idle))
    with pytest.raises(RequestError, match="ttl_s"):
        idle_gap(ttl_s=0)


def test_structural_change_kinds_and_errors():
    # mutant: an appended message reported as a change, or a dropped one missed
    sys_, u, a = ({"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                  {"role": "assistant", "content": "A"})
    r = lambda *m, tools=None: Request(messages=m, tools=tools)  # noqa: E731
    assert structural_change(r(sys_, u), r(sys_, u, a, u)).type is None
    dropped = structural_change(r(sys_, u, a), r(sys_, u))
    assert repr(dropped) == "StructuralChange(messages_changed at message 2)"
    assert dropped.detail == "message 2 (assistant) was dropped"
    assert structural_change(r(u), r(sys_, u)) == StructuralChange("system_changed", 0,
                                                                   "system message 0 differs")
    t1, t2 = {"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}
    reordered = structural_change(r(u, tools=(t1, t2)), r(u, tools=(t2, t1)))
    assert reordered.detail == "the same tools in another order"
    assert structural_change(r(u, tools=(t1,)), r(u, tools=(t2,))).detail == "the tool definitions differ"
    with pytest.raises(RequestError, match="kv.diverge"):
        structural_change(Request(ids=(1, 2)), r(u))


def test_request_tools_field():
    # mutant: digest ignores tools (a reordered tool list would look like the same request),
    # or always adds a tools key (every existing request digest changes)
    t1, t2 = {"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}
    msgs = ({"role": "user", "content": "Hi"},)
    plain = Request(messages=msgs, max_tokens=8, name="r")
    body = {"messages": plain.messages, "ids": None, "extra_keys": (), "salt": None, "max_tokens": 8,
            "name": "r"}
    assert plain.digest() == hashlib.sha256(canonical_json(body).encode()).hexdigest()
    a, b = Request(messages=msgs, tools=[t1, t2]), Request(messages=msgs, tools=[t2, t1])
    assert a != b and a == Request(messages=msgs, tools=(t1, t2)) and a.tools == (t1, t2)
    assert a.template_kwargs == {"tools": [t1, t2]} and plain.template_kwargs == {}
    assert repr(a) == "Request('' messages=1 tools=2 max_tokens=128)"
    with pytest.raises(RequestError, match="chat request"):
        Request(ids=(1, 2), tools=(t1,))
    with pytest.raises(RequestError, match="tool-schema dicts"):
        Request(messages=msgs, tools=t1)


def test_reprs_and_html():
    # mutant: a public object without _repr_html_, or html that does not escape
    cause = CAUSES["timestamp"]
    assert repr(cause) == ("Cause(timestamp: system_changed; Fix(server: keep the date, drop the time "
                           "of day rules=['timestamp_to_date']))")
    assert "<b>Cause</b> timestamp" in cause._repr_html_()
    assert "&lt;think&gt;" in CAUSES["thinking_dropped"]._repr_html_()
    assert "<b>Fix</b> client" in CAUSES["idle_gap"].fix._repr_html_()
    assert repr(CAUSES["idle_gap"]).startswith("Cause(idle_gap: no structural change;")
    assert "no structural change" in StructuralChange(None)._repr_html_()
    assert "message 3" in StructuralChange(MSGS, 3)._repr_html_()
    loop = agent_traffic.agent_loop(turns=2)
    assert repr(loop) == "AgentLoop(2 steps, 4 tools, seed=0)"
    name = loop.steps[0][0]["tool_calls"][0]["function"]["name"]
    assert f"<td>1</td><td>{name}</td>" in loop._repr_html_()


@pytest.mark.parametrize("module", [agent_causes, agent_conversation, agent_traffic])
def test_docstring_examples(module):
    # mutant: an Example whose output the code no longer gives
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(module, globs={"kv": kv, **vars(module)}) if t.examples]
    assert len(tests) >= 2
    for t in tests:
        runner.run(t)
    assert runner.summarize(verbose=False).failed == 0
