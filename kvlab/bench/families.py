"""Bench sections for the cache families (issue 18's targets), each on kvlab's tiny random-weight
model of a family (``kv.load("tiny:<model_type>")``), whatever ``--model`` names:

- ``conformance``: every family x every store on the branching workload, exact / refused / wrong /
  silent zero, each refusal with its reason;
- ``checkpoint_policies``: ``cost_aware`` (and mlx-lm's ``segment_ends``) against the offline optimum
  at equal bytes on agentic_loop and branching, on tiny:qwen3_5.

The timed sections (hybrid TTFT, sliding-window bytes) are in ``kvlab.bench.families_cache``.

Example:
    >>> tables = kv.bench.run("tiny", repeats=1, only=["checkpoint_policies"])
    >>> tables[0].values["workloads"]["branching"]["cost_aware"]["reused_tokens"]  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

from ..primitives.display import summary_html
from .settings import Settings
from .table import Table

HYBRID = "qwen3_5"
POLICY_WORKLOADS = ("agentic_loop", "branching")
COMPARED = ("segment_ends", "cost_aware")


@dataclass(frozen=True)
class Section:
    """A bench section that is not a module of its own: what ``kvlab.bench.REGISTRY`` reads."""

    NEEDS_MODEL: bool
    table: Callable[[Settings], Table]

    def __repr__(self) -> str:
        return f"Section({self.table.__name__})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def bench_conformance(model_types=None, stores=None, workload: str = "branching") -> Table:
    """Every family x store cell on one workload: one row per model type, one column per store (its
    status and reused tokens), every cell that did not reuse exactly listed with its reason.

    Example:
        >>> bench_conformance(["qwen3"], ["radix"]).values["counts"]["exact"]
        1
    """
    from ..experiments import conformance as c
    from ..models.families import FAMILY_OF

    model_types = list(model_types or c.MODEL_TYPES)
    stores = list(stores or c.STORES)
    cells = []
    for model_type in model_types:
        for store in stores:
            try:
                cells.append(asdict(c.run_cell(model_type, store, workload)))
            except Exception as e:  # noqa: BLE001 - a cell that crashes is a result to report, not the end of the run
                cells.append({"model_type": model_type, "family": FAMILY_OF[model_type], "store": store,
                              "status": "error", "reused_tokens": 0, "reason": f"raised {type(e).__name__}: {e}"})
    counts = {s: sum(x["status"] == s for x in cells) for s in (*c.STATUSES, "error")}
    rows = []
    for model_type in model_types:
        mine = {x["store"]: x for x in cells if x["model_type"] == model_type}
        rows.append((model_type, mine[stores[0]]["family"],
                     *(f"{mine[s]['status']} ({mine[s]['reused_tokens']})" for s in stores)))
    missed = [x for x in cells if x["status"] != "exact"]
    notes = (f"Cells: {', '.join(f'{n} {s}' for s, n in counts.items())} (of {len(cells)}); in brackets the "
             f"tokens reused over the workload. exact: reused with max logit diff <= {c.TOLERANCE:g} against "
             "a cold prefill; refused: reused nothing, with a reason naming the layer; wrong: logits moved "
             "beyond the tolerance; silent zero: reused nothing, no reason; error: the cell raised (the "
             "exception is its reason). Target: every cell exact.")
    if missed:
        notes += " Cells that did not reuse exactly:\n\n" + "\n".join(
            f"- {x['model_type']} x {x['store']}: {x['status']}: {x['reason'] or 'no reason given'}"
            for x in missed)
    return Table(f"conformance: {len(model_types)} cache families x {len(stores)} stores on the {workload} "
                 "workload", f"kvlab bench --only conformance  (cells: kvlab conformance --workloads {workload})",
                 ("model type", "family", *stores), tuple(rows), notes,
                 values={"counts": counts, "cells": len(cells), "workload": workload,
                         "not_exact": [{k: x[k] for k in ("model_type", "store", "status", "reason")}
                                       for x in missed]})


def bench_checkpoint_policies(model_type: str = HYBRID, workloads=POLICY_WORKLOADS, policies=COMPARED) -> Table:
    """Reused tokens of each policy beside the offline optimum's at the bytes that policy held, per
    workload (``kvlab.experiments.checkpoint_study``), verified against cold prefill.

    Example:
        >>> bench_checkpoint_policies(workloads=["branching"]).columns[:2]
        ('workload', 'policy')
    """
    from ..experiments.checkpoint_study import run_study
    from ..models.loading import load

    model = load(f"tiny:{model_type}")
    rows, per = [], {}
    for workload in workloads:
        study = run_study(model, workload, policies=policies)
        per[workload] = {}
        for r in study.frame.to_dicts():
            best = r["optimal_reused_at_bytes"]
            ratio = r["reused_tokens"] / best if best else 1.0
            per[workload][r["policy"]] = {**r, "of_optimal": ratio}
            rows.append((workload, r["policy"], r["reused_tokens"], r["bytes_held"], r["checkpoints"], best,
                         f"{ratio:.3f}", f"{r['max_logit_diff']:.1e}"))
    return Table(f"checkpoint policies against the optimum at equal bytes, tiny:{model_type}",
                 f"kvlab bench --only checkpoint_policies  (per workload: kvlab checkpoints --model "
                 f"tiny:{model_type} --workload W)",
                 ("workload", "policy", "reused tokens", "bytes held", "checkpoints",
                  "optimal reused at these bytes", "of optimal", "max logit diff"), tuple(rows),
                 "optimal: the offline optimum's plan (kvlab.checkpoints.plan_optimal) at the bytes the policy "
                 "held; its own row runs that plan at cost_aware's bytes through the same Engine, verified. "
                 "Reuse counts tokens, so one run suffices (no timing). Target: cost_aware >= 0.90 of optimal "
                 "on every workload.",
                 values={"model": f"tiny:{model_type}", "workloads": per})


def _conformance(s: Settings) -> Table:
    return bench_conformance()


def _checkpoint_policies(s: Settings) -> Table:
    return bench_checkpoint_policies()


conformance = Section(False, _conformance)
checkpoint_policies = Section(False, _checkpoint_policies)
