"""kvlab.serving.aiperf on a real AIPerf 0.13 export (tests/data/aiperf, how it was made in its
README.txt): the values read, the side-by-side frame against a synthetic kvlab summary, and the
errors a bad file gives. No model, no server."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from kvlab.cli import main
from kvlab.errors import ExportFileError
from kvlab.serving import aiperf, metrics

DATA = Path(__file__).parents[1] / "data" / "aiperf"
JSON, CSV = DATA / "profile_export_aiperf.json", DATA / "profile_export_aiperf.csv"


def _one(frame: pl.DataFrame, metric: str) -> dict:
    return frame.filter(pl.col("metric") == metric).row(0, named=True)


def test_read_the_json_export():
    # catches: the wrong stat or tag read (e.g. avg for p50, inter_token for inter_chunk)
    f = aiperf.read_aiperf(JSON)
    ttft = _one(f, "time_to_first_token")
    assert (ttft["unit"], ttft["p50"], ttft["avg"], ttft["count"]) == ("ms", 946.4867674999999,
                                                                       1008.2284189999999, 8.0)
    icl = _one(f, "inter_chunk_latency")
    assert (icl["count"], icl["p99"]) == (120.0, 530.27359997)  # 8 requests x 15 gaps: pooled
    assert _one(f, "inter_token_latency")["p50"] == 245.0945728333333
    tput = _one(f, "output_token_throughput")
    assert (tput["unit"], tput["avg"], tput["p50"]) == ("tokens/sec", 7.351530388312002, None)
    assert aiperf.read_aiperf(DATA).equals(f)  # the artifact folder: the JSON preferred


def test_read_the_csv_export_under_the_same_tags():
    # catches: CSV display names not mapped to AIPerf's tags, or the Metric,Value section dropped
    f = aiperf.read_aiperf(CSV)
    ttft = _one(f, "time_to_first_token")
    assert (ttft["unit"], ttft["p50"], ttft["avg"], ttft["sum"]) == ("ms", 946.49, 1008.23, 8065.83)
    assert _one(f, "inter_chunk_latency")["p99"] == 530.27
    assert _one(f, "output_token_throughput")["avg"] == 7.35
    assert _one(f, "request_throughput")["avg"] == 0.46


SUMMARY = {"ttft_ms_mean": 1000.0, "ttft_ms_p50": 940.0, "ttft_ms_p90": 1400.0, "ttft_ms_p99": 2200.0,
           "tpot_ms_mean": 220.0, "tpot_ms_p50": 245.0, "tpot_ms_p90": None, "tpot_ms_p99": 325.0,
           "itl_ms_mean": 219.0, "itl_ms_p50": 219.0, "itl_ms_p90": 369.0, "itl_ms_p99": 530.0,
           "e2el_ms_mean": 4300.0, "e2el_ms_p50": 4975.0, "e2el_ms_p90": 5667.0, "e2el_ms_p99": 6000.0,
           "output_throughput": 7.5, "request_throughput": 0.5}


def test_compare_puts_both_tools_side_by_side_under_one_definition():
    # catches: TPOT paired with inter_chunk_latency (or ITL with inter_token_latency), a unit not
    # converted, diff with the wrong sign
    c = aiperf.compare(SUMMARY, JSON)
    assert c.columns == ["figure", "stat", "unit", "kvlab", "aiperf", "diff", "aiperf_metric", "definition"]
    assert c.height == 4 * 4 + 2
    rows = {(r["figure"], r["stat"]): r for r in c.iter_rows(named=True)}
    assert rows["ttft_ms", "p50"] == {
        "figure": "ttft_ms", "stat": "p50", "unit": "ms", "kvlab": 940.0, "aiperf": 946.4867674999999,
        "diff": 946.4867674999999 - 940.0, "aiperf_metric": "time_to_first_token.p50",
        "definition": metrics.DEFINITIONS["ttft_ms"]}
    assert rows["tpot_ms", "p50"]["aiperf_metric"] == "inter_token_latency.p50"
    assert rows["tpot_ms", "p50"]["aiperf"] == 245.0945728333333
    assert rows["tpot_ms", "p90"]["kvlab"] is None and rows["tpot_ms", "p90"]["diff"] is None
    assert rows["itl_ms", "p99"]["aiperf_metric"] == "inter_chunk_latency.p99"
    assert rows["itl_ms", "p99"]["aiperf"] == 530.27359997
    assert rows["e2el_ms", "mean"]["aiperf"] == 4303.520560875
    assert rows["output_throughput", "value"] == {
        "figure": "output_throughput", "stat": "value", "unit": "tokens/s", "kvlab": 7.5,
        "aiperf": 7.351530388312002, "diff": 7.351530388312002 - 7.5,
        "aiperf_metric": "output_token_throughput.avg",
        "definition": metrics.DEFINITIONS["output_throughput"]}
    assert rows["request_throughput", "value"]["aiperf"] == 0.4594706492695001


def test_units_are_converted_to_kvlabs(tmp_path):
    # catches: AIPerf values taken as ms whatever the unit says
    data = json.loads(JSON.read_text())
    data["time_to_first_token"] = {"unit": "s", "avg": 1.5, "p50": 1.25}
    p = tmp_path / "profile_export_aiperf.json"
    p.write_text(json.dumps(data))
    rows = {r["stat"]: r["aiperf"] for r in aiperf.compare(SUMMARY, p).filter(
        pl.col("figure") == "ttft_ms").iter_rows(named=True)}
    assert rows == {"mean": 1500.0, "p50": 1250.0, "p90": None, "p99": None}
    data["time_to_first_token"]["unit"] = "fortnights"
    p.write_text(json.dumps(data))
    with pytest.raises(ExportFileError, match="time_to_first_token in 'fortnights'"):
        aiperf.compare(SUMMARY, p)


@pytest.mark.parametrize("content, name, message", [
    ('{"request_latency": {"unit": "ms", "avg": 1.0}}', "profile_export_aiperf.json",
     "has no time_to_first_token metric"),
    ("{not json", "profile_export_aiperf.json", "cannot read the AIPerf export"),
    ('{"time_to_first_token": {"unit": "ms", "avg": "fast"}, "request_latency": {"unit": "ms", "avg": 1}}',
     "profile_export_aiperf.json", r"time_to_first_token.avg = 'fast', not a number"),
    ("Metric,avg,p50\nRequest Latency (ms),1.0,1.0\n", "profile_export_aiperf.csv",
     "has no time_to_first_token metric"),
    ("{}", "export.txt", "neither .json nor .csv"),
])
def test_a_malformed_export_names_the_file_and_what_is_missing(tmp_path, content, name, message):
    # catches: a KeyError/JSONDecodeError escaping instead of a kvlab error naming the file
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(ExportFileError, match=message) as e:
        aiperf.read_aiperf(p)
    assert str(p) in str(e.value)


def test_missing_files_and_folders(tmp_path):
    with pytest.raises(ExportFileError, match="does not exist"):
        aiperf.read_aiperf(tmp_path / "nope.json")
    with pytest.raises(ExportFileError, match=f"no AIPerf export in {tmp_path}"):
        aiperf.read_aiperf(tmp_path)


def test_the_cli_refuses_a_bad_export_before_the_run(tmp_path, capsys):
    # catches: the export read only after a long load run (port 9 is never listened on: no run)
    code = main(["load", "http://127.0.0.1:9", "--concurrency", "1", "--num-requests", "1",
                 "--no-progress", "--compare-aiperf", str(tmp_path / "missing.json")])
    assert code == 2
    assert f"the AIPerf export {tmp_path / 'missing.json'} does not exist" in capsys.readouterr().err
