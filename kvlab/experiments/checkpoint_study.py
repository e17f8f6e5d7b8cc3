"""Checkpoint policies compared on the same traffic, exactly: one workload run per policy through
``kv.Engine(verify=True)``, measured in tokens reused, bytes held and prefill seconds saved, beside
the offline optimum at the same bytes.

What is measured, per policy:

- the store keeps **only the policy's checkpoints** (``CheckpointStore``: the Engine's final insert of
  the whole prompt is dropped), so reuse and bytes are the policy's alone and ``none`` reuses 0;
- ``reused_tokens``: summed over requests; ``reachable_tokens``: what checkpointing every prefix a
  later request shares would give (``kvlab.checkpoints.reachable``);
- ``bytes_held``: the bytes the store holds at the end (state bytes of every checkpoint kept; with
  ``budget`` the store evicts least-recently-used checkpoints beyond it); ``checkpoints``: how many;
- ``max_logit_diff``: the largest difference from a cold prefill over every request (verified);
- ``prefill_s_saved``: ``cost.predict(0, n) - cost.predict(reused, n - reused)`` summed, from the
  cost model (``kv.cost``); ``ttft_s``: measured, summed;
- ``optimal_reused_at_bytes``: the offline optimum's plan at this row's ``bytes_held``;
  ``gap_to_optimal`` its difference from ``reused_tokens``; ``where_lost``: the request that lost
  most against ``reachable`` and its miss reason.

The ``optimal`` row runs the plan for ``budget``, or (no budget) for the bytes the ``optimal_for``
policy held, through the same Engine, verified like the others.

Example:
    >>> study = run_study(kv.load("tiny:qwen3_5"), "branching")
    >>> study.frame.select("policy", "reused_tokens", "bytes_held", "gap_to_optimal")
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import polars as pl

from ..checkpoints import (CostAware, NominalCost, Sightings, StateBytes, parse_policy, plan_optimal,
                           reachable)
from ..engine import Engine
from ..errors import KvlabError
from ..primitives.display import summary_html, table_html
from ..request import Workload
from ..stores.radix import RadixStore
from .conformance import WORKLOADS

POLICY_SPECS = ("none", "segment_ends", "message_ends", "last_message", "tail:11", "every:64",
                "log_spaced", "cost_aware")
COLUMNS = ("policy", "reused_tokens", "prompt_tokens", "reachable_tokens", "bytes_held", "checkpoints",
           "max_logit_diff", "prefill_s_saved", "ttft_s", "optimal_reused_at_bytes", "gap_to_optimal",
           "where_lost")


class CheckpointStore(RadixStore):
    """A radix store that keeps checkpoints only (the final insert of a prompt is dropped), so what
    it holds and serves is what a checkpoint policy chose."""

    def insert(self, key, tokens, snap, *, kind: str = "prompt") -> None:
        if kind == "checkpoint":
            super().insert(key, tokens, snap, kind=kind)


@dataclass(frozen=True, eq=False)
class Study:
    """One workload per policy on one model: ``frame`` one row per policy (``COLUMNS``),
    ``requests`` one row per policy and request, ``state_bytes`` what a checkpoint holds."""

    model: str
    workload: str
    frame: pl.DataFrame
    requests: pl.DataFrame
    state_bytes: StateBytes
    budget: int | None

    def rows(self) -> list[dict]:
        """One dict per policy, with the model and workload (what ``--json`` prints)."""
        return [{"model": self.model, "workload": self.workload, **r} for r in self.frame.to_dicts()]

    def findings(self) -> list[str]:
        """Where each policy loses, one sentence each, from the measured rows."""
        out = []
        for r in self.frame.to_dicts():
            gap = r["gap_to_optimal"]
            vs = (f"{gap} tokens behind the optimum at its {r['bytes_held']:,} B" if gap > 0
                  else f"level with the optimum at its {r['bytes_held']:,} B")
            out.append(f"{r['policy']}: reused {r['reused_tokens']} of {r['reachable_tokens']} reachable "
                       f"tokens, {vs}; {r['where_lost']}")
        return out

    def __repr__(self) -> str:
        return f"Study({self.model}, {self.workload}: {self.frame.height} policies, {self.state_bytes!r})"

    def _repr_html_(self) -> str:
        return summary_html("Study", self.model, self.workload, repr(self.state_bytes),
                            body=table_html(self.frame.columns, self.frame.rows()))


def workload_of(workload) -> Workload:
    if isinstance(workload, Workload):
        return workload
    if workload not in WORKLOADS:
        raise KvlabError(f"unknown workload {workload!r}; use one of {', '.join(WORKLOADS)} "
                         "or pass a kv.workloads Workload")
    return WORKLOADS[workload]()


def run_policy(model, requests, policy, *, cost, budget: int | None = None, verify: bool = True,
               reach=None) -> tuple[dict, list[dict]]:
    """One policy over ``requests``: its summary row (without the optimum's columns) and one row
    per request."""
    store = CheckpointStore(budget_bytes=budget)
    engine = Engine(model, store, checkpoints=policy, verify=verify)
    results = [engine.run(r) for r in requests]
    reach = reach or [0] * len(results)
    spec = engine.checkpoint_policy.spec
    per = []
    for r, name, can in zip(results, [getattr(q, "name", "") for q in requests], reach):
        n, hit = r.prompt_tokens, r.reused_tokens
        reason = max(r.miss_reasons, key=r.miss_reasons.get) if r.miss_reasons and can > hit else ""
        per.append({"policy": spec, "request": name, "prompt_tokens": n, "reused_tokens": hit,
                    "reachable_tokens": can, "lost_tokens": max(0, can - hit), "miss_reason": reason,
                    "prefill_s_saved": float(cost.predict(0, n) - cost.predict(hit, n - hit)),
                    "ttft_s": r.ttft_s, "checkpoints_taken": r.checkpoints, "why": r.why})
    worst = max(per, key=lambda p: p["lost_tokens"])
    lost = worst["lost_tokens"]
    where = (f"worst request {worst['request']}: {lost} token{'s' if lost != 1 else ''} lost "
             f"({worst['miss_reason'] or 'no reason'})" if lost else "no reachable token lost")
    row = {"policy": spec, "reused_tokens": sum(p["reused_tokens"] for p in per),
           "prompt_tokens": sum(p["prompt_tokens"] for p in per), "reachable_tokens": sum(reach),
           "bytes_held": store.nbytes, "checkpoints": store.entries,
           "max_logit_diff": max((r.verify_diff or 0.0 for r in results), default=0.0),
           "prefill_s_saved": sum(p["prefill_s_saved"] for p in per),
           "ttft_s": sum(p["ttft_s"] for p in per), "where_lost": where}
    return row, per


def run_study(model, workload="multi_turn", *, policies=POLICY_SPECS, budget: int | None = None,
              cost=None, verify: bool = True, optimal_for: str = "cost_aware") -> Study:
    """Run ``workload`` (a name of ``conformance.WORKLOADS`` or a Workload) once per policy and once
    for the offline optimum (module docstring). ``cost``: a ``kv.cost`` model (default: a
    ``NominalCost``; pass ``kv.cost.fit(model)`` for this machine's seconds)."""
    wl = workload_of(workload)
    cost = cost if cost is not None else NominalCost()
    requests = list(wl.requests)
    seqs = [Engine(model).tokens_of(r)[0].ids for r in requests]
    reach = reachable(seqs)
    sb = StateBytes.of(model)
    rows, per = [], []
    for spec in policies:
        policy = parse_policy(spec)
        if isinstance(policy, CostAware):  # this study's cost model, a fresh memory
            policy = replace(policy, cost=cost, bytes=sb, memory=Sightings())
        row, reqs = run_policy(model, requests, policy, cost=cost, budget=budget, verify=verify, reach=reach)
        rows.append(row)
        per += reqs
    target = budget
    if target is None:
        target = next((r["bytes_held"] for r in rows if r["policy"] == optimal_for),
                      max((r["bytes_held"] for r in rows), default=0))
    row, reqs = run_policy(model, requests, plan_optimal(seqs, sb, target), cost=cost, budget=budget,
                           verify=verify, reach=reach)
    rows.append(row)
    per += reqs
    for r in rows:
        best = sum(plan_optimal(seqs, sb, r["bytes_held"]).planned_reuse)
        r["optimal_reused_at_bytes"] = best
        r["gap_to_optimal"] = best - r["reused_tokens"]
    frame = pl.DataFrame(rows).select(COLUMNS)
    return Study(getattr(model, "name", "model"), wl.name, frame, pl.DataFrame(per), sb, budget)
