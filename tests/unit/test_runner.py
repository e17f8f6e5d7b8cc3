"""kvlab.experiments.runner, kvlab.experiments.grid and the `kvlab execute` / `kvlab grid` commands.

The helpers are plain unit tests; everything that executes a notebook starts a Jupyter kernel
(papermill) and is marked `notebook`. The notebooks here are tiny and need no model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import polars as pl
import pytest
import yaml

from kvlab import cli
from kvlab.experiments import runner
from kvlab.experiments import grid as nb_grid
from kvlab.experiments.grid import GridError
from kvlab.experiments.runner import RunError


def make_notebook(path: Path) -> Path:
    """A notebook with parameters x, label, fail and results_path; fails on request in cell 3."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "kvlab", "display_name": "Python (kvlab)", "language": "python"}
    params = nbformat.v4.new_code_cell("x = 1\nlabel = 'a'\nfail = False\nresults_path = 'results.parquet'")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [
        nbformat.v4.new_markdown_cell("# runner fixture"),
        nbformat.v4.new_code_cell("import kvlab as kv\nimport polars as pl"),
        params,
        nbformat.v4.new_code_cell("if fail:\n    raise ValueError(f'asked to fail with x={x}')"),
        nbformat.v4.new_code_cell(
            "results = pl.DataFrame({'square': [x * x], 'echo': [label], 'cells': [2]})\n"
            "kv.runner.save_results(results, results_path)"),
    ]
    nbformat.write(nb, path)
    return path


@pytest.fixture
def notebook(tmp_path):
    return make_notebook(tmp_path / "tiny_nb.ipynb")


# ------------------------------------------------------------------------------------------ helpers

def test_parse_value_reads_yaml_scalars():
    assert runner.parse_value("3") == 3
    assert runner.parse_value("0.5") == 0.5
    assert runner.parse_value("true") is True
    assert runner.parse_value("tiny") == "tiny"
    assert runner.parse_value("null") is None
    assert runner.parse_value("[1, 2]") == [1, 2]
    assert runner.parse_value("") == ""
    assert runner.parse_parameters([["turns", "3"], ["model", "smollm2"]]) == {"turns": 3, "model": "smollm2"}
    with pytest.raises(RunError, match="not a Python identifier"):
        runner.parse_parameters([["bad-name", "1"]])


