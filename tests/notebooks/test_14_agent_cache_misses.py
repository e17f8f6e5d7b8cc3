"""notebooks/14_agent_cache_misses under papermill: every agent cause through kv.proxy in front of
kvlab serve (and, for two causes, plain mlx_lm.server), before and after its fix. On kvlab serve
every fix but idle_gap's and compaction's raises the hit rate and lowers the tokens prefilled;
compaction's fix (keep the history) raises the reused and the prefilled tokens, and the finding
says so with the figures; the proxy diagnoses the first request that changes
with the cause's expected type; idle_gap is unchanged by its fix (no TTL here); mlx_lm.server gets
no after run for a server-side fix; and the finding quotes the table's figures.

Mutants this catches: the normalisation rules not passed to kvlab serve (billing_header,
timestamp and rolling_breakpoint stay flat), the client-side fix not applied (the other causes
stay flat), a server-side fix "applied" on mlx_lm.server, a typed or stale finding."""

from __future__ import annotations

import polars as pl
import pytest
from notebook_helpers import execute, finding

from kvlab.workloads import CAUSES

NAME = "14_agent_cache_misses"
TURNS = 4
SIZES = {"system_tokens": 60, "tools": 2, "result_tokens": 80, "think_tokens": 24, "max_tokens": 4}
MLX = ["billing_header", "tools_reordered"]  # one server-side and one client-side fix (~5 s a run)


def warm(df, cause, path, phase):
    return df.filter((pl.col("cause") == cause) & (pl.col("path") == path) & (pl.col("phase") == phase)
                     & (pl.col("turn") > 1))


def rate(df, cause, path, phase):
    part = warm(df, cause, path, phase)
    return part["reused_tokens"].sum() / part["prompt_tokens"].sum() if part.height else None


def tokens(df, cause, phase):
    """(reused, prefilled) tokens on kvlab serve over turns 2..N."""
    part = warm(df, cause, "kvlab serve", phase)
    return part["reused_tokens"].sum(), (part["prompt_tokens"] - part["reused_tokens"]).sum()


