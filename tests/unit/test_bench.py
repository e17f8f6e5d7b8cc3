"""kvlab.bench: the table format BENCHMARKS.md is written in, the section registry, the summary
against the targets computed from measured values, `kvlab bench --write` rewriting only the sections
it ran (each naming its run) and the README's marked block (on the model-free hashing section and
fake sections), and the committed BENCHMARKS.md holding every section."""

from __future__ import annotations

import dataclasses
import re
import types

import pytest

from kvlab import bench
from kvlab.bench import Table, report, summary
from kvlab.errors import KvlabError
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
    assert bench.SECTIONS == ("blas", "ttft", "snapshot", "memory", "hashing", "simulator", "cluster", "exp",
                              "attention", "prefill", "quantization",
                              "policies", "serving", "served_checkpoints", "proxy", "route", "tiers", "conformance",
                              "checkpoint_policies", "hybrid_ttft", "sliding_bytes", "vlm_peers", "tenants",
                              "press_bytes", "press_time", "press_decode", "press_quality", "press_agreement")
    for name, section in bench.REGISTRY.items():
        assert isinstance(section.NEEDS_MODEL, bool) and callable(section.table), name
    assert [n for n, s in bench.REGISTRY.items() if s.NEEDS_MODEL] == ["ttft", "snapshot", "memory", "prefill",
                                                                      "quantization", "serving", "tiers",
                                                                      "press_bytes", "press_time", "press_decode",
                                                                      "press_quality", "press_agreement"]


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


def _fake_section(monkeypatch, name, value):
    """Register a model-free section ``name`` whose table holds ``value`` (no target reads it)."""
    table = lambda settings: Table(name, f"kvlab bench --only {name}", ("v",), ((value,),))  # noqa: E731
    monkeypatch.setitem(bench.REGISTRY, name, types.SimpleNamespace(NEEDS_MODEL=False, table=table))


def test_bench_write_rewrites_only_the_sections_it_ran(tmp_path, capsys, monkeypatch):
    """`--only S --write F` rewrites section S and the summary rows S's targets own; every other
    section stays byte for byte, and the file lists both runs. Mutants caught: the whole file
    regenerated from the run (section hashing lost), the other section's block rewritten with
    this run's command, the summary rows of a section not run dropped to "not measured"."""
    _fake_section(monkeypatch, "other", "first")
    out = tmp_path / "BENCH.md"
    assert main(["bench", "--only", "hashing,other", "--repeats", "1", "--write", str(out)]) == 0
    first = report.parse(out.read_text(), out)
    assert list(first.sections) == ["hashing", "other"]
    other_block = first.sections["other"].block()
    hashing_row = [line for line in out.read_text().splitlines() if line.startswith("| xxh3_128 block hashing")]
    _fake_section(monkeypatch, "other", "second")
    assert main(["bench", "--only", "other", "--repeats", "1", "--write", str(out)]) == 0
    text = out.read_text()
    again = report.parse(text, out)
    assert again.sections["hashing"].block() == first.sections["hashing"].block()
    assert first.sections["hashing"].block() in text  # untouched, byte for byte
    assert again.sections["other"].block() != other_block and "| second |" in text and "| first |" not in text
    assert again.sections["other"].run.command == (f"kvlab bench --model smollm2 --repeats 1 --only other "
                                                   f"--write {out}")
    assert [line for line in text.splitlines() if line.startswith("| xxh3_128 block hashing")] == hashing_row
    assert len(hashing_row) == 1 and re.search(r"\| (met|not met) \| hashing \|$", hashing_row[0])
    runs = text.split("Runs:\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert len(runs) == 2 and runs[0].endswith(": hashing") and runs[1].endswith(": other")
    assert all(" at commit " in r and r.startswith("- `kvlab bench --model smollm2") for r in runs)
    assert "wrote other into" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["BENCH.md"]  # no temporary left behind


def test_bench_write_refuses_a_file_it_did_not_write(tmp_path, capsys, monkeypatch):
    # mutant: a hand-written file overwritten (it was, before sections were written alone)
    out = tmp_path / "BENCH.md"
    out.write_text("# hand-written\n\n| radix | 171 tokens/s |\n")
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("ran the benchmarks"))
    assert main(["bench", "--only", "hashing", "--repeats", "1", "--write", str(out)]) == 2
    assert "is not a file kvlab bench wrote" in capsys.readouterr().err
    assert out.read_text() == "# hand-written\n\n| radix | 171 tokens/s |\n"