def test_grid_is_the_cartesian_product(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text("x: [1, 2]\nlabel: [a, b]\nfixed: 7\n")
    g = nb_grid.load_grid(grid)
    assert g == {"x": [1, 2], "label": ["a", "b"], "fixed": [7]}
    points = nb_grid.grid_points(g)
    assert points == [{"x": 1, "label": "a", "fixed": 7}, {"x": 1, "label": "b", "fixed": 7},
                      {"x": 2, "label": "a", "fixed": 7}, {"x": 2, "label": "b", "fixed": 7}]


@pytest.mark.parametrize("text, match", [("- 1\n- 2\n", "mapping"), ("x: []\n", "no values"),
                                         ("x: [1\n", "not valid YAML"), ("1x: [1]\n", "not a parameter")])
def test_bad_grids_say_why(tmp_path, text, match):
    grid = tmp_path / "grid.yaml"
    grid.write_text(text)
    with pytest.raises(GridError, match=match):
        nb_grid.load_grid(grid)
    with pytest.raises(GridError, match="no grid file"):
        nb_grid.load_grid(tmp_path / "missing.yaml")


def test_save_results_is_atomic_and_returns_the_frame(tmp_path, monkeypatch):
    path = tmp_path / "deep" / "results.parquet"
    df = runner.save_results({"a": [1, 2]}, path)
    assert pl.read_parquet(path).equals(df)

    def broken(self, file, *a, **k):
        Path(file).write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(pl.DataFrame, "write_parquet", broken)
    with pytest.raises(OSError):
        runner.save_results(pl.DataFrame({"a": [3]}), path)
    assert pl.read_parquet(path)["a"].to_list() == [1, 2]  # the old table survives
    assert [p.name for p in path.parent.iterdir()] == ["results.parquet"]  # no temp file left


def test_with_params_puts_parameters_first_and_renames_clashes():
    frame = pl.DataFrame({"x": [9], "value": [1.5]})
    out = nb_grid._with_params(frame, {"x": 1, "label": "a", "grid": [1, 2]}, "run-000")
    assert out.columns == ["x", "label", "grid", "run", "x_result", "value"]
    assert out.row(0) == (1, "a", "[1, 2]", "run-000", 9, 1.5)


def test_unknown_parameter_and_missing_notebook_are_refused(notebook, tmp_path):
    with pytest.raises(RunError, match=r"has no parameter 'nope'; its parameters are: fail, label, "
                                       r"results_path, x"):
        runner.run_notebook(notebook, {"nope": 1}, tmp_path / "out")
    with pytest.raises(RunError, match="no notebook at"):
        runner.run_notebook(tmp_path / "missing.ipynb")
    with pytest.raises(GridError, match="has no parameter 'nope'"):
        nb_grid.run_grid(notebook, {"nope": [1]}, out_dir=tmp_path / "sw")
    with pytest.raises(GridError, match="both fixed and in the grid"):
        nb_grid.run_grid(notebook, {"x": [1]}, parameters={"x": 2}, out_dir=tmp_path / "sw")


def test_kernelspec_preloads_openblas(tmp_path):
    from kvlab import _blas
    from kvlab.experiments import kernel

    spec = kernel.kernel_spec()
    assert spec["argv"] == [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    blas = _blas.openblas_path()
    if sys.platform.startswith("linux") and blas:
        assert spec["env"] == {"LD_PRELOAD": blas}
    folder = Path(kernel.install_kernelspec(prefix=str(tmp_path)))
    assert folder == tmp_path / "share" / "jupyter" / "kernels" / "kvlab"
    assert json.loads((folder / "kernel.json").read_text()) == spec


# ------------------------------------------------------------------------------------------ running

@pytest.mark.notebook
def test_run_writes_the_three_artefacts(notebook, tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["execute", str(notebook), "-p", "x", "3", "-p", "label", "seven", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "ok" in printed
    assert (out / "tiny_nb.ipynb").is_file()
    assert (out / "tiny_nb.html").is_file() and "asked to fail" in (out / "tiny_nb.html").read_text()
    df = pl.read_parquet(out / "results.parquet")
    assert df.to_dicts() == [{"square": 9, "echo": "seven", "cells": 2}]
    executed = nbformat.read(out / "tiny_nb.ipynb", as_version=4)
    injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert "x = 3" in injected[0].source and str(out / "results.parquet") in injected[0].source
    meta = json.loads((out / "run.json").read_text())
    assert meta["ok"] and meta["parameters"] == {"x": 3, "label": "seven"}


@pytest.mark.notebook
def test_run_default_folder_and_run_result(notebook, tmp_path):
    r = runner.run_notebook(notebook, {"x": 4}, runs_dir=tmp_path / "runs")
    assert r.ok and r.run_dir.parent == tmp_path / "runs" and r.run_dir.name.startswith("tiny_nb-")
    assert r.results["square"].to_list() == [16]
    assert "tiny_nb.ipynb ok" in repr(r) and "<table>" in r._repr_html_()
    again = runner.run_notebook(notebook, {"x": 5}, runs_dir=tmp_path / "runs")
    assert again.run_dir != r.run_dir  # same second: a suffixed folder, never a shared one


@pytest.mark.notebook
def test_failing_notebook_exits_nonzero_and_names_the_cell(notebook, tmp_path):
    out = tmp_path / "failed"
    out.mkdir()
    (out / "results.parquet").write_bytes(b"stale")  # a table from an earlier run must not survive
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-m", "kvlab.cli", "execute", str(notebook), "-p", "fail", "true",
                           "-p", "x", "7", "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode != 0
    err = proc.stderr
    assert "kvlab: error:" in err
    assert "failed in cell 3 (code cell 3 of 4" in err
    assert "`if fail:` raised ValueError: asked to fail with x=7" in err
    assert f"partial executed notebook is kept at {out / 'tiny_nb.ipynb'}" in err
    assert (out / "tiny_nb.ipynb").is_file()
    assert not (out / "results.parquet").exists()
    partial = nbformat.read(out / "tiny_nb.ipynb", as_version=4)
    errors = [o for c in partial.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.output_type == "error"]
    assert errors and errors[0].ename == "ValueError"

    with pytest.raises(RunError) as info:
        runner.run_notebook(notebook, {"fail": True}, tmp_path / "again")
    assert info.value.result.failed_cell == 3 and not info.value.result.ok


# ------------------------------------------------------------------------------------------ grids

def _check_grid_frame(df: pl.DataFrame) -> pl.DataFrame:
    assert df.height == 4
    assert df.columns[:3] == ["x", "label", "run"]
    assert set(df.columns) == {"x", "label", "run", "square", "echo", "cells"}
    df = df.sort("x", "label")
    assert df.select("x", "label").rows() == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert df["square"].to_list() == [1, 1, 4, 4]
    assert df["echo"].to_list() == df["label"].to_list()
    assert df["run"].n_unique() == 4
    return df


@pytest.mark.notebook
def test_grid_2x2_in_processes_and_on_dask(notebook, tmp_path):
    """`kvlab grid` over a 2x2 grid in 2 worker processes, as a user runs it; then the same grid on
    a Dask LocalCluster (2 worker processes on loopback) must give the same table."""
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"x": [1, 2], "label": ["a", "b"]}, sort_keys=False))
    out = tmp_path / "grid"
    proc = subprocess.run([sys.executable, "-m", "kvlab.cli", "grid", str(notebook), "--grid", str(grid),
                           "--workers", "2", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "4 runs -> 4 rows" in proc.stdout and "square" in proc.stdout
    local = _check_grid_frame(pl.read_parquet(out / "grid.parquet"))
    for run in local["run"]:
        assert (out / run / "results.parquet").is_file() and (out / run / "tiny_nb.html").is_file()
    meta = json.loads((out / "grid.json").read_text())
    assert meta["grid"] == {"x": [1, 2], "label": ["a", "b"]} and all(r["ok"] for r in meta["runs"])

    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(processes=True, n_workers=2, threads_per_worker=1, host="127.0.0.1",
                                  dashboard_address="127.0.0.1:0") as cluster:  # no fixed port to collide on
        remote = nb_grid.run_grid(notebook, grid, out_dir=tmp_path / "dask", scheduler=cluster.scheduler_address,
                              html_export=False)
    assert _check_grid_frame(remote).equals(local)
    assert (tmp_path / "dask" / "grid.parquet").is_file()


@pytest.mark.notebook
def test_grid_reports_failed_runs_and_keeps_the_rest(notebook, tmp_path):
    with pytest.raises(GridError) as info:
        nb_grid.run_grid(notebook, {"x": [1, 2], "fail": [False, True]}, workers=1, out_dir=tmp_path / "s",
                     html_export=False)
    e = info.value
    assert "2 of 4 runs of tiny_nb.ipynb failed" in str(e) and "asked to fail" in str(e)
    assert e.frame.height == 2 and e.frame["fail"].to_list() == [False, False]
    assert pl.read_parquet(tmp_path / "s" / "grid.parquet").height == 2


def test_grid_with_an_unreachable_scheduler_says_so(notebook, tmp_path):
    pytest.importorskip("distributed")
    import dask

    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        with pytest.raises(GridError, match="cannot connect to the Dask scheduler at 'tcp://127.0.0.1:9'"):
            nb_grid.run_grid(notebook, {"x": [1]}, out_dir=tmp_path / "s", scheduler="tcp://127.0.0.1:9")


def test_save_results_without_a_path_writes_a_fresh_run_folder(tmp_path, monkeypatch, capsys):
    # a notebook run by hand (results_path = None): each run its own folder, none overwritten
    # (mutant: a fixed runs/<name>/results.parquet, or the working directory's results.parquet)
    monkeypatch.chdir(tmp_path)
    runner.save_results({"a": [1]}, None, "10_policies")
    runner.save_results({"a": [2]}, None, "10_policies")
    written = sorted(tmp_path.glob("runs/10_policies-*/results.parquet"))
    assert len(written) == 2 and not (tmp_path / "results.parquet").exists()
    assert sorted(pl.read_parquet(p)["a"][0] for p in written) == [1, 2]
    out = capsys.readouterr().out
    assert out.count("results: 1 rows x 1 columns -> runs/10_policies-") == 2
