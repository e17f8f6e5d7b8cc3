"""kvlab.bench: the table format BENCHMARKS.md is written in, the section registry, and `kvlab
bench --write` appending tables as they finish (on the model-free hashing section)."""

from __future__ import annotations

import types

import pytest

from kvlab import bench
from kvlab.bench import Table
from kvlab.cli import main


def test_table_markdown_and_html():
    t = Table("T", "kvlab bench --only t", ("a", "b"), ((1, 2.5), ("x", 12345.6), ("y", 0.012345)), "note")
    assert t.markdown() == ("### T\n\n`kvlab bench --only t`\n\n| a | b |\n|---|---|\n| 1 | 2.5 |\n"
                            "| x | 12,346 |\n| y | 0.0123 |\n\nnote\n")
    assert repr(t) == "Table('T', 3 rows)"
    assert "<th>a</th>" in t._repr_html_() and "<td>12,346</td>" in t._repr_html_()
    assert bench.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "pstdev": pytest.approx(0.8165, abs=1e-4),
                                             "min": 1.0, "max": 3.0, "n": 3}
    assert bench.ms({"median": 0.0125, "pstdev": 0.001, "min": 0.011, "max": 0.02}) == "12.5 ± 1.0 (11.0-20.0)"


def test_registry_order_and_sections():
    assert bench.SECTIONS == ("blas", "ttft", "snapshot", "memory", "hashing", "simulator", "quantization", "policies")
    for name, section in bench.REGISTRY.items():
        assert isinstance(section.NEEDS_MODEL, bool) and callable(section.table), name
    assert [n for n, s in bench.REGISTRY.items() if s.NEEDS_MODEL] == ["ttft", "snapshot", "memory", "quantization"]


def test_a_new_section_is_one_registry_entry(monkeypatch, capsys):
    seen = []

    def table(settings):
        seen.append(settings)
        return Table("fake", "kvlab bench --only fake", ("repeats",), ((settings.repeats,),))

    fake = types.SimpleNamespace(NEEDS_MODEL=False, table=table)
    monkeypatch.setitem(bench.REGISTRY, "fake", fake)
    assert main(["bench", "--only", "fake", "--repeats", "4"]) == 0
    assert "### fake" in capsys.readouterr().out and "| 4 |" in table(seen[0]).markdown()
    assert seen[0].model is None and seen[0].model_name == "smollm2"  # no model loaded for it


def test_bench_write_appends_each_table(tmp_path, capsys):
    out = tmp_path / "BENCH.md"
    assert main(["bench", "--only", "hashing", "--repeats", "1", "--write", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# kvlab benchmarks\n\n## Run of ")
    assert "### block hashing throughput (32k-token prompt, block size 16)" in text
    assert "`kvlab bench --only hashing --repeats 1`" in text and "| xxh3_128 |" in text
    printed = capsys.readouterr().out
    assert "| xxh3_128 |" in printed and f"appended to {out}" in printed
    assert main(["bench", "--only", "hashing", "--repeats", "1", "--write", str(out)]) == 0
    again = out.read_text()
    assert again.startswith(text.rstrip()) and again.count("## Run of ") == 2
    assert not (tmp_path / "BENCH.md.tmp").exists()


def test_unknown_section_is_a_kvlab_error(capsys):
    assert main(["bench", "--only", "hashing,nope"]) == 2
    assert "unknown benchmark(s) ['nope']" in capsys.readouterr().err