def test_a_file_of_one_older_run_keeps_its_tables_and_says_which_run():
    """A BENCHMARKS.md from before the sections (one "Generated by" header) is read as one run of
    its tables, with their summary rows and findings; written back, its tables' text is kept."""
    legacy = ("# kvlab benchmarks\n\nGenerated by `kvlab bench --model smollm2 --repeats 3 --write BENCHMARKS.md` "
              "on 2026-11-26 23:17 (Linux x86_64, 2 cores). Every figure...\n\n## Summary against the targets\n\n"
              "| target | measured | met |\n|---|---|---|\n| xxh3_128 block hashing >= 20M tokens/s | 24.4M tokens/s | met |\n"
              "\n## Findings\n\n**Finding.** slow exp.\n\n## Tables\n\n### block hashing\n\n"
              "`kvlab bench --only hashing --repeats 3`\n\n| a |\n|---|\n| 1 |\n\n### exp\n\n"
              "`kvlab bench --only exp --repeats 3`\n\n| b |\n|---|\n| 2 |\n")
    doc = report.parse(legacy, None)
    run = report.Run("kvlab bench --model smollm2 --repeats 3 --write BENCHMARKS.md", "not recorded",
                     "2026-11-26 23:17", "Linux x86_64, 2 cores")
    assert list(doc.sections) == ["hashing", "exp"] and {s.run for s in doc.sections.values()} == {run}
    assert doc.sections["hashing"].rows == (("xxh3_128 block hashing >= 20M tokens/s", "24.4M tokens/s", "met"),)
    assert doc.sections["exp"].findings == ("**Finding.** slow exp.",)
    text = report.render(doc)
    assert "### block hashing\n\n`kvlab bench --only hashing --repeats 3`\n\n| a |\n|---|\n| 1 |\n" in text
    assert "| xxh3_128 block hashing >= 20M tokens/s | 24.4M tokens/s | met | hashing |" in text
    assert report.render(report.parse(text, None)) == text  # written back, read again: the same file


def test_readme_block_is_rewritten_from_the_file(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"# R\n\nkept\n\n{summary.START}\n40-50x by hand\n{summary.END}\n\nalso kept\n")
    out = tmp_path / "BENCHMARKS.md"
    assert main(["bench", "--only", "hashing", "--repeats", "1", "--write", str(out)]) == 0
    text, bench_md = readme.read_text(), out.read_text()
    assert text.startswith("# R\n\nkept\n\n") and text.endswith("\n\nalso kept\n")
    assert "by hand" not in text and "[BENCHMARKS.md](BENCHMARKS.md)" in text
    block = text.split(summary.START)[1].split(summary.END)[0]
    runs = [line for line in bench_md.splitlines() if line.startswith("- `kvlab bench")]
    assert len(runs) == 1 and runs == [line for line in block.splitlines() if line.startswith("- `")]
    rows = [line for line in block.splitlines() if line.startswith("| xxh3_128 block hashing")]
    assert len(rows) == 1 and rows[0] in bench_md  # the same summary row, from the same numbers
    assert "rewrote the bench summary" in capsys.readouterr().out


