"""`kvlab demo` (kvlab/demo.py): its first section shows a saving you can see, a shared prefix of
several hundred tokens that the cached requests do not prefill again. Token counts are asserted,
never timings (those are measured and printed, and belong to benchmarks)."""

from __future__ import annotations

import re

import pytest

from kvlab.experiments import demo

LOGIT_TOL = 1e-3  # cached vs cold float32 logits on the tiny model


@pytest.mark.model
def test_shared_prefix_report_reuses_several_hundred_tokens(tiny):
    rows = demo.shared_prefix_report(tiny, max_tokens=4)
    assert [(r["request"], r["who"]) for r in rows] == [(1, "user A"), (2, "user A"), (3, "user B")]
    shared = rows[0]["system_prompt_tokens"]
    assert shared >= 300
    first, follow_up, other_user = rows
    assert first["reused_tokens"] == 0 and first["prefilled_tokens"] == first["prompt_tokens"]
    assert first["cold_ttft_ms"] is None  # a miss is its own cold baseline
    for r in (follow_up, other_user):
        assert r["cold_prefilled_tokens"] == r["prompt_tokens"]  # the baseline prefills everything
        assert shared <= r["reused_tokens"] < r["prompt_tokens"]
        assert r["prefilled_tokens"] == r["prompt_tokens"] - r["reused_tokens"]
        assert r["prefilled_tokens"] * 10 < r["cold_prefilled_tokens"]
        assert r["verify_max_abs_logit_diff"] < LOGIT_TOL
    # the follow-up continues user A's conversation: it reuses more than the system prompt
    assert follow_up["reused_tokens"] > shared


@pytest.mark.notebook
def test_demo_runs_and_its_first_screen_reports_the_saving(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the notebook runs land in ./runs
    assert demo.main("tiny") == 0
    out = capsys.readouterr().out
    first_screen = out.splitlines()[:12]
    assert any(line.startswith("1. A shared system prompt of ") for line in first_screen), out
    m = re.search(r"requests that hit: (\d+) of (\d+) prompt tokens reused; median time to first token "
                  r"(\d+) ms cached vs (\d+) ms cold \((\d+\.\d)x faster\)", out)
    assert m, out
    reused, total = int(m.group(1)), int(m.group(2))
    assert reused >= 600 and reused > 0.8 * total  # two requests, each reusing several hundred tokens
    assert "00_quickstart.ipynb: ok" in out and "02_agentic_billing_header.ipynb: ok" in out
