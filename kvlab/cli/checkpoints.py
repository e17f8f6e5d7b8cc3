"""`kvlab checkpoints`: checkpoint policies compared on one workload, one row per policy (tokens
reused, bytes held, logits verified against cold, prefill seconds saved) beside the offline
optimum at the same bytes (``kvlab.experiments.checkpoint_study``)."""

from __future__ import annotations

import json


def register(sub) -> None:
    from ..experiments.checkpoint_study import POLICY_SPECS
    from ..experiments.conformance import WORKLOADS

    s = sub.add_parser("checkpoints", help="compare checkpoint policies on one workload (verified)")
    s.add_argument("--model", default="tiny:qwen3_5",
                   help="tiny:<model_type> (default tiny:qwen3_5, a hybrid), smollm2 or an mlx-lm folder")
    s.add_argument("--workload", default="multi_turn", choices=list(WORKLOADS))
    s.add_argument("--budget", default=None,
                   help="bytes of checkpoints every policy and the optimum may hold, e.g. 1MiB "
                        "(default: no budget; the optimum gets what cost_aware held)")
    s.add_argument("--policies", default=",".join(POLICY_SPECS),
                   help="comma-separated policy specs (kvlab.checkpoints: tail:N, every:N, ...)")
    s.add_argument("--fit-cost", action="store_true",
                   help="measure this machine's prefill cost model (kv.cost.fit) for prefill_s_saved "
                        "and cost_aware; default: kvlab's nominal coefficients")
    s.add_argument("--json", action="store_true", help="one JSON object per line, one per policy")
    s.set_defaults(func=checkpoints)


def checkpoints(args) -> int:
    """The study's table (polars), or with ``--json`` one object per policy per line."""
    import polars as pl

    from ..experiments import cost as cost_model
    from ..experiments.checkpoint_study import run_study
    from ..models.loading import load
    from ..primitives.units import parse_bytes

    model = load(args.model)
    budget = parse_bytes(args.budget) if args.budget is not None else None
    cost = cost_model.fit(model) if args.fit_cost else None
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    study = run_study(model, args.workload, policies=policies, budget=budget, cost=cost)
    if args.json:
        for row in study.rows():
            print(json.dumps({**row, "cost": "fitted" if cost is not None else "nominal"}), flush=True)
        return 0
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, fmt_str_lengths=80):
        print(study.frame.drop("where_lost"))
    print(f"{study.model} · {study.workload} · {study.state_bytes!r}")
    print("\n".join(study.findings()))
    return 0