def test_readme_edits_made_during_the_run_are_kept(tmp_path, monkeypatch):
    """Mutant caught: writing back the README text read before the run (it lost an edit once)."""
    import kvlab.bench

    readme = tmp_path / "README.md"
    readme.write_text(f"# R\n\n{summary.START}\nold\n{summary.END}\n")
    real_run = kvlab.bench.run

    def run_while_someone_edits(*a, **kw):
        readme.write_text(readme.read_text() + "\nadded during the run\n")
        return real_run(*a, **kw)

    monkeypatch.setattr(kvlab.bench, "run", run_while_someone_edits)
    assert main(["bench", "--only", "hashing", "--repeats", "1", "--write", str(tmp_path / "BENCHMARKS.md")]) == 0
    text = readme.read_text()
    assert text.endswith("\nadded during the run\n") and "\nold\n" not in text


def test_bad_readme_markers_fail_before_the_run(tmp_path, capsys, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text(f"{summary.END}\n{summary.START}\n")
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("ran the benchmarks"))
    assert main(["bench", "--only", "hashing", "--write", str(tmp_path / "B.md")]) == 2
    assert "needs exactly one" in capsys.readouterr().err
    assert not (tmp_path / "B.md").exists()


def fake(section, **values):
    return Table(section, f"kvlab bench --only {section}", ("x",), (("1",),), values=values, section=section)


def spread_of(median, pstdev=0.0):
    return {"median": median, "pstdev": pstdev, "min": median, "max": median, "n": 3}


def summary_row(tables, promise_start: str) -> tuple:
    (row,) = [r for r in summary.summary_table(tables).rows if r[0].startswith(promise_start)]
    return row


