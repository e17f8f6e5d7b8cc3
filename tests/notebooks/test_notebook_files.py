"""The committed notebooks themselves: paired with their jupytext scripts and in sync, clean (no
outputs), parameterised for papermill, and ending in a finding rather than in asserts. Every
notebook in notebooks/ is checked, new ones too."""

from __future__ import annotations

import re

import nbformat
import pytest
from notebook_helpers import NOTEBOOKS, notebook_names, pair_differences

from kvlab.experiments import runner

NAMES = notebook_names()


def test_every_notebook_has_its_pair_and_nothing_generates_them():
    scripts = sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]*_*.py"))
    assert NAMES and scripts == NAMES, "each NN_name.ipynb needs NN_name.py (jupytext --sync) and back"
    config = (NOTEBOOKS / "jupytext.toml").read_text()
    assert 'formats = "ipynb,py:percent"' in config
    assert not (NOTEBOOKS / "_build.py").exists()


@pytest.mark.parametrize("name", NAMES)
def test_pairs_are_in_sync(name):
    diffs = pair_differences(name)
    assert not diffs, (f"{name}.py and {name}.ipynb differ; run `jupytext --sync notebooks/{name}.py` "
                       "(or .ipynb, whichever you edited):\n" + "\n".join(diffs))


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebooks_are_clean_and_parameterised(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "commit notebooks without outputs"
    assert code[0].source.startswith("import kvlab as kv"), "kvlab must load OpenBLAS before anything imports MLX"
    tagged = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1
    declared = runner.notebook_parameters(NOTEBOOKS / f"{name}.ipynb")
    # None: a run by hand writes to a fresh runs/<notebook>-<timestamp>/ (mutant: a fixed
    # "results.parquet" default, which each run overwrites)
    assert declared["results_path"] == "None"
    assert f'kv.runner.save_results(results, results_path, "{name}")' in "".join(c.source for c in code)
    source = "".join(c.source for c in code)
    assert "kv.runner.save_results(" in source, "write the results table with kv.runner.save_results"
    if "kv.load(" in source or "kv.load_vlm(" in source:  # (the trace replay needs no model)
        assert declared["model"].strip("'\"") == "tiny"
        assert 'model = "tiny"' in tagged[0].source
        if "kv.load_vlm(" not in source:  # text notebooks name the real model they also run on
            assert '"smollm2"' in tagged[0].source


@pytest.mark.parametrize("name", NAMES)
def test_notebooks_end_in_a_finding_and_leave_asserts_to_the_tests(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    asserts = [line.strip() for c in code for line in c.source.splitlines() if re.match(r"\s*assert\b", line)]
    assert not asserts, f"asserts belong in tests/notebooks/test_{name}.py, on the results table: {asserts}"
    last = nb.cells[-1]
    # a sentence with the figures, built from the results table the cells before it saved
    assert last.cell_type == "code" and last.source.rstrip().endswith("Markdown(finding)"), last.source
    assert 'f"' in last.source and "results" in last.source
    assert any("kv.runner.save_results(" in c.source for c in code[:-1])
    # under a "## Findings" heading (mutant: the old "## Finding", or a table after the finding)
    assert nb.cells[-2].cell_type == "markdown" and nb.cells[-2].source.strip() == "## Findings"
