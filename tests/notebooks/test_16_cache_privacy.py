"""16_cache_privacy under papermill with its defaults: attacks A (PIN through cached_tokens), B
(timing among K candidates) and C (diagnostics) against mlx_lm.server, kvlab serve and kvlab serve
with tenants; block granularity, padding, jitter and the tenant salt as defences; the salt's hit-rate
cost computed by the simulator and measured on the server.

Only what does not depend on the machine is asserted: attack A and C (metadata: exact counts),
the audit statistic where nothing is shared (D+ below the critical value whatever the load) or
where padding makes every time equal (D+ = 0), and the server's hit rates against the simulator's
(equal exactly). Attack B and the unsalted audit are timing: reported, never asserted.

Mutants caught (each checked by breaking the code): the adapter keying requests without their
tenant's salt (A recovers the PIN across tenants); the diagnostics log unscoped (C reads the note
across tenants); the public prefix's salt starting at the wrong token (server and simulator
disagree); the finding typed instead of computed (its numbers no longer match the table)."""

from __future__ import annotations

import polars as pl
import pytest
from notebook_helpers import execute, finding

pytestmark = [pytest.mark.notebook, pytest.mark.serving]

PIN = "482913"


def test_16_cache_privacy(tmp_path):
    df, nb = execute("16_cache_privacy", tmp_path)
    att = {(r["target"], r["item"][0]): r for r in df.filter(pl.col("section") == "attack").iter_rows(named=True)}

    # A, metadata: the whole PIN within 60 queries where the cache is shared, nothing across tenants
    for target in ("mlx_lm.server", "kvlab serve"):
        a = att[(target, "A")]
        assert a["recovered"] == PIN and a["score"] == 6 and a["queries"] <= 60, target
    assert att[("kvlab serve, tenants", "A")]["score"] == 0 and att[("kvlab serve, tenants", "A")]["queries"] <= 60
    # block granularity: the first digit's guesses never complete a 16-token block
    paged = df.filter(pl.col("target") == "kvlab serve, paged").row(0, named=True)
    assert paged["score"] == 0 and paged["queries"] == 10

    # C, diagnostics: 40 characters of the note (issue 33's finding) on one tenant, none across two
    c = att[("kvlab serve", "C")]
    assert c["score"] == len(c["recovered"]) >= 30 and c["recovered"].strip().startswith(PIN)
    assert att[("kvlab serve, tenants", "C")]["score"] == 0 and att[("kvlab serve, tenants", "C")]["recovered"] == ""
    assert ("mlx_lm.server", "C") not in att
    assert all(att[(t, "B")]["queries"] == 15 for t in ("mlx_lm.server", "kvlab serve", "kvlab serve, tenants"))

    # timing: the salt leaves no gap to find, padding to a constant leaves none either
    tim = {r["item"]: r for r in df.filter(pl.col("section") == "timing").iter_rows(named=True)}
    assert not tim["tenant salt"]["success"] and tim["tenant salt"]["p"] > 1e-8
    assert tim["pad TTFT to the slowest"]["ks_d"] == 0.0 and tim["pad TTFT to the slowest"]["added_ms"] > 0

    # the salt's cost: the server measures exactly what the simulator computes, mode by mode
    cost = df.filter(pl.col("section") == "tenant_cost")

    def rate(target, mode, tenants):
        return cost.filter((pl.col("target") == target) & (pl.col("item") == mode)
                           & (pl.col("tenants") == tenants))["hit_rate"].item()

    for mode in ("shared", "salted", "public"):
        assert rate("kvlab serve, paged", mode, 4) == rate("simulator", mode, 4), mode
    assert rate("simulator", "shared", 1) == rate("simulator", "salted", 1) == rate("simulator", "public", 1)
    for t in (2, 4, 8):
        assert rate("simulator", "salted", t) < rate("simulator", "public", t) <= rate("simulator", "shared", t)
    assert rate("simulator", "shared", 8) > rate("simulator", "shared", 2)  # more requests share the prompt

    # the finding is computed from the table
    text = finding(nb)
    for target in ("mlx_lm.server", "kvlab serve", "kvlab serve, tenants"):
        a = att[(target, "A")]
        assert f"{target}: A {a['score']} of 6 digits in {a['queries']} queries" in text
    assert f"C {c['score']} characters of the victim's prompt" in text
    assert "exactly the simulator" in text and text.startswith("**Turn on tenants")
    assert f"{rate('simulator', 'salted', 8):.1%} salted" in text
    back = ((rate("simulator", "public", 8) - rate("simulator", "salted", 8))
            / (rate("simulator", "shared", 8) - rate("simulator", "salted", 8)))
    assert f"wins back {back:.0%} of the hit rate" in text

    figs = [o.data["application/vnd.plotly.v1+json"]["layout"] for cell in nb.cells if cell.cell_type == "code"
            for o in cell.outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(figs) == 1
    assert figs[0]["yaxis"]["title"]["text"] == "prompt tokens reused (%)"
    assert figs[0]["xaxis"]["title"]["text"] == "tenants sharing the server"