def test_summary_is_computed_from_the_values():
    """met / not met follow the numbers on both sides of each threshold."""
    hashing = lambda m: fake("hashing", xxh3_128={"median": m, "min": m, "max": m})  # noqa: E731
    assert summary_row([hashing(21e6)], "xxh3_128")[1:] == ("21.0M tokens/s (21.0-21.0M)", "met")
    assert summary_row([hashing(19e6)], "xxh3_128")[2] == "not met"

    def ttft(radix, paged, lru, lru_sd, limit=1.0, shared=1.0):
        s = {"physical limit": spread_of(limit), "radix": spread_of(radix), "paged": spread_of(paged),
             "shared-radix": spread_of(shared), summary.LRU: spread_of(lru, lru_sd), "cold prefill": spread_of(5.0)}
        return fake("ttft", seconds=s, prompt_tokens=[10, 20], cold_tokens_per_s=spread_of(100.0), model="m")

    row = summary_row([ttft(1.05, 1.08, 1.0, 0.1)], "cached TTFT")
    assert row[2] == "met" and row[1].startswith("radix 1.05x, shared-radix 1.00x, paged 1.08x")
    assert summary_row([ttft(1.12, 1.0, 1.2, 0.1)], "cached TTFT")[2] == "not met"  # > 1.10x
    assert summary_row([ttft(1.0, 1.09, 0.9, 0.1)], "cached TTFT")[2] == "not met"  # slower than LRU
    assert summary_row([ttft(1.0, 1.0, 1.2, 0.1, shared=1.11)], "cached TTFT")[2] == "not met"

    def memory(alloc, shared=52):
        stores = {"radix": {"counter": 100, "allocator": alloc, "token_hit_rate": 0.5},
                  "shared-radix": {"counter": shared, "allocator": shared, "token_hit_rate": 0.5},
                  "paged (block 16)": {"counter": 50, "allocator": 50, "token_hit_rate": 0.5}}
        return fake("memory", stores=stores, lower_bound=50.0, model="m")

    assert summary_row([memory(109)], "PagedStore memory")[2] == "met"
    assert summary_row([memory(109)], "SharedRadixStore memory")[1:] == ("shared-radix 1.040x (0 MiB)", "met")
    assert summary_row([memory(109, shared=53)], "SharedRadixStore memory")[2] == "not met"  # 1.06x
    row = summary_row([memory(109)], "every store's byte counter")
    assert row[1:] == ("radix 1.09, shared-radix 1.00, paged (block 16) 1.00 (allocator / counter)", "met")
    assert summary_row([memory(870)], "every store's byte counter")[2] == "not met"  # the 8.7x the issue found

    def policies(speedup, belady_s, identical=True):
        one = lambda x, secs=1.0: {"speedup": spread_of(x), "identical": identical,  # noqa: E731
                                   "compiled_seconds": spread_of(secs)}
        per = {"lru": one(300), "arc": one(speedup), "belady": one(40, belady_s)}
        return fake("policies", policies=per, requests=12_000, capacities_blocks=list(range(16)))

    row = summary_row([policies(25, 3.0)], "every eviction policy")
    assert row[1:] == ("2 online policies: speed-ups arc 25x (the lowest) to 300x, all identical; belady 40x", "met")
    assert summary_row([policies(19, 3.0)], "every eviction policy")[2] == "not met"
    assert summary_row([policies(25, 3.0, identical=False)], "every eviction policy")[2] == "not met"
    assert summary_row([policies(25, 9.9)], "belady")[2] == "met"
    assert summary_row([policies(25, 10.0)], "belady")[2] == "not met"

    def serving(tput, ttft, hit=0.5, plain_sd=2.0):
        med = lambda t, f, sd: {"throughput": t, "throughput_pstdev": 1.0, "ttft_ms_p50": f,  # noqa: E731
                                "ttft_ms_p50_pstdev": sd, "hit": hit}
        runs = {"kvlab serve mlx-lru": {1: med(tput, ttft, 0.0)}, "mlx_lm.server": {1: med(100.0, 50.0, plain_sd)}}
        return fake("serving", runs=runs, plain="mlx_lm.server", model="m")

    row = summary_row([serving(96.0, 51.0)], "kvlab serve's adapter overhead")
    assert row[1:] == ("concurrency 1: throughput 0.96x, TTFT p50 1.02x at hit rates 50.0% vs 50.0%", "met")
    assert summary_row([serving(94.0, 50.0)], "kvlab serve's adapter overhead")[2] == "not met"  # > 5% slower
    assert summary_row([serving(100.0, 52.5)], "kvlab serve's adapter overhead")[2] == "not met"  # higher TTFT

    def tiers(mape):
        return fake("tiers", mape_holdout=mape, mape_fit=0.05, disk_load_vs_recompute={256: 0.5}, model="m")

    assert summary_row([tiers(0.15)], "prefill cost model")[1:] == (
        "held-out MAPE 15.0% (fit 5.0%); disk load / recompute: 256 tokens 0.5x", "met")
    small = fake("tiers", mape_holdout=0.1, mape_fit=0.05, disk_load_vs_recompute={2048: 0.000679}, model="m")
    assert summary_row([small], "prefill cost model")[1].endswith("2048 tokens 0.00068x")  # not "0.00x"
    assert summary_row([tiers(0.151)], "prefill cost model")[2] == "not met"


