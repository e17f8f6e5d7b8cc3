"""Conformance: every cache family x every store x every workload, reused exactly or refused with
a reason that names the layer, never a silent zero and never a wrong answer.

One cell runs a workload through ``kv.Engine(verify=True)`` on a tiny model of one family
(``kvlab.models.families``) with one store, and compares every request's logits with a cold
prefill. It is

- ``exact``: it reused tokens and every request's logits are within ``TOLERANCE`` of cold;
- ``refused``: it reused nothing and says which layer kind prevents it;
- ``wrong``: some request's logits moved beyond ``TOLERANCE`` (the worst bug);
- ``silent zero``: it reused nothing and no reason names a layer (the second worst).

``TOLERANCE`` is 1e-4 on float32 logits of magnitude ~2 (``kvlab.primitives.tolerance``, the
table for every dtype; the tiny models run in float32): restored KV is bitwise the KV a cold
prefill computes, so the only differences are the order of float additions when a prefill runs
in two pieces instead of one.

Example:
    >>> frame = run_conformance(["qwen3", "mamba2"], ["radix", "paged"], ["multi_turn"])
    >>> frame.select("model_type", "store", "status", "reused_tokens")      # doctest: +SKIP
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import polars as pl

from ..engine import Engine
from ..errors import KvlabError
from ..models.families import FAMILY_OF, MODEL_TYPES
from ..models.loading import load
from ..primitives.display import summary_html, table_html
from ..primitives.tolerance import tolerance
from ..stores import STORE_NAMES, make_store
from ..workloads import agentic_loop, branching, multi_turn

TOLERANCE = tolerance("float32")
STORES = tuple(n for n in STORE_NAMES if n != "none")
# small enough to run every cell in seconds, long enough to wrap 32-token windows and chunks
WORKLOADS = {
    "multi_turn": lambda: multi_turn(4, system_tokens=48, user_tokens=24, reply_tokens=32, max_tokens=4),
    "agentic_loop": lambda: agentic_loop(4, system_tokens=96, tools=1, result_tokens=32,
                                         billing_header=False, max_tokens=4),
    "branching": lambda: branching(3, system_tokens=48, user_tokens=24, reply_tokens=32, max_tokens=4),
}
LAYER_WORDS = re.compile(r"sliding window|recurrent|chunked|CacheList|RotatingKVCache|ArraysCache|"
                         r"ChunkedKVCache|layer \d+")
STATUSES = ("exact", "refused", "wrong", "silent zero")
BUDGET = 256 << 20


@dataclass(frozen=True)
class Cell:
    """One family x store x workload: what it reused, how far its logits moved, and why it missed."""

    model_type: str
    family: str
    store: str
    workload: str
    requests: int
    prompt_tokens: int
    reused_tokens: int
    max_logit_diff: float
    status: str
    reason: str

    def _repr_html_(self) -> str:
        return summary_html(f"{self.model_type} x {self.store} x {self.workload}", self.status,
                            f"{self.reused_tokens}/{self.prompt_tokens} tokens reused",
                            f"max logit diff {self.max_logit_diff:.1e}", note=self.reason)


def _reason(engine: Engine) -> str:
    """The first explanation that names a layer: the store's refusal of the layout, a refused
    match or offer, a miss reason."""
    if engine.core.store_refuses:
        return engine.core.store_refuses
    events = engine.events
    if len(events):
        detailed = events.filter(pl.col("event").is_in(["refused", "offer_refused", "refuse"]))
        for detail in detailed["detail"].to_list():
            if detail and LAYER_WORDS.search(detail):
                return detail
    for result in engine.results:
        if result.why and LAYER_WORDS.search(result.why):
            return result.why
    return ""


def classify(reused: int, max_diff: float, reason: str, dtype: str = "float32") -> str:
    """A cell's status (module docstring) from what it reused, its logit error (judged by the
    tolerance of the model's ``dtype``) and its reason."""
    if max_diff > tolerance(dtype):
        return "wrong"
    if reused > 0:
        return "exact"
    return "refused" if LAYER_WORDS.search(reason or "") else "silent zero"


