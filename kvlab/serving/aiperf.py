"""Read NVIDIA AIPerf's summary export and put its figures beside a kvlab load run's, under one
set of definitions (:data:`kvlab.serving.metrics.DEFINITIONS`).

AIPerf (0.13) writes ``profile_export_aiperf.json`` (one block a metric tag: ``unit``, ``avg``,
``min``, ``max``, ``p1``..``p99``, ``std``, ``count``, ``sum``; scalar metrics only ``unit`` and
``avg``) and ``profile_export_aiperf.csv`` (a table of record metrics by display name, then
``Metric,Value`` rows of scalar ones). The pairs that share a definition:

- kvlab TTFT = AIPerf ``time_to_first_token`` (first non-empty response);
- kvlab TPOT = AIPerf ``inter_token_latency`` ((request_latency - TTFT) / (output tokens - 1));
- kvlab ITL = AIPerf ``inter_chunk_latency`` (every gap between content responses, pooled over
  requests: its ``count`` is the number of gaps);
- kvlab E2EL = AIPerf ``request_latency``;
- throughputs: ``output_token_throughput`` and ``request_throughput``. AIPerf counts output
  tokens by re-tokenizing the text unless run with ``--use-server-token-count``; kvlab uses
  usage ``completion_tokens``.

Example:
    >>> kv.serving.aiperf.compare(result, "artifacts/run/profile_export_aiperf.json")
    shape: (22, 8) ...
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import polars as pl

from ..errors import ExportFileError
from .metrics import DEFINITIONS

FILES = ("profile_export_aiperf.json", "profile_export_aiperf.csv")
STATS = ("avg", "min", "max", "p1", "p5", "p10", "p25", "p50", "p75", "p90", "p95", "p99", "std",
         "count", "sum")
# kvlab figure -> (AIPerf tag, AIPerf's CSV display name, the stats compared)
PAIRS = {
    "ttft_ms": ("time_to_first_token", "Time to First Token", ("avg", "p50", "p90", "p99")),
    "tpot_ms": ("inter_token_latency", "Inter Token Latency", ("avg", "p50", "p90", "p99")),
    "itl_ms": ("inter_chunk_latency", "Inter Chunk Latency", ("avg", "p50", "p90", "p99")),
    "e2el_ms": ("request_latency", "Request Latency", ("avg", "p50", "p90", "p99")),
    "output_throughput": ("output_token_throughput", "Output Token Throughput", ("avg",)),
    "request_throughput": ("request_throughput", "Request Throughput", ("avg",)),
}
KVLAB_UNITS = {"output_throughput": "tokens/s", "request_throughput": "requests/s"}
REQUIRED = ("time_to_first_token", "request_latency")  # any streamed AIPerf run has these
# AIPerf unit -> factor to kvlab's unit (ms for latencies; per second for throughputs)
UNITS = {"ms": 1.0, "s": 1e3, "sec": 1e3, "us": 1e-3, "ns": 1e-6,
         "tokens/sec": 1.0, "tokens/s": 1.0, "requests/sec": 1.0, "requests/s": 1.0}
SCHEMA = {"metric": pl.String, "unit": pl.String, **{s: pl.Float64 for s in STATS}}
COMPARE_SCHEMA = {"figure": pl.String, "stat": pl.String, "unit": pl.String, "kvlab": pl.Float64,
                  "aiperf": pl.Float64, "diff": pl.Float64, "aiperf_metric": pl.String,
                  "definition": pl.String}


def read_aiperf(path) -> pl.DataFrame:
    """AIPerf's summary export as a frame, one row a metric tag: ``metric``, ``unit`` and the stat
    columns (:data:`STATS`; null where AIPerf wrote none). ``path`` is the JSON or CSV export or
    the artifact folder holding one (the JSON preferred).

    Example:
        >>> read_aiperf("tests/data/aiperf/profile_export_aiperf.json").filter(
        ...     pl.col("metric") == "time_to_first_token")["p50"][0]
        21.3
    """
    p = _export_file(Path(path))
    try:
        rows = _json_rows(p) if p.suffix == ".json" else _csv_rows(p)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, csv.Error) as e:
        raise ExportFileError(f"cannot read the AIPerf export {p}: {e}; pass the "
                              f"profile_export_aiperf.json (or .csv) AIPerf wrote") from e
    frame = pl.DataFrame(rows, schema=SCHEMA) if rows else pl.DataFrame(schema=SCHEMA)
    missing = [m for m in REQUIRED if m not in set(frame["metric"])]
    if missing:
        raise ExportFileError(f"the AIPerf export {p} has no {', '.join(missing)} metric; pass the "
                              f"summary export of a streamed run ({' or '.join(FILES)})")
    return frame


def compare(result, path) -> pl.DataFrame:
    """Both tools' figures side by side: one row a (figure, stat) with ``kvlab`` and ``aiperf``
    values in kvlab's units (ms; tokens/s; requests/s), ``diff`` = aiperf - kvlab,
    ``aiperf_metric`` (``tag.stat``) and the figure's ``definition``. ``result`` is a
    ``LoadResult`` or its ``summary`` dict; a figure either side lacks is null.

    Example:
        >>> compare(result, "artifacts/run").filter(pl.col("figure") == "ttft_ms")["diff"].to_list()
        [2.1, 1.8, 3.0, 4.4]
    """
    summary = result.summary if hasattr(result, "summary") else dict(result)
    theirs = {r["metric"]: r for r in read_aiperf(path).iter_rows(named=True)}
    rows = []
    for figure, (tag, _, stats) in PAIRS.items():
        block = theirs.get(tag)
        factor = _factor(block, path) if block else None
        for stat in stats:
            key = figure if figure.endswith("throughput") else f"{figure}_{'mean' if stat == 'avg' else stat}"
            mine = summary.get(key)
            value = block.get(stat) if block else None
            value = value * factor if value is not None else None
            unit = KVLAB_UNITS.get(figure, "ms")
            label = "value" if figure.endswith("throughput") else "mean" if stat == "avg" else stat
            rows.append({"figure": figure, "stat": label, "unit": unit,
                         "kvlab": mine, "aiperf": value,
                         "diff": value - mine if value is not None and mine is not None else None,
                         "aiperf_metric": f"{tag}.{stat}", "definition": DEFINITIONS[figure]})
    return pl.DataFrame(rows, schema=COMPARE_SCHEMA)


def _export_file(p: Path) -> Path:
    if p.is_dir():
        found = [p / f for f in FILES if (p / f).is_file()]
        if not found:
            raise ExportFileError(f"no AIPerf export in {p}: expected {' or '.join(FILES)} (AIPerf "
                                  f"writes them to its --artifact-dir)")
        return found[0]
    if not p.is_file():
        raise ExportFileError(f"the AIPerf export {p} does not exist; pass the profile_export_aiperf"
                              f".json or .csv AIPerf wrote, or the folder holding it")
    if p.suffix not in (".json", ".csv"):
        raise ExportFileError(f"the AIPerf export {p} is neither .json nor .csv; pass {' or '.join(FILES)}")
    return p


def _json_rows(p: Path) -> list[dict]:
    data = json.loads(p.read_text())
    if not isinstance(data, dict):
        raise ExportFileError(f"the AIPerf export {p} is not a JSON object of metric blocks")
    rows = []
    for tag, block in data.items():
        if isinstance(block, dict) and "unit" in block and "avg" in block:
            rows.append({"metric": tag, "unit": str(block["unit"]),
                         **{s: _num(block.get(s), p, f"{tag}.{s}") for s in STATS}})
    return rows


def _csv_rows(p: Path) -> list[dict]:
    """AIPerf's CSV: a header ``Metric,avg,min,...`` and one row a record metric named
    ``Display Name (unit)``; after a blank line, ``Metric,Value`` rows of scalar metrics."""
    by_name = {name.lower(): tag for tag, name, _ in PAIRS.values()}
    rows, header = [], None
    with p.open(newline="") as f:
        for line in csv.reader(f):
            if not line or not any(c.strip() for c in line):
                header = None
                continue
            if line[0].strip() == "Metric":
                header = [c.strip() for c in line]
                continue
            if header is None:
                continue
            name, _, unit = line[0].strip().rpartition(" (")
            name, unit = (name, unit.rstrip(")")) if name else (line[0].strip(), "")
            tag = by_name.get(name.lower(), name.lower().replace(" ", "_"))
            cells = dict(zip(header[1:], line[1:]))
            if header[1:] == ["Value"]:
                cells = {"avg": cells.get("Value")}
            rows.append({"metric": tag, "unit": unit,
                         **{s: _num(cells.get(s), p, f"{tag}.{s}") for s in STATS}})
    return rows


def _num(v, p: Path, what: str) -> float | None:
    if v is None or v == "":
        return None
    try:
        x = float(str(v).replace(",", "")) if not isinstance(v, bool) else None
    except ValueError:
        x = None
    if x is None or not math.isfinite(x):
        raise ExportFileError(f"the AIPerf export {p} has {what} = {v!r}, not a number")
    return x


def _factor(block: dict, path) -> float:
    unit = (block.get("unit") or "").strip()
    if unit not in UNITS:
        raise ExportFileError(f"the AIPerf export {path} gives {block['metric']} in {unit!r}, a unit "
                              f"kvlab does not convert (known: {', '.join(UNITS)})")
    return UNITS[unit]