# Mutants: the layer target judged on MLX's step or on the min instead of the median; the prefill
# target judged on the MLX-attention row, or on a length other than 2,048.
def test_attention_targets_are_judged_from_the_values():
    def layer(last):
        steps = [{"name": "MLX fused kernel (x)", "seconds": spread_of(0.9), "max_abs_diff": 0.0},
                 {"name": "+ causal block skipping (y)", "seconds": spread_of(0.5), "max_abs_diff": 3e-7},
                 {"name": "+ flash-order tiles (z)", "seconds": {**spread_of(last), "min": 0.01}, "max_abs_diff": 8e-7}]
        return fake("attention", n=2048, steps=steps)

    row = summary_row([layer(0.12)], "one causal attention layer")
    assert row[1:] == ("120 ms, 7.5x less than MLX's 900 ms (steps: causal block skipping 1.8x, flash-order "
                       "tiles 4.2x; max abs diff 8e-07)", "met")
    assert summary_row([layer(0.16)], "one causal attention layer")[2] == "not met"

    from kvlab.bench.prefill import KVLAB, MLX, MLX_LM

    def prefill(ours, theirs=40.0, judged=2048):
        tps = {KVLAB: {1024: spread_of(999.0), 2048: spread_of(ours)}, MLX: {1024: spread_of(1.0), 2048: spread_of(theirs)},
               MLX_LM: {1024: spread_of(1.0), 2048: spread_of(theirs)}}
        return fake("prefill", model="smollm2", lengths=[1024, 2048], judged=judged, tokens_per_s=tps,
                    limit_seconds={1024: 1.0, 2048: 4.0}, blas_gflops={1024: 150.0, 2048: 160.0})

    row = summary_row([prefill(256.0)], "prefill of a 2,048-token prompt")  # 8 s against a 4 s limit
    assert row[1:] == ("2.00x the limit (256 tokens/s, limit 4.0 s at 160 GFLOP/s); with MLX's attention 12.80x, "
                       "mlx-lm's own prefill 12.80x (smollm2)", "met")
    assert summary_row([prefill(200.0, theirs=999.0)], "prefill of a 2,048-token prompt")[2] == "not met"  # 2.56x
    assert summary_row([prefill(256.0, judged=4096)], "prefill of a 2,048-token prompt")[2] == "not met"


def test_findings_quote_the_measured_numbers():
    exp = fake("exp", n=2_400_000, seconds={"mlx (mx.exp)": spread_of(0.072), "numpy (np.exp)": spread_of(0.0036)})
    (text,) = summary.findings([exp])
    assert "takes 72.0 ms (33M values/s); NumPy takes 3.6 ms on the same values (20x less)" in text
    blas = fake("blas", reference={"gflops": 2.0, "prefill_tokens_per_s": 7.0, "fast_blas": False},
                openblas={"gflops": 140.0, "prefill_tokens_per_s": 131.0, "fast_blas": True},
                model="smollm2", prefill_tokens=256)
    ttft = fake("ttft", prompt_tokens=[1089, 1291, 1746], cold_tokens_per_s=spread_of(44.0), seconds={})
    (text,) = summary.findings([exp, blas, ttft])
    assert "prefills 256 tokens at 131 tokens/s" in text and "1291-1746 tokens at 44 tokens/s (3.0x" in text
    doc = report.render(report.merge(None, [exp, blas], report.Run("kvlab bench X", "abc1234", "W", "M")))
    assert doc.startswith("# kvlab benchmarks\n")
    assert "- `kvlab bench X` at commit abc1234 on W (M): blas, exp\n" in doc  # REGISTRY order
    assert "| OpenBLAS path on Linux CPU" in doc and "(70x); smollm2 prefill of 256 tokens 7.0 -> 131 " in doc
    assert "## Findings\n\n**Finding: MLX's CPU `exp` is slow**" in doc


def test_replace_marked():
    text = f"a\n{summary.START}\nold\n{summary.END}\nb\n"
    assert summary.replace_marked(text, "new\n") == f"a\n{summary.START}\nnew\n{summary.END}\nb\n"
    for bad in ("no markers", f"{summary.START}{summary.START}{summary.END}", f"{summary.END}{summary.START}"):
        with pytest.raises(KvlabError, match="needs exactly one"):
            summary.replace_marked(bad, "x")


