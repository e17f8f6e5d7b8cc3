"""`kvlab bench`: the side-by-side benchmark tables, printed as they finish; with ``--write`` the
sections run are rewritten in the markdown file, each naming this run, the others left as they
were (``kvlab.bench.report``), and the README's marked summary block is rendered from the file."""

from __future__ import annotations

import os
from ..primitives import timing


def register(sub) -> None:
    from ..bench import SECTIONS
    from ..models.dtypes import DTYPES

    s = sub.add_parser("bench", help="side-by-side benchmarks (median and spread over repeats)")
    s.add_argument("--model", default="smollm2")
    s.add_argument("--dtype", default=None, choices=DTYPES,
                   help="run the model in this dtype (default: its stored dtype); the serving "
                        "section refuses one its peers (which load the stored dtype) cannot run")
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--only", default=None, help=f"comma-separated: {','.join(SECTIONS)}")
    s.add_argument("--write", default=None,
                   help="write the sections run into this markdown file (each names this run: command, "
                        "commit, date), with the summary rows their targets own; other sections stay")
    s.add_argument("--readme", default=None,
                   help="the README whose bench-summary block to rewrite with the same numbers "
                        "(default with --write: README.md beside the written file, if it exists)")
    s.add_argument("--ttft-system-tokens", type=int, default=1000,
                   help="system prompt size of the TTFT agentic loop")
    s.set_defaults(func=bench)


def command_of(args) -> str:
    """The command line that reproduces this run (what the written file says it came from)."""
    parts = ["kvlab bench", f"--model {args.model}", f"--repeats {args.repeats}"]
    if getattr(args, "dtype", None):
        parts.append(f"--dtype {args.dtype}")
    if args.only:
        parts.append(f"--only {args.only}")
    if args.ttft_system_tokens != 1000:
        parts.append(f"--ttft-system-tokens {args.ttft_system_tokens}")
    if args.write:
        parts.append(f"--write {args.write}")
    return " ".join(parts)


def bench(args) -> int:
    from ..bench import machine, report, run
    from ..bench.summary import START, replace_marked
    from ..primitives.files import atomic_write

    only = args.only.split(",") if args.only else None
    readme = args.readme
    if readme is None and args.write:
        beside = os.path.join(os.path.dirname(os.path.abspath(args.write)), "README.md")
        readme = beside if os.path.exists(beside) else None
    readme_text = open(readme).read() if readme else None
    marked = readme_text is not None and START.split(":")[0] in readme_text
    if marked:
        replace_marked(readme_text, "", name=readme)  # bad markers fail now, not after the run
    if args.write:
        report.parse(_read(args.write), args.write)  # a file kvlab did not write fails now too
    started = timing.timed()
    this = report.Run(command_of(args), report.commit(), timing.stamp("%Y-%m-%d %H:%M"), machine())
    tables = run(args.model, args.repeats, only, on_table=lambda t: print(t.markdown(), flush=True),
                 ttft_system_tokens=args.ttft_system_tokens, dtype=args.dtype)
    # read again: another section may have been written to the file during a run of an hour
    doc = report.merge(report.parse(_read(args.write), args.write) if args.write else None, tables, this)
    if args.write:
        atomic_write(args.write, report.render(doc))
        print(f"kvlab: wrote {', '.join(t.section for t in tables)} into {args.write} ({started.done():.0f} s)")
    if marked:
        details = os.path.relpath(args.write, os.path.dirname(os.path.abspath(readme))) if args.write else None
        atomic_write(readme, replace_marked(open(readme).read(), report.readme_block(doc, details), name=readme))
        print(f"kvlab: rewrote the bench summary in {readme}")
    elif readme_text is not None:
        print(f"kvlab: {readme} has no {START} / end markers; left unchanged")
    return 0


def _read(path) -> str | None:
    return open(path).read() if os.path.exists(path) else None
