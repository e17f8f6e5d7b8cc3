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
    assert ("{prepare,demo,bench,simulate,workload,execute,run,grid,serve,proxy,route,cluster,loadgen,load,peer,"
            "checkpoints,conformance,audit,press}") in out.stdout


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


APPLIES_TO = "Drop it or choose one of those workloads"


@pytest.mark.parametrize("argv,message", [
    # mutant each catches: the flag dropped from the check (the run goes on and fails to connect)
    (["--workload", "multi_turn", "--prefix-len", "64"],
     f"--prefix-len does not apply to the multi_turn workload; it applies to prefix_repetition. {APPLIES_TO}"),
    (["--workload", "agentic_loop", "--suffix-len", "8"],
     f"--suffix-len does not apply to the agentic_loop workload; it applies to prefix_repetition. {APPLIES_TO}"),
    (["--workload", "shared_system_prompt", "--num-prefixes", "2"],
     f"--num-prefixes does not apply to the shared_system_prompt workload; it applies to prefix_repetition. "
     f"{APPLIES_TO}"),
    (["--workload", "fixed", "--input-len", "64", "--turns", "2"],
     f"--turns does not apply to the fixed workload; it applies to multi_turn, agentic_loop. {APPLIES_TO}"),
    (["--workload", "prefix_repetition", "--system-tokens", "64"],
     "--system-tokens does not apply to the prefix_repetition workload; it applies to multi_turn, "
     f"agentic_loop, shared_system_prompt, multimodal, fixed. {APPLIES_TO}"),
    (["--workload", "multi_turn", "--input-len", "64"],
     f"--input-len does not apply to the multi_turn workload; it applies to fixed. {APPLIES_TO}"),
    (["--workload", "multi_turn", "--time-scale", "2"],
     f"--time-scale does not apply to the multi_turn workload; it applies to a trace (.jsonl). {APPLIES_TO}"),
    (["--workload", "prefix_repetition", "--block-tokens", "16"],
     f"--block-tokens does not apply to the prefix_repetition workload; it applies to a trace (.jsonl). "
     f"{APPLIES_TO}"),
    (["--workload", "runs/trace.jsonl", "--output-len", "3"],
     "--output-len does not apply to a trace; it applies to multi_turn, agentic_loop, "
     f"shared_system_prompt, prefix_repetition, fixed, multimodal. {APPLIES_TO}"),
    # the floor: below it every value gave the same 716-728-token prompt (issue 22)
    (["--workload", "shared_system_prompt", "--system-tokens", "150"],
     "--system-tokens 150 is below what shared_system_prompt can make: its instructions and 4 tool "
     "schemas alone are about 672 tokens, so every smaller value gives the same system prompt. Pass "
     "--system-tokens >= 672, or use the fixed workload for a system prompt of exactly any length"),
    (["--workload", "agentic_loop", "--system-tokens", "32"],
     "--system-tokens 32 is below what agentic_loop can make: its instructions and 4 tool "
     "schemas alone are about 674 tokens, so every smaller value gives the same system prompt. Pass "
     "--system-tokens >= 674, or use the fixed workload for a system prompt of exactly any length"),
    (["--workload", "fixed", "--output-len", "4"],
     "the fixed workload needs --input-len: the prompt's tokens as the chat template renders them"),
])
def test_loadgen_refuses_flags_its_workload_ignores(argv, message, capsys):
    """Every workload flag applies to the chosen workload or is refused before anything is sent
    (issue 22: `multi_turn --output-len 5` generated 128 tokens, --prefix-len did nothing)."""
    code = main(["loadgen", "http://127.0.0.1:9", "--concurrency", "1", "--num-requests", "1",
                 "--no-progress", *argv])
    assert code == 2
    assert capsys.readouterr().err == f"kvlab: error: {message}\n"
