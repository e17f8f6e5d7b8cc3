"""The agent causes on a real tokenizer and the Engine (issue 19 §3): each cause's rendered prompts
diverge where its structural diagnosis says, inside the previous prompt (a real miss), and its fix
makes every prompt a prefix of the next; an Engine with a RadixStore reuses fewer tokens per turn
before the fix than after, exactly as many as the longest common prefix with an earlier prompt.

Each test names the mutant it catches in a comment."""

from __future__ import annotations

import pytest

import kvlab as kv
from kvlab.workloads import CAUSES
from kvlab.workloads.agent_traffic import expired

pytestmark = pytest.mark.model

SIZES = dict(system_tokens=60, result_tokens=30, tools=2, think_tokens=16, max_tokens=1)
# reused tokens per turn on the tiny model (Qwen3 tokenizer and template), before and after the fix
REUSED = {
    "billing_header": ([0, 36, 35, 35], [0, 402, 479, 570]),
    "timestamp": ([0, 42, 40, 40], [0, 514, 591, 682]),
    "tools_reordered": ([0, 129, 499, 576], [0, 499, 576, 667]),
    "thinking_dropped": ([0, 499, 499, 576], [0, 499, 607, 722]),
    "live_state": ([0, 28, 33, 40], [0, 518, 618, 739]),
    "moving_reminder": ([0, 493, 569, 660], [0, 522, 622, 736]),
    "micro_compaction": ([0, 499, 576, 531], [0, 499, 576, 667]),
    "compaction": ([0, 499, 437, 495], [0, 499, 576, 725]),
    "rolling_breakpoint": ([0, 493, 499, 570], [0, 499, 576, 667]),
    "idle_gap": ([0, 499, 576, 667], [0, 498, 498, 499, 575, 575, 576, 666, 666, 667]),
}


def rendered(model, workload):
    # tools passed by hand, not through Request.template_kwargs, so the Engine's path is checked
    return [kv.tokenise(model, list(r.messages), **({"tools": list(r.tools)} if r.tools else {}))
            for r in workload]


@pytest.mark.parametrize("name", list(CAUSES))
def test_divergence_lands_where_the_diagnosis_says(tiny, name):
    # mutants: a generator whose change never reaches the rendered prompt (tools ignored by the
    # template call), or lands after the previous prompt's end (no real miss); a diagnosis whose
    # message index is not where the tokens split
    cause = CAUSES[name]
    wl = cause.generate(turns=4)
    toks = rendered(tiny, wl)
    for k, change in enumerate(cause.diagnose(wl)):
        d = kv.diverge(toks[k], toks[k + 1])
        if change.type is None:
            assert d.token_index is None and d.is_prefix, (name, k, d)
            continue
        assert d.token_index is not None and d.token_index < len(toks[k]) - 1, (name, k, d)
        # the template renders the tools inside the system turn
        index = 0 if change.type == "tools_changed" else change.message_index
        assert (d.message_index, d.role) == (index, wl[k].messages[index]["role"]), (name, k, d)


@pytest.mark.parametrize("name", list(CAUSES))
def test_fix_makes_each_prompt_a_prefix_of_the_next(tiny, name):
    # mutant: a fix that leaves a trace behind (the breakpoint rule keeping the newline before
    # the mark, tools sorted in one request but not the next, thinking kept in only some turns)
    toks = rendered(tiny, CAUSES[name].fixed(turns=4))
    for k in range(len(toks) - 1):
        d = kv.diverge(toks[k], toks[k + 1])
        assert d.token_index is None and d.len_a <= d.len_b, (name, k, d)


def test_the_engine_renders_request_tools(tiny):
    # mutant: Engine.tokens_of drops Request.tools (tool order then never reaches the prompt)
    r = CAUSES["tools_reordered"].generate(turns=2, **SIZES)[1]
    engine = kv.Engine(tiny, kv.RadixStore())
    toks = engine.tokens_of(r)[0]
    assert toks.ids == kv.tokenise(tiny, list(r.messages), tools=list(r.tools)).ids
    assert toks.ids != kv.tokenise(tiny, list(r.messages)).ids
    assert r.tools[0]["function"]["name"] in toks.text[: toks.spans[0].char_end]
    assert engine.key_of(r).ids == toks.ids
    # and Workload.token_ids (what trace export uses) renders them too
    wl = CAUSES["tools_reordered"].generate(turns=2, **SIZES)
    assert wl.token_ids(tiny) == [t.ids for t in rendered(tiny, wl)]


def reuse(model, workload):
    engine = kv.Engine(model, kv.RadixStore())
    results = [engine.run(r) for r in workload]
    return [r.reused_tokens for r in results], engine.stats()["token_hit_rate"], results


def longest_prefix(toks):
    """What a radix cache over every earlier prompt can restore: the longest common prefix with
    one of them, never the last token (it is always recomputed)."""
    out = []
    for k, t in enumerate(toks):
        best = max((kv.diverge(p, t).common for p in toks[:k]), default=0)
        out.append(min(best, len(t) - 1))
    return out


@pytest.mark.parametrize("name", list(CAUSES))
def test_engine_reuses_more_after_the_fix(tiny, name):
    # mutants: the engine ignoring tools (tools_reordered reuses as much before as after and
    # the counts differ from REUSED); a fix that does not recover (hit rate not higher);
    # a store restoring past the divergence (reused above the longest common prefix)
    cause = CAUSES[name]
    before, after = cause.generate(turns=4, **SIZES), cause.fixed(turns=4, **SIZES)
    (got_before, rate_before, res_b), (got_after, rate_after, res_a) = reuse(tiny, before), reuse(tiny, after)
    assert (got_before, got_after) == REUSED[name]
    assert got_before == longest_prefix(rendered(tiny, before))
    assert got_after == longest_prefix(rendered(tiny, after))
    assert [r.prompt_ids for r in res_b] == [t.ids for t in rendered(tiny, before)]
    if name == "idle_gap":
        # nothing structural changed: the engine (no time-to-live) reuses the same per step,
        # and only the expiry replay tells the two apart
        steps = [n for r, n in zip(after, got_after) if r.name.startswith("step-")]
        assert steps == got_before
        assert expired(before) == (False, True, True, True) and not any(expired(after))
    else:
        assert rate_before < rate_after
        assert all(a >= b for a, b in zip(got_after, got_before))