@pytest.mark.notebook
@pytest.mark.model
def test_14_agent_cache_misses(tmp_path):
    df, nb = execute(NAME, tmp_path, turns=TURNS, sizes=SIZES, mlx_lm_causes=MLX)
    assert df.columns == ["cause", "path", "phase", "request", "turn", "prompt_tokens", "reused_tokens",
                          "hit_rate", "diagnosed_type", "expected_type", "diverged_at", "fix_side", "detail"]
    runs = sorted(set(zip(df["cause"], df["path"], df["phase"])))
    expected_runs = [(c, "kvlab serve", p) for c in CAUSES for p in ("before", "after")]
    expected_runs += [(c, "mlx_lm.server", "before") for c in MLX]
    expected_runs += [(c, "mlx_lm.server", "after") for c in MLX if CAUSES[c].fix.side == "client"]
    assert runs == sorted(expected_runs)
    steps = df.filter(pl.col("turn").is_not_null())
    assert (steps.group_by("cause", "path", "phase").len()["len"] == TURNS).all()
    assert (steps.filter(pl.col("turn") == 1)["reused_tokens"] == 0).all()  # a fresh server per run
    assert (df["reused_tokens"] <= df["prompt_tokens"]).all()

    for name, cause in CAUSES.items():
        before, after = rate(df, name, "kvlab serve", "before"), rate(df, name, "kvlab serve", "after")
        if name == "idle_gap":  # no time-to-live here: the keep-alive fix changes nothing on the steps
            kv_steps = steps.filter((pl.col("cause") == name) & (pl.col("path") == "kvlab serve"))
            per_phase = [kv_steps.filter(pl.col("phase") == p).sort("turn")["reused_tokens"].to_list()
                         for p in ("before", "after")]
            assert per_phase[0] == per_phase[1] and before == after
            assert df.filter(pl.col("cause") == name)["diagnosed_type"].null_count() == \
                df.filter(pl.col("cause") == name).height
            continue
        (reused_before, prefilled_before), (reused_after, prefilled_after) = (tokens(df, name, p)
                                                                             for p in ("before", "after"))
        assert reused_after > reused_before, (name, reused_before, reused_after)
        if name == "compaction":  # the fix keeps the history: more reuse, and more to prefill (a trade)
            assert prefilled_after > prefilled_before
            compaction = (reused_before, prefilled_before, reused_after, prefilled_after)
        else:
            assert after > before and prefilled_after < prefilled_before, (name, before, after)
        # the first request whose structure changes is diagnosed with the expected type, on every run
        first = next(i for i, c in enumerate(cause.diagnose(cause.generate(turns=TURNS, **SIZES))) if c.type)
        hit = df.filter((pl.col("cause") == name) & (pl.col("phase") == "before") & (pl.col("turn") == first + 2))
        assert hit["diagnosed_type"].to_list() == [cause.expected] * hit.height and hit.height >= 1
        assert hit["diverged_at"].is_not_null().all()
        assert (hit["reused_tokens"] <= hit["diverged_at"]).all()  # nothing past the divergence is reused

    mlx = {c: (rate(df, c, "mlx_lm.server", "before"), rate(df, c, "mlx_lm.server", "after")) for c in MLX}
    assert mlx["tools_reordered"][1] > mlx["tools_reordered"][0]
    assert mlx["billing_header"][1] is None and mlx["billing_header"][0] < 0.2

    text = finding(nb)
    gains = [g for g in sorted(((rate(df, c, "kvlab serve", "after") - rate(df, c, "kvlab serve", "before"), c)
                                for c in CAUSES), reverse=True)[:3] if g[0] > 0]
    best = "; ".join(f"{c} {rate(df, c, 'kvlab serve', 'before'):.1%} -> {rate(df, c, 'kvlab serve', 'after'):.1%}"
                     for _, c in gains)
    # the verdict first, recomputed from the table (mutants: the count taken over every cause, not the
    # ones whose rate rose; the top three sorted ascending)
    raised = [c for c in CAUSES if rate(df, c, "kvlab serve", "after") > rate(df, c, "kvlab serve", "before")]
    # every fix but idle_gap's (no time-to-live here) and compaction's (more reused, but longer prompts)
    assert sorted(set(CAUSES) - set(raised)) == ["compaction", "idle_gap"]
    raised = len(raised)
    assert text.startswith(f"**The fix raised the warm hit rate on kvlab serve for {raised} of {len(CAUSES)} causes**, "
                           f"most for {best}; the proxy's diagnosis named the expected type for all {len(CAUSES)}.")
    rb, pb, ra, pa = compaction
    assert f" compaction: the fix reuses {ra} tokens instead of {rb} but prefills {pa} instead of {pb} (" in text
    b, a = mlx["tools_reordered"]
    assert f"On mlx_lm.server, before -> after a client-side fix: tools_reordered {b:.1%} -> {a:.1%}." in text
    assert (f"mlx_lm.server has no normalisation, so billing_header (stuck at {mlx['billing_header'][0]:.1%})"
            in text)
    idle = rate(df, "idle_gap", "kvlab serve", "before")
    assert (f"idle_gap: the prompt is unchanged, the diagnosis says no structural change; expiry is a "
            f"server-side time-to-live that these local servers do not have, so its hit rate is {idle:.1%} "
            f"before and {idle:.1%} after") in text

    # the hit-rate figure's axis fits the data and its title names the run (mutant: range [0, 100]
    # over data that tops at 89%)
    fig = next(o.data["application/vnd.plotly.v1+json"]["layout"] for c in nb.cells if c.cell_type == "code"
               and "hit_rate_figure()" in c.source for o in c.outputs
               if "application/vnd.plotly.v1+json" in o.get("data", {}))
    top = df.filter(pl.col("turn").is_not_null())["hit_rate"].max() * 100
    assert fig["yaxis"]["range"] == [0, pytest.approx(min(100, top * 1.08 + 2))]
    assert fig["title"]["text"].endswith(f"on tiny, before and after each fix: {len(CAUSES)} causes, {TURNS} turns each")