def test_served_checkpoints_table_shape_and_units():
    """The served checkpoint-policy section's table from fake runs (no model, no server): one row
    per policy, the common budget, bytes in binary units, ratios to mlx-lm's segment_ends.
    Mutant: ratios taken against the row itself (every ratio 1.00x) fails the message_ends row."""
    from kvlab.bench import served_checkpoints as sc
    from kvlab.primitives.units import fmt_bytes

    def run(reused, ttft, peak):
        return {"reused_tokens": reused, "token_hit_rate": reused / 4000, "ttft_ms_p50": ttft,
                "ttft_ms_p99": 2 * ttft, "peak_bytes": peak}

    runs = {"segment_ends": [run(2000, 300.0, 4 << 20), run(2000, 320.0, 4 << 20), run(2000, 310.0, 4 << 20)],
            "message_ends": [run(3000, 240.0, 4 << 20), run(3000, 250.0, 4 << 20), run(2900, 260.0, 3 << 20)]}
    t = sc._table(runs, 4 << 20, 3, "tiny:qwen3_5", sc.LOAD, fmt_bytes)
    assert t.columns == sc.COLUMNS and len(t.rows) == 2
    assert t.rows[0] == ("segment_ends", "4.0 MiB", "2000 (2000-2000)", "50.0%", "310 (300-320)", "620",
                         "4.0 MiB", "1.00x", "1.00x")
    assert t.rows[1] == ("message_ends", "4.0 MiB", "3000 (2900-3000)", "75.0%", "250 (240-260)", "500",
                         "4.0 MiB", "1.50x", "0.81x")
    assert t.values["budget_bytes"] == 4 << 20 and t.values["runs"]["message_ends"]["reused_tokens"] == 3000
    assert "(4194304 B)" in t.notes and "--repeats 3" in t.command


def test_unknown_section_is_a_kvlab_error(capsys):
    assert main(["bench", "--only", "hashing,nope"]) == 2
    assert "unknown benchmark(s) ['nope']" in capsys.readouterr().err


def _committed():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    return (root / "README.md").read_text(), (root / "BENCHMARKS.md").read_text()


def test_committed_readme_quotes_the_committed_benchmarks():
    """README.md's marked block lists the runs that made BENCHMARKS.md and quotes its summary rows."""
    readme, bench_md = _committed()
    block = readme.split(summary.START)[1].split(summary.END)[0]
    runs = [line for line in bench_md.splitlines() if line.startswith("- `kvlab bench ")]
    assert runs and [line for line in block.splitlines() if line.startswith("- `")] == runs
    rows = [line for line in bench_md.split("## Summary against the targets")[1].split("\n## ")[0].splitlines()
            if line.startswith("| ")]
    assert len(rows) == 1 + len(summary.TARGETS)  # the header, then one row a target
    assert [line for line in block.splitlines() if line.startswith("| ")] == rows
    assert {line.split(" | ")[-2].strip() for line in rows[1:]} <= {"met", "not met", "not measured"}


def test_every_section_has_its_table_in_the_committed_benchmarks():
    """Every REGISTRY section has its block in BENCHMARKS.md: its table, the command that measured
    it and the commit it measured. A new section is written alone with
    `kvlab bench --only NAME --write BENCHMARKS.md`. Mutant caught: a section registered and never
    run with --write (vlm_peers was, for a whole round)."""
    import re

    _, bench_md = _committed()
    doc = report.parse(bench_md, None)
    missing = [name for name in bench.REGISTRY if name not in doc.sections]
    assert not missing, f"run: kvlab bench --only {','.join(missing)} --write BENCHMARKS.md"
    for name, s in doc.sections.items():
        assert s.markdown.startswith("### ") and f"kvlab bench --only {name}" in s.markdown, name
        assert s.run.command.startswith("kvlab bench ") and "--write BENCHMARKS.md" in s.run.command, name
        assert re.fullmatch(r"[0-9a-f]{7,40}", s.run.commit), (name, s.run.commit)  # measured committed code
        assert f"_Measured by `{s.run.command}` at commit {s.run.commit} on {s.run.when}._" in bench_md, name
    for t in summary.TARGETS:  # each target's row comes from its section's run
        assert any(row[0] == t.promise for row in doc.sections[t.section].rows), t.promise


