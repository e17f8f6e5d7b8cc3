"""`kvlab conformance`: every cache family x every store x every workload through
``kv.Engine(verify=True)``: reused exactly, refused with the layer that prevents it, or a failure
(a wrong answer or a silent zero), as a table; ``--write`` regenerates the docs page from this run."""

from __future__ import annotations

import json
import sys
from ..primitives import timing


def register(sub) -> None:
    from ..experiments.conformance import STORES, WORKLOADS
    from ..models.families import MODEL_TYPES

    s = sub.add_parser("conformance", help="every cache family x store x workload: exact, refused or failing")
    s.add_argument("--model-types", default=",".join(MODEL_TYPES),
                   help="comma-separated tiny:<model_type> families (default: all)")
    s.add_argument("--stores", default=",".join(STORES), help="comma-separated stores (default: all)")
    s.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated workloads (default: all)")
    s.add_argument("--write", default=None, help="write the Markdown table to this file")
    s.add_argument("--json", action="store_true", help="one JSON object per cell, one per line")
    s.set_defaults(func=conformance)


def command_of(args) -> str:
    """The command line that reproduces this run (what the written file says it came from)."""
    from ..experiments.conformance import STORES, WORKLOADS
    from ..models.families import MODEL_TYPES

    defaults = {"--model-types": ",".join(MODEL_TYPES), "--stores": ",".join(STORES),
                "--workloads": ",".join(WORKLOADS)}
    given = {"--model-types": args.model_types, "--stores": args.stores, "--workloads": args.workloads}
    parts = ["kvlab conformance"] + [f"{flag} {value}" for flag, value in given.items() if value != defaults[flag]]
    return " ".join(parts + ([f"--write {args.write}"] if args.write else []))


def conformance(args) -> int:
    """Run the cells, printing each as it finishes; exit 1 when any cell is wrong or a silent zero."""
    from dataclasses import asdict

    from ..experiments.conformance import check_names, markdown, run_conformance, summary
    from ..primitives.files import atomic_write

    model_types, stores, workloads = check_names(args.model_types.split(","), args.stores.split(","),
                                                 args.workloads.split(","))

    def show(cell) -> None:
        if args.json:
            print(json.dumps(asdict(cell)), flush=True)
        else:
            print(f"{cell.model_type:>16} {cell.store:>12} {cell.workload:>12}  {cell.status:<11} "
                  f"{cell.reused_tokens:>5}/{cell.prompt_tokens:<5} reused  max diff "
                  f"{cell.max_logit_diff:.1e}  {cell.reason[:80]}", flush=True)

    started = timing.now()
    frame = run_conformance(model_types, stores, workloads, progress=show)
    counts = summary(frame)
    if not args.json:
        print(", ".join(f"{n} {s}" for s, n in counts.items()) + f" of {len(frame)} cells "
              f"({timing.now() - started:.0f} s)")
    if args.write:
        atomic_write(args.write, markdown(frame, command_of(args)))
        print(f"kvlab: wrote {args.write}", file=sys.stderr)
    return 1 if counts["wrong"] or counts["silent zero"] else 0