def run_cell(model_type: str, store: str, workload: str, *, folder: Path | None = None) -> Cell:
    """Run one cell (module docstring); ``folder`` holds the disk stores' files (a temporary
    folder by default)."""
    model = load(f"tiny:{model_type}")
    with tempfile.TemporaryDirectory(prefix="kvlab-conformance-") as tmp:
        where = Path(folder or tmp) / f"{model_type}-{store}-{workload}"
        kv_store = make_store(store, budget_bytes=BUDGET, disk_path=where, model=model)
        engine = Engine(model, store=kv_store, verify=True, max_tokens=4)
        results = [engine.run(request) for request in WORKLOADS[workload]()]
        if kv_store is not None:
            kv_store.flush()
    reused = sum(r.reused_tokens for r in results)
    diff = max(r.verify_diff or 0.0 for r in results)
    reason = _reason(engine)
    return Cell(model_type, FAMILY_OF[model_type], store, workload, len(results),
                sum(r.prompt_tokens for r in results), reused, diff, classify(reused, diff, reason, model.dtype), reason)


def check_names(model_types, stores, workloads) -> tuple[list[str], list[str], list[str]]:
    """The three lists, checked: a KvlabError names what is unknown and what exists."""
    for what, given, known in (("model type", model_types, MODEL_TYPES), ("store", stores, STORES),
                               ("workload", workloads, tuple(WORKLOADS))):
        unknown = [name for name in given if name not in known]
        if unknown or not given:
            raise KvlabError(f"unknown {what} {', '.join(map(repr, unknown)) or '(none given)'}; "
                             f"use any of {', '.join(known)}")
    return list(model_types), list(stores), list(workloads)


def run_conformance(model_types=MODEL_TYPES, stores=STORES, workloads=tuple(WORKLOADS), *,
                    progress=None) -> pl.DataFrame:
    """Every cell of model_types x stores x workloads as one frame (one row per ``Cell``)."""
    rows = []
    for model_type in model_types:
        for store in stores:
            for workload in workloads:
                cell = run_cell(model_type, store, workload)
                rows.append(asdict(cell))
                if progress:
                    progress(cell)
    return pl.DataFrame(rows)


def summary(frame: pl.DataFrame) -> dict[str, int]:
    """How many cells have each status."""
    counts = dict(frame.group_by("status").len().iter_rows())
    return {s: int(counts.get(s, 0)) for s in STATUSES}


def markdown(frame: pl.DataFrame, command: str) -> str:
    """The conformance table as Markdown: one row per family, one column per store, each cell
    the statuses of its workloads; then every refusal with its reason."""
    counts = summary(frame)
    workloads = list(dict.fromkeys(frame["workload"].to_list()))
    stores = list(dict.fromkeys(frame["store"].to_list()))
    mark = {"exact": "exact", "refused": "refused", "wrong": "**WRONG**", "silent zero": "**silent 0**"}
    lines = [f"Generated by `{command}`. Workloads per cell: {', '.join(workloads)}; tolerance "
             f"{TOLERANCE:g} on the max logit difference against cold prefill.", "",
             "Cells: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" (of {len(frame)}).", "",
             "| model type | family | " + " | ".join(stores) + " |",
             "|---|---|" + "---|" * len(stores)]
    for model_type in dict.fromkeys(frame["model_type"].to_list()):
        rows = frame.filter(pl.col("model_type") == model_type)
        cells = []
        for store in stores:
            got = rows.filter(pl.col("store") == store)
            statuses = [mark[s] for s in got["status"].to_list()]
            reused = int(got["reused_tokens"].sum())
            cells.append(("/".join(dict.fromkeys(statuses))) + f" ({reused})")
        lines.append(f"| {model_type} | {rows['family'][0]} | " + " | ".join(cells) + " |")
    refused = frame.filter(pl.col("status") != "exact").unique(["model_type", "store"], keep="first",
                                                                maintain_order=True)
    if len(refused):
        lines += ["", "Cells that did not reuse exactly, and why:", ""]
        lines += [f"- {r['model_type']} x {r['store']} ({r['workload']}): {r['status']}: "
                  f"{r['reason'] or 'no reason given'}" for r in refused.iter_rows(named=True)]
    return "\n".join(lines) + "\n"


def frame_html(frame: pl.DataFrame) -> str:
    counts = summary(frame)
    rows = [(r["model_type"], r["store"], r["workload"], r["status"], r["reused_tokens"],
             f"{r['max_logit_diff']:.1e}") for r in frame.iter_rows(named=True)]
    return summary_html("Conformance", ", ".join(f"{n} {s}" for s, n in counts.items()),
                        body=table_html(["model", "store", "workload", "status", "reused", "max diff"], rows))
