"""`kvlab workload`: a workload through an Engine on a model, one line per request, both hit
rates, and (when most missed tokens diverge at one place) where, what differs there and the flag
that fixes it (``kvlab.experiments.workload_run``). `kvlab run` executes notebooks (`kvlab execute`).

Example:
    $ kvlab workload agentic_loop --model tiny --store paged --turns 3
    $ kvlab workload agentic_loop --model tiny --store paged --turns 3 --normalise
"""

from __future__ import annotations

from .output import print_result


def register(sub) -> None:
    from ..stores import STORE_NAMES

    s = sub.add_parser("workload", help="run a workload through an Engine and say why tokens missed")
    s.add_argument("name", help="a workload generator (agentic_loop, multi_turn, ...)")
    s.add_argument("--model", default="smollm2")
    s.add_argument("--store", default="radix", choices=STORE_NAMES)
    s.add_argument("--turns", type=int, default=None, help="turns (multi_turn, agentic_loop)")
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--max-tokens", type=int, default=None, help="tokens to generate per request")
    s.add_argument("--normalise", action="store_true",
                   help="apply kvlab's normalisation rules (the billing header) to every request first")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=workload)


def workload(args) -> int:
    from ..experiments.workload_run import run_workload
    from ..loader import load

    params = {k: v for k, v in (("turns", args.turns), ("seed", args.seed)) if v is not None}
    run = run_workload(load(args.model), args.name, store=args.store, normalise=args.normalise,
                       max_tokens=args.max_tokens, **params)
    if args.json:
        d = run.dominant_miss
        print_result({"workload": run.workload, "store": run.store, "normalised": run.normalised,
                      **{k: v for k, v in run.stats.items()},
                      "dominant_miss": None if d is None else {
                          "token_index": d.token_index, "message_index": d.message_index, "role": d.role,
                          "field": d.field, "previous": d.previous, "current": d.current, "rule": d.rule,
                          "tokens": d.tokens, "missed": d.missed, "fix": d.fix_for("cli")}}, True)
        return 0
    print(f"kvlab workload {run.workload} on {args.model}, store {run.store}"
          f"{' (normalised)' if run.normalised else ''}")
    for line in run.lines("cli"):
        print(line)
    return 0
