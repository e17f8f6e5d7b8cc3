"""Run one experiment notebook with papermill (a parameter grid of runs is kvlab.experiments.grid).

Every run gets a folder holding the executed notebook, its HTML export and the notebook's results
table (``results.parquet``; the runner sets the notebook's ``results_path`` parameter to it).

Example:
    >>> r = kv.runner.run_notebook("notebooks/01_multi_turn.ipynb", {"turns": 3})
    >>> r.results                                      # the notebook's polars table
"""

from __future__ import annotations

import html
import itertools
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import KvlabError
from ..primitives import timing
from ..primitives.display import Html, summary_html, table_html
from ..primitives.files import atomic_write_with

RESULTS_PARAM = "results_path"
RESULTS_FILE = "results.parquet"
DEFAULT_RUNS = "runs"


class RunError(KvlabError, RuntimeError):
    """A notebook run that failed; ``result`` is its RunResult (partial notebook kept)."""

    def __init__(self, message: str, result: "RunResult | None" = None):
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class RunResult:
    """One notebook run: where its artefacts are, with which parameters, and whether it failed."""

    notebook: Path
    run_dir: Path
    executed: Path
    html: Path | None
    results_path: Path | None
    parameters: dict = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None
    failed_cell: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def results(self):
        """The notebook's results table (polars), read from ``results_path``."""
        import polars as pl

        if self.results_path is None or not Path(self.results_path).is_file():
            raise RunError(f"run {self.run_dir} has no results table"
                           + (f" (it failed: {self.error})" if self.error else ""), self)
        return pl.read_parquet(self.results_path)

    def artefacts(self) -> dict[str, Path | None]:
        return {"notebook": self.executed, "html": self.html, "results": self.results_path}

    def __repr__(self) -> str:
        state = "ok" if self.ok else f"FAILED in cell {self.failed_cell}"
        return f"RunResult({self.notebook.name} {state} in {self.seconds:.1f}s -> {self.run_dir})"

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(self.summary())

    def summary(self) -> str:
        """Several lines: the state, the parameters and each artefact's path."""
        lines = [repr(self)]
        if self.parameters:
            lines.append("  parameters: " + ", ".join(f"{k}={v!r}" for k, v in self.parameters.items()))
        for name, path in self.artefacts().items():
            lines.append(f"  {name:>8}: {path if path is not None and Path(path).exists() else '—'}")
        if self.error:
            lines.append(f"  error: {self.error}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        colour, word = ("#2a7", "ok") if self.ok else ("#c33", "failed")
        params = ", ".join(f"{k}={v!r}" for k, v in self.parameters.items())
        paths = table_html(None, [(name, path if path is not None and Path(path).exists() else None)
                                  for name, path in self.artefacts().items()], row_headers=True)
        err = (f"<pre style='color:#c33;white-space:pre-wrap'>{html.escape(self.error)}</pre>"
               if self.error else "")
        table = ""
        if self.ok and self.results_path is not None and Path(self.results_path).is_file():
            results = self.results
            table = table_html(results.columns, results.head(20).rows(), total=results.height)
        return summary_html("Run", self.notebook.name,
                            Html(f"<span style='color:{colour};font-weight:bold'>{word}</span>"),
                            f"{self.seconds:.1f}s", note=params, body=paths + err + table)


# ---------------------------------------------------------------------------------------- helpers

def save_results(frame, path=None, name: str | None = None) -> Any:
    """Write a notebook's results table to ``path`` atomically (never a half-written parquet);
    returns the frame.

    ``path=None`` (a notebook's default ``results_path``, run by hand) writes to a fresh per-run
    folder ``runs/<name>-<timestamp>/results.parquet``, so no run overwrites another. Given a
    ``name`` (a notebook's stem), it prints where the table went; ``kvlab execute`` and
    ``run_notebook`` always pass a path.

    Example:
        >>> results = kv.runner.save_results(results, results_path, "01_multi_turn")
        results: 12 rows x 5 columns -> runs/01_multi_turn-20250101-120000/results.parquet
    """
    import polars as pl

    if not isinstance(frame, pl.DataFrame):
        frame = pl.DataFrame(frame)
    if path is None:
        path = new_run_dir(Path(DEFAULT_RUNS), name or "results") / RESULTS_FILE
    atomic_write_with(path, frame.write_parquet)
    if name is not None:
        print(f"results: {frame.height:,} rows x {frame.width} columns -> {path}")
    return frame


def parse_value(text: str):
    """A ``-p NAME VALUE`` value as YAML: ``3`` -> 3, ``0.5`` -> 0.5, ``true`` -> True, ``tiny`` -> 'tiny'."""
    import yaml

    if not isinstance(text, str):
        return text
    try:
        return yaml.safe_load(text) if text.strip() else text
    except yaml.YAMLError:
        return text


def parse_parameters(pairs) -> dict:
    """``[[name, value], ...]`` from the command line -> {name: YAML value}."""
    out = {}
    for name, value in pairs or ():
        if not name.isidentifier():
            raise RunError(f"parameter name {name!r} is not a Python identifier")
        out[name] = parse_value(value)
    return out


def notebook_parameters(path) -> dict:
    """The notebook's ``parameters`` cell as {name: default} (papermill's inspection)."""
    import papermill

    info = papermill.inspect_notebook(str(path))
    return {name: p.get("default") for name, p in info.items()}


def new_run_dir(base: Path, stem: str) -> Path:
    """A fresh folder ``<base>/<stem>-<timestamp>`` (suffixed ``-2``, ``-3`` within one second).

    Example:
        >>> new_run_dir(Path("runs"), "01_multi_turn").name
        '01_multi_turn-20250101-120000'
    """
    stamp = timing.stamp("%Y%m%d-%H%M%S")
    for n in itertools.count(1):
        folder = base / (f"{stem}-{stamp}" if n == 1 else f"{stem}-{stamp}-{n}")
        try:
            folder.mkdir(parents=True)
            return folder
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def _kernel(kernel_name: str | None) -> str:
    if kernel_name:
        return kernel_name
    from .kernel import ensure_kernelspec

    return ensure_kernelspec() or "python3"


# Figures in executed notebooks: plotly's JSON for Jupyter plus self-contained HTML (plotly.js
# inlined once per notebook), so the HTML export shows them offline. PLOTLY_RENDERER overrides.
PLOTLY_RENDERER = "plotly_mimetype+notebook"


class _kernel_env:
    """Environment the kernel starts with (kernels inherit os.environ): OpenBLAS in LD_PRELOAD, so
    a kernel spec without the preload (e.g. plain python3) still gets fast BLAS, and the renderer."""

    def __enter__(self):
        from .._blas import env_with_fast_blas

        self.old = {k: os.environ.get(k) for k in ("LD_PRELOAD", "PLOTLY_RENDERER")}
        new = env_with_fast_blas().get("LD_PRELOAD")
        if new is not None:
            os.environ["LD_PRELOAD"] = new
        os.environ.setdefault("PLOTLY_RENDERER", PLOTLY_RENDERER)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _describe_failure(err, source_nb, notebook: Path, executed: Path) -> tuple[str, int | None]:
    """A message naming the failing cell by its position in the *source* notebook."""
    src = err.source if isinstance(err.source, str) else "".join(err.source or "")
    index = None
    code_cells = [i for i, c in enumerate(source_nb.cells) if c.cell_type == "code"]
    for i, cell in enumerate(source_nb.cells):
        if cell.cell_type == "code" and cell.source.strip() == src.strip():
            index = i
            break
    first = next((ln.strip() for ln in src.splitlines() if ln.strip() and not ln.strip().startswith("#")),
                 src.strip().splitlines()[0] if src.strip() else "")
    if len(first) > 80:
        first = first[:77] + "..."
    where = (f"cell {index} (code cell {code_cells.index(index) + 1} of {len(code_cells)}; "
             f"In [{err.exec_count}] in the executed notebook)" if index is not None
             else f"In [{err.exec_count}] of the executed notebook")
    evalue = (err.evalue or "").strip()
    message = (f"{notebook} failed in {where}: `{first}` raised {err.ename}"
               + (f": {evalue}" if evalue else "")
               + f". The partial executed notebook is kept at {executed}")
    return message, index


# ---------------------------------------------------------------------------------------- running

# nbclient waits only 4 s for a cell's last outputs after its reply, then drops them with a
# warning: on a loaded machine a Findings cell came back empty. Wait as long as a slow kernel needs.
IOPUB_TIMEOUT_S = 120


def run_notebook(path, parameters: Mapping | None = None, out_dir=None, *,
                 kernel_name: str | None = None, timeout: float | None = None,
                 html_export: bool = True, progress: bool = False, log_output: bool = False,
                 raise_on_error: bool = True, runs_dir=DEFAULT_RUNS) -> RunResult:
    """Execute a notebook with papermill into a run folder: executed notebook, HTML, results.

    ``out_dir`` defaults to ``runs/<stem>-<timestamp>/``. The notebook's ``results_path``
    parameter (if it has one) is set to ``<out_dir>/results.parquet``. Parameters the notebook
    does not declare are refused. ``timeout`` is per cell, in seconds. A failing cell raises
    RunError naming the cell (``raise_on_error=False`` returns the failed RunResult instead); the
    partial executed notebook stays in the run folder and no results table is left behind.

    Example:
        >>> r = run_notebook("notebooks/00_quickstart.ipynb", {"model": "tiny"})
        >>> r.run_dir, r.results.shape
    """
    import nbformat
    import papermill
    from papermill.exceptions import PapermillExecutionError

    notebook = Path(path)
    if not notebook.is_file():
        raise RunError(f"no notebook at {notebook}")
    if notebook.suffix != ".ipynb":
        raise RunError(f"{notebook} is not a .ipynb notebook")
    source_nb = nbformat.read(notebook, as_version=4)
    declared = notebook_parameters(notebook)
    params = dict(parameters or {})
    unknown = sorted(set(params) - set(declared))
    if unknown:
        known = ", ".join(sorted(declared)) or "none (it has no cell tagged 'parameters')"
        raise RunError(f"{notebook.name} has no parameter {', '.join(map(repr, unknown))}; "
                       f"its parameters are: {known}")
    run_dir = Path(out_dir) if out_dir is not None else new_run_dir(Path(runs_dir), notebook.stem)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir = run_dir.resolve()
    results_path = None
    if RESULTS_PARAM in declared:
        results_path = Path(params.get(RESULTS_PARAM) or run_dir / RESULTS_FILE).resolve()
        params[RESULTS_PARAM] = str(results_path)
        results_path.unlink(missing_ok=True)  # a stale table must not pass for this run's
    executed = run_dir / notebook.name
    shown = {k: v for k, v in params.items() if k != RESULTS_PARAM}

    kernel = _kernel(kernel_name)
    from .kernel import manager_config

    start = timing.now()
    error, failed_cell = None, None
    try:
        with _kernel_env():
            papermill.execute_notebook(
                str(notebook), str(executed), parameters=params, kernel_name=kernel,
                language="python", progress_bar=progress, log_output=log_output,
                cwd=str(notebook.parent.resolve()), start_timeout=180,
                execution_timeout=timeout, iopub_timeout=IOPUB_TIMEOUT_S, **manager_config())
    except PapermillExecutionError as e:
        error, failed_cell = _describe_failure(e, source_nb, notebook, executed)
    except Exception as e:  # kernel died, timeout, no such kernel: still name what happened
        error = (f"{notebook} could not be executed: {type(e).__name__}: {str(e).strip()[:500]}. "
                 f"The partial executed notebook (if any) is kept at {executed}")
    seconds = timing.now() - start

    if error is None and results_path is not None and not results_path.is_file():
        error = (f"{notebook} ran but did not write its results table to results_path "
                 f"({results_path}); end the notebook with kv.runner.save_results(table, results_path)")
    if error is not None and results_path is not None:
        results_path.unlink(missing_ok=True)  # a failed run leaves no table to be mistaken for results
    html_path = None
    if html_export and executed.is_file():
        html_path = _export_html(executed)
    result = RunResult(notebook, run_dir, executed, html_path,
                       results_path if error is None else None, shown, seconds, error, failed_cell)
    (run_dir / "run.json").write_text(json.dumps(
        {"notebook": str(notebook.resolve()), "parameters": shown, "seconds": round(seconds, 3),
         "ok": error is None, "error": error, "kernel": kernel}, indent=2, default=str))
    if error is not None and raise_on_error:
        raise RunError(error, result)
    return result


def _export_html(executed: Path) -> Path | None:
    import nbformat
    from nbconvert import HTMLExporter

    try:
        body, _ = HTMLExporter().from_notebook_node(nbformat.read(executed, as_version=4))
    except Exception as e:  # an export problem must not hide the run's own outcome
        print(f"kvlab: warning: HTML export of {executed} failed: {e}", file=sys.stderr)
        return None
    out = executed.with_suffix(".html")
    out.write_text(body, encoding="utf-8")
    return out