def test_family_targets_are_judged_from_the_values():
    """Issue 18's targets: met only on the right side of each threshold, on every workload/store/run.
    Mutants caught (each checked by breaking summary.py): conformance met while cells are refused
    (judging wrong + silent zero only); cost_aware judged on one workload (any instead of all) or
    against 0.80; hybrid TTFT judged on the first store only or against cold prefill; sliding bytes
    judged on the first run only."""
    def conformance(exact, refused=0, wrong=0, zero=0, error=0):
        missed = [{"model_type": "llama4", "store": "paged", "status": "refused",
                   "reason": "layer 0 is chunked"}] * refused
        counts = {"exact": exact, "refused": refused, "wrong": wrong, "silent zero": zero, "error": error}
        return fake("conformance", counts=counts, cells=exact + refused + wrong + zero + error,
                    workload="branching", not_exact=missed)

    assert summary_row([conformance(91)], "every cache family")[1:] == (
        "91 of 91 cells exact on branching, 0 refused, 0 wrong, 0 silent zero, 0 raised", "met")
    assert summary_row([conformance(90, error=1)], "every cache family")[2] == "not met"
    row = summary_row([conformance(89, refused=2)], "every cache family")
    assert row == (row[0], "89 of 91 cells exact on branching, 2 refused, 0 wrong, 0 silent zero, 0 raised; "
                   "refused in paged: llama4, llama4 (reasons in the conformance table)", "not met")
    assert summary_row([conformance(90, wrong=1)], "every cache family")[2] == "not met"
    assert summary_row([conformance(90, zero=1)], "every cache family")[2] == "not met"

    def policies(agentic, branching):
        per = {w: {"cost_aware": {"of_optimal": r}, "optimal": {"of_optimal": 1.0}}
               for w, r in (("agentic_loop", agentic), ("branching", branching))}
        return fake("checkpoint_policies", workloads=per, model="tiny:qwen3_5")

    assert summary_row([policies(1.0, 0.90)], "cost_aware")[1:] == (
        "agentic_loop 1.000 of optimal, branching 0.900 of optimal (tiny:qwen3_5)", "met")
    assert summary_row([policies(1.0, 0.89)], "cost_aware")[2] == "not met"
    assert summary_row([policies(0.85, 1.0)], "cost_aware")[2] == "not met"

    def hybrid(radix, paged, limit=0.1, cold=1.0):
        s = {"cold prefill": spread_of(cold), "radix": spread_of(radix), "paged": spread_of(paged),
             "paged, checkpoint_every 16": spread_of(1.0), "limit": spread_of(limit)}
        return fake("hybrid_ttft", seconds=s, reused={"radix": 768, "paged": 768, "paged, checkpoint_every 16": 768},
                    judged=["radix", "paged"], n=1024, p=768, model="tiny:qwen3_5")

    assert summary_row([hybrid(0.105, 0.11)], "hybrid model: cached TTFT")[1:] == (
        "radix 1.05x, paged 1.10x of the limit (100 ms: 256 of 1024 tokens, tiny:qwen3_5)", "met")
    assert summary_row([hybrid(0.105, 0.12)], "hybrid model: cached TTFT")[2] == "not met"
    assert summary_row([hybrid(0.5, 0.105)], "hybrid model: cached TTFT")[2] == "not met"

    def sliding(one, chat):
        return fake("sliding_bytes", runs={"one prompt": {"ratio": one}, "multi_turn (4 turns)": {"ratio": chat}},
                    model="tiny:gemma3_text")

    assert summary_row([sliding(1.0, 1.1)], "a sliding-window")[1:] == (
        "one prompt 1.000x, multi_turn (4 turns) 1.100x of the bound (tiny:gemma3_text)", "met")
    assert summary_row([sliding(1.0, 1.65)], "a sliding-window")[2] == "not met"
    assert summary_row([sliding(1.2, 1.0)], "a sliding-window")[2] == "not met"
    # the keep_superseded_windows=True rows are shown, not judged (they buy branching reuse with bytes)
    runs = {"one prompt": {"ratio": 1.0, "judged": True, "reused": 0},
            "branching": {"ratio": 1.0, "judged": True, "reused": 1600},
            "branching, kept": {"ratio": 1.2, "judged": False, "reused": 2464}}
    assert summary_row([fake("sliding_bytes", runs=runs, model="m")], "a sliding-window")[1:] == (
        "one prompt 1.000x reusing 0 tokens, branching 1.000x reusing 1600 tokens of the bound; with "
        "keep_superseded_windows=True 1.200x reusing 2464 tokens (m)", "met")


