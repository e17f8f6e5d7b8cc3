"""Shared by the notebook tests: where the notebooks are, running one with papermill, reading a
cell's printed output and the finding a notebook ends in, and comparing a notebook with its
jupytext pair."""

from __future__ import annotations

from pathlib import Path

import nbformat
import polars as pl

from kvlab.experiments import runner

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
LOGIT_TOL = 1e-3  # cached vs cold float32 logits on the tiny model


def notebook_names() -> list[str]:
    """Every committed notebook's stem (``00_quickstart``, ...), in order."""
    return sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))


def execute(name: str, tmp_path: Path, **parameters) -> tuple[pl.DataFrame, nbformat.NotebookNode]:
    """Run ``notebooks/<name>.ipynb`` with papermill; (its results table, the executed notebook)."""
    r = runner.run_notebook(NOTEBOOKS / f"{name}.ipynb", parameters, tmp_path / name, timeout=600)
    assert r.ok and r.html is not None and r.html.is_file()
    return r.results, nbformat.read(r.executed, as_version=4)


def outputs(nb, startswith: str) -> str:
    """The text/plain and stream text of the code cell whose source starts with ``startswith``."""
    cell = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith(startswith))
    parts = []
    for o in cell.outputs:
        if o.output_type == "stream":
            parts.append(o.text)
        elif "data" in o:
            parts.append(o.data.get("text/plain", ""))
    return "\n".join(parts)


def finding(nb) -> str:
    """The findings an executed notebook ends in: the Markdown its last cell, under the
    "## Findings" heading, displays."""
    assert nb.cells[-2].cell_type == "markdown" and nb.cells[-2].source.strip() == "## Findings"
    last = nb.cells[-1]
    assert last.cell_type == "code"
    texts = [o.data["text/markdown"] for o in last.outputs if "text/markdown" in o.get("data", {})]
    assert len(texts) == 1, f"the last cell must display one Markdown finding, not {last.outputs}"
    return texts[0]


def cells(nb) -> list[tuple[str, str, tuple[str, ...]]]:
    """What a pair must agree on, cell by cell: type, source and tags."""
    return [(c.cell_type, c.source, tuple(c.metadata.get("tags", ()))) for c in nb.cells]


def pair_differences(name: str) -> list[str]:
    """How ``<name>.py`` (read by jupytext) differs from ``<name>.ipynb``; empty when in sync."""
    import jupytext

    ipynb = cells(nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4))
    script = cells(jupytext.read(NOTEBOOKS / f"{name}.py"))
    diffs = [f"{name}.ipynb has {len(ipynb)} cells, {name}.py has {len(script)}"] \
        if len(ipynb) != len(script) else []
    for i, (a, b) in enumerate(zip(ipynb, script)):
        if a[0] != b[0]:
            diffs.append(f"cell {i}: a {a[0]} cell in the .ipynb, {b[0]} in the .py")
        if a[2] != b[2]:
            diffs.append(f"cell {i}: tags {list(a[2])} in the .ipynb, {list(b[2])} in the .py")
        if a[1] != b[1]:
            la, lb = a[1].splitlines(), b[1].splitlines()
            j = next((j for j, (x, y) in enumerate(zip(la, lb)) if x != y), min(len(la), len(lb)))
            diffs.append(f"cell {i} line {j + 1}: {la[j] if j < len(la) else '(end)'!r} in the .ipynb, "
                         f"{lb[j] if j < len(lb) else '(end)'!r} in the .py")
    return diffs
