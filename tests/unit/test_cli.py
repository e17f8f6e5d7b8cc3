"""The `kvlab` command's shape: a package of command groups, `python -m kvlab.cli` works, and no
library module imports the CLI (the CLI only parses and prints)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.cli import COMMANDS, build_parser, main
from kvlab.cli.output import print_result

KVLAB = Path(__file__).resolve().parents[2] / "kvlab"


def test_python_dash_m_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "kvlab.cli", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "{prepare,demo,bench,simulate,execute,run,grid,serve,proxy,loadgen,load,peer,checkpoints,conformance}" in out.stdout


def test_renamed_commands_still_work_and_say_so(tmp_path, capsys):
    """`kvlab run` (a notebook) is `kvlab execute`, `kvlab load` (a load test) is `kvlab loadgen`:
    `run` and `load` now mean a request through the engine and a model. The old names work for one
    release and say what to use. Mutant caught: dropping the notice (the stderr check fails)."""
    from kvlab.cli import loadgen, notebooks

    for old, new, func in (("run", "execute", notebooks.run), ("load", "loadgen", loadgen.load)):
        assert build_parser().parse_args([old, "x"]).func is build_parser().parse_args([new, "x"]).func is func
    assert main(["run", str(tmp_path / "missing.ipynb")]) == 2
    err = capsys.readouterr().err
    assert "`kvlab run` is deprecated" in err and "use `kvlab execute`" in err


def test_grid_replaced_sweep(capsys):
    from kvlab.cli import notebooks

    args = build_parser().parse_args(["grid", "nb.ipynb", "--grid", "g.yaml", "-p", "x", "1"])
    assert args.func is notebooks.grid and args.param == [["x", "1"]]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sweep", "nb.ipynb", "--grid", "g.yaml"])
    assert "invalid choice: 'sweep'" in capsys.readouterr().err
    assert all(callable(group.register) for group in COMMANDS)


def test_print_result(capsys):
    print_result({"requests": 3, "ratio": "50.0%"}, False)
    assert capsys.readouterr().out == f"{'requests':>24}: 3\n{'ratio':>24}: 50.0%\n"
    print_result({"a": None}, True)
    assert capsys.readouterr().out == '{\n  "a": null\n}\n'


def test_errors_exit_2_with_the_message(capsys):
    assert main(["simulate"]) == 2
    assert "kvlab: error: give a trace file or --workload NAME" in capsys.readouterr().err


def test_no_library_module_imports_the_cli():
    offenders = []
    for path in KVLAB.rglob("*.py"):
        rel = path.relative_to(KVLAB.parent)
        if rel.parts[:2] == ("kvlab", "cli"):
            continue
        package = ".".join(rel.with_suffix("").parts[:-1]) if path.name != "__init__.py" \
            else ".".join(rel.parts[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            if any(n == "kvlab.cli" or n.startswith("kvlab.cli.") for n in names):
                offenders.append(str(rel))
    assert offenders == []