def test_proxy_target_reads_the_added_ttft():
    # mutants: judging the proxied TTFT itself (48 ms > 5) instead of the difference; a strict
    # "< 5" failing an added 5.0 ms
    def proxy(added):
        return fake("proxy", added_ms=spread_of(added, 0.2), direct_ms=spread_of(45.5), proxy_ms=spread_of(48.0),
                    requests=24, repeats=3, model="m")

    assert summary_row([proxy(2.5)], "kvlab proxy adds")[1:] == (
        "+2.50 ms TTFT (pstdev 0.20) over mlx_lm.server's 45.5 ms, 24 request pairs x 3 (m upstream)", "met")
    assert summary_row([proxy(5.0)], "kvlab proxy adds")[2] == "met"
    assert summary_row([proxy(5.1)], "kvlab proxy adds")[2] == "not met"


def test_dense_bound_counts_window_layers_once_per_chain():
    """Full KV for every cached token once, window KV for min(window, chain tokens) per chain.
    Mutants caught: window counted for the whole chain (no min), per block instead of per chain,
    or full KV counted once per chain."""
    from kvlab.bench.families_cache import dense_bound

    # a -> b -> c and a -> d: two chains of 48 and 32 tokens over 4 blocks of 16
    blocks = [{"hash": "a", "parent": None}, {"hash": "b", "parent": "a"}, {"hash": "c", "parent": "b"},
              {"hash": "d", "parent": "a"}]
    per = {"full": 256, "window": 256, "windows": [(32, 128), (32, 128)]}
    cached, chains, bound = dense_bound(blocks, 16, per)
    assert (cached, chains) == (64, 2)
    assert bound == 64 * 256 + (32 + 32) * 128 * 2 == 32768
    short = dense_bound([{"hash": "a", "parent": None}], 16, per)
    assert short == (16, 1, 16 * 256 + 16 * 128 * 2)  # a chain shorter than the window counts its tokens


def test_a_conformance_cell_that_raises_is_a_row_not_the_end_of_the_run(monkeypatch):
    """Mutant caught: bench_conformance without its per-cell except (the whole section dies on the
    first crashing cell, as falcon_h1 x disk did on branching)."""
    from kvlab.bench.families import bench_conformance
    from kvlab.experiments import conformance

    def run_cell(model_type, store, workload):
        if store == "disk":
            raise TypeError("'tuple' object does not support item assignment")
        return conformance.Cell(model_type, conformance.FAMILY_OF[model_type], store, workload, 4, 100, 60, 1e-6,
                                "exact", "")

    monkeypatch.setattr(conformance, "run_cell", run_cell)
    t = bench_conformance(["qwen3", "mamba2"], ["radix", "disk"])
    assert t.rows == (("qwen3", "dense", "exact (60)", "error (0)"),
                      ("mamba2", "pure recurrent", "exact (60)", "error (0)"))
    assert t.values["counts"] == {"exact": 2, "refused": 0, "wrong": 0, "silent zero": 0, "error": 2}
    assert t.values["not_exact"][0] == {"model_type": "qwen3", "store": "disk", "status": "error",
                                        "reason": "raised TypeError: 'tuple' object does not support item assignment"}
    assert summary_row([dataclasses.replace(t, section="conformance")], "every cache family")[2] == "not met"
