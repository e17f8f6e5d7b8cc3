"""The dominant miss on the tiny model: agentic_loop through an Engine with a paged store loses
most tokens at the billing header's cch= value, and every surface (the run, the Inspector's
requests tab, the `kvlab workload` report; the magic in test_magics.py) says where, what differs
and that --normalise fixes it. All counts are exact: the workload and the model are seeded."""

from __future__ import annotations

import dataclasses

import pytest

import kvlab as kv
from kvlab.diagnostics import dominant_miss, request_why
from kvlab.experiments.workload_run import run_workload

pytestmark = pytest.mark.model

RUN = dict(store="paged", turns=3, max_tokens=2)


@pytest.fixture(scope="module")
def broken(tiny):
    return run_workload(tiny, "agentic_loop", **RUN)


@pytest.fixture(scope="module")
def fixed(tiny):
    return run_workload(tiny, "agentic_loop", normalise=True, **RUN)


def test_the_run_names_the_place_the_field_and_the_fix(broken):
    s, d = broken.stats, broken.dominant_miss
    assert (s["reused_tokens"], s["prompt_tokens"]) == (64, 3143)
    # mutant: key the place by diverged_at alone (34 vs 35 split the group, share < 50%: None)
    assert (d.token_index, d.message_index, d.role, d.field) == (34, 0, "system", "cch")
    assert (d.previous, d.current) == ("debcc", "d6cbe")
    # mutant: rule matching that never applies the rule (rule None) / applies it to the wrong message
    assert d.rule == "billing_header"
    assert (d.requests, d.tokens, d.missed, d.reused) == ((2, 3), 2192, 3079, 32)
    assert d.sentence("cli") == (
        "2,192 of 3,079 missed tokens (71.2%) diverge at token 34 in message 0 (system), so each "
        "reused at most 32: the volatile field cch= changes per request ('debcc' -> 'd6cbe'). Fix: "
        "rule billing_header: kvlab workload ... --normalise (api: kv.normalise(messages) before "
        "engine.run; server: kvlab serve --normalise).")
    assert "%kvlab run ... --normalise" in d.sentence()
    assert "Dominant miss" in d._repr_html_() and "cch" in d._repr_html_()
    assert "dominant miss at token 34" in repr(broken) and "Dominant miss" in broken._repr_html_()


def test_the_fix_removes_the_sentence_and_raises_the_hits(fixed):
    # mutant: --normalise not applied (reused stays 64 and the dominant miss stays)
    assert fixed.dominant_miss is None
    assert (fixed.stats["reused_tokens"], fixed.stats["prompt_tokens"]) == (1840, 3034)
    assert not any(line.startswith("why:") for line in fixed.lines())


def test_ids_alone_give_the_same_place(broken, tiny):
    # no rendered prompts: message spans recovered from the ids' ChatML markers
    assert dominant_miss(broken.results, tokenizer=tiny.tokenizer) == broken.dominant_miss


def test_below_half_of_the_missed_tokens_there_is_no_dominant_miss(broken):
    # mutant: the share test dropped or `missed` counting only diverged tokens (never None)
    tok = broken.engine.model.tokenizer
    first, second = broken.results[:2]  # 1008 diverged of 877 + 1016 missed: 53.2%, dominant
    d = dominant_miss([first, second], tokenizer=tok)
    assert (d.tokens, d.missed) == (1008, 1893)
    # a first request that missed 1,000 more tokens: 1008 of 2893 (34.8%), no dominant place
    bigger = dataclasses.replace(first, prompt_tokens=first.prompt_tokens + 1000)
    assert dominant_miss([bigger, second], tokenizer=tok) is None
    assert dominant_miss([first], tokenizer=tok) is None


def test_each_request_says_why(broken):
    # mutant: request_why returning the engine's (empty) `why`: the Inspector's column stays blank
    assert [request_why(r) for r in broken.results] == [
        "first_seen 864; no blocks cached yet", "diverged 1008 at token 34", "diverged 1184 at token 35"]
    assert "diverged from what is cached at token 34" in broken.results[1]._repr_html_()


def test_the_inspector_requests_tab_fills_why(broken):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    ins = kv.Inspector(broken.engine)
    table = ins.table.value
    # mutant: table_rows back to `r.why or ""` (requests 2 and 3 had an empty why)
    for why in ("diverged 1008 at token 34", "diverged 1184 at token 35"):
        assert f">{why}</td>" in table
    # mutant: the Inspector without the run's cause (only per-request reasons): no "Why:" line
    assert ("<p class='kv-cause' style='margin:4px 0'>Why: 2,192 of 3,079 missed tokens (71.2%) diverge at "
            "token 34 in message 0 (system)") in table
    assert "Fix: rule billing_header: kv.normalise(messages) before engine.run" in table


def test_the_cli_report(capsys):
    from kvlab.cli import main

    assert main(["workload", "agentic_loop", "--model", "tiny", "--store", "paged", "--turns", "3",
                 "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[3] == "#3: reused 32/1218 · diverged 1184 at token 35"
    assert out[4] == "token hit rate 2.0% (64/3143 tokens) · request hit rate 66.7%"
    assert out[5].startswith("why: 2,192 of 3,079 missed tokens (71.2%) diverge at token 34 in message 0 "
                             "(system)") and "kvlab workload ... --normalise" in out[5]
