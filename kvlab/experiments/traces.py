"""Mooncake-format request traces: read them, write them, make them from any workload.

One JSON object a line: ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``,
chained prefix-block hashes remapped to small integers (block size 512; the last id may cover a
partial block). Equal ids at the same position mean the same prefix, so the KV is reusable.

Example:
    >>> t = kv.traces.read()                     # the public Mooncake synthetic trace
    >>> len(t), t.block_size
    (3993, 512)
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import polars as pl

from ..primitives.blocks import chained_hashes
from ..primitives.display import Html, summary_html, table_html
from ..primitives.files import atomic_write_with
from ..errors import BlockSizeError, TraceError

MOONCAKE_BLOCK_SIZE = 512
DEFAULT_TRACE = "synthetic_trace.jsonl"
VENDORED = Path(__file__).resolve().parents[2] / "data" / "traces"
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
SCHEMA = {"timestamp": pl.Int64, "input_length": pl.Int64, "output_length": pl.Int64,
          "hash_ids": pl.List(pl.Int64)}


@dataclass(frozen=True, eq=False)
class Trace:
    """A request trace: ``frame`` has one row a request with the four Mooncake columns.

    Example:
        >>> t = kv.traces.from_requests([list(range(1000)), list(range(600))], 16, block_size=512)
        >>> t.frame["hash_ids"].to_list()
        [[0, 1], [0, 2]]
    """

    frame: pl.DataFrame
    block_size: int = MOONCAKE_BLOCK_SIZE
    source: str | None = None

    def __len__(self) -> int:
        return self.frame.height

    @property
    def tokens(self) -> int:
        """Total prompt tokens."""
        return int(self.frame["input_length"].sum() or 0)

    @property
    def blocks(self) -> int:
        """Total hash ids (block references) over all requests."""
        return int(self.frame["hash_ids"].list.len().sum() or 0)

    @property
    def distinct_blocks(self) -> int:
        return int(self.frame["hash_ids"].explode().drop_nulls().n_unique()) if len(self) else 0

    def block_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """All hash ids flat (int64, shape [blocks]) and each request's start in it
        (int64, shape [requests + 1]): request i owns ``flat[offsets[i]:offsets[i+1]]``."""
        lengths = self.frame["hash_ids"].list.len().fill_null(0).to_numpy().astype(np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = self.frame["hash_ids"].explode().drop_nulls().to_numpy().astype(np.int64)
        return flat, offsets

    def to_token_blocks(self) -> list[np.ndarray]:
        """Per-request arrays of hash ids (views into one flat int64 array)."""
        flat, offsets = self.block_arrays()
        return [flat[offsets[i]:offsets[i + 1]] for i in range(len(self))]

    def head(self, n: int) -> Trace:
        return Trace(self.frame.head(n), self.block_size, self.source)

    def repeat(self, times: int, *, shift_ids: bool = True) -> Trace:
        """The trace ``times`` times back to back; with ``shift_ids`` each copy gets fresh ids
        (no sharing between copies), otherwise later copies re-request the same blocks.
        Timestamps continue after the previous copy's last one.

        Example:
            >>> len(kv.traces.read().repeat(3))
            11979
        """
        if times < 1:
            raise TraceError(f"times must be >= 1, got {times!r}")
        f = self.frame
        id_span = (int(f["hash_ids"].explode().max() or 0) + 1) if shift_ids else 0
        t_span = int(f["timestamp"].max() or 0) + 1 if len(self) else 0
        copies = [f.with_columns(pl.col("timestamp") + k * t_span,
                                 (pl.col("hash_ids").list.eval(pl.element() + k * id_span)))
                  for k in range(times)]
        return Trace(pl.concat(copies), self.block_size, self.source)

    def write(self, path) -> Path:
        """Write Mooncake JSONL atomically (a temporary file, then ``os.replace``).

        Example:
            >>> t.write("out/trace.jsonl")
            PosixPath('out/trace.jsonl')
        """
        return atomic_write_with(path, self.frame.select(FIELDS).write_ndjson)

    def __repr__(self) -> str:
        return (f"Trace({len(self)} requests, {_si(self.tokens)} tokens, "
                f"{_si(self.distinct_blocks)} distinct blocks, block_size={self.block_size})")

    def _repr_html_(self) -> str:
        src = Html(f"<code>{html.escape(self.source)}</code>") if self.source else None
        head = self.frame.head(5).with_columns(
            pl.col("hash_ids").list.len().alias("n_ids"),
            pl.col("hash_ids").list.head(6).cast(pl.List(pl.String)).list.join(",").alias("hash_ids"))
        return summary_html("Trace", f"{len(self):,} requests", f"{self.tokens:,} prompt tokens",
                            f"{self.distinct_blocks:,} distinct blocks of {self.block_size}", src,
                            body=table_html(head.columns, head.rows()))


def locate(name: str = DEFAULT_TRACE) -> Path:
    """Where a public trace lives: ``$KVLAB_TRACES/name`` when set and present, else the copy
    vendored in the repository's ``data/traces/``. Raises TraceError when it is in neither place.

    Example:
        >>> kv.traces.locate().name
        'synthetic_trace.jsonl'
    """
    tried = []
    env = os.environ.get("KVLAB_TRACES")
    if env:
        tried.append(Path(env) / name)
    tried.append(VENDORED / name)
    for p in tried:
        if p.is_file():
            return p
    raise TraceError(f"trace {name!r} not found; looked in {', '.join(map(str, tried))}. "
                     "Set KVLAB_TRACES to the folder that holds it, or pass the file's path")


def read(path=None, *, block_size: int = MOONCAKE_BLOCK_SIZE, hash_field: str = "hash_ids") -> Trace:
    """Read a Mooncake-format JSONL trace (lazily, with polars). ``path=None`` reads the public
    synthetic trace found by :func:`locate`. Malformed lines raise TraceError naming line and field.
    Fields beyond Mooncake's four are ignored; ``hash_field`` reads the block ids from another
    field (a ``kvlab serve`` recording's ``kvlab_hash_ids``, at its ``kvlab_block_size``).

    Example:
        >>> t = kv.traces.read()
        >>> t
        Trace(3993 requests, ...)
    """
    block_size = _check_block_size(block_size)
    if hash_field != "hash_ids":
        return _read_field(path, block_size, hash_field)
    path = locate() if path is None else Path(path)
    if not path.is_file():
        raise TraceError(f"trace file {str(path)!r} does not exist; pass the path of a Mooncake "
                         "JSONL file or set KVLAB_TRACES")
    try:
        frame = pl.scan_ndjson(path, schema=SCHEMA).select(FIELDS).collect()
    except Exception as e:  # polars reports neither line nor field; find them ourselves
        _diagnose(path)
        raise TraceError(f"{path}: cannot read as Mooncake JSONL ({type(e).__name__}: {e})") from e
    bad = frame.with_row_index("row").filter(
        pl.any_horizontal(pl.col(c).is_null() for c in FIELDS) | (pl.col("input_length") < 1)
        | (pl.col("output_length") < 0) | pl.col("hash_ids").list.eval(pl.element() < 0).list.any())
    if bad.height:
        _diagnose(path)
        raise TraceError(f"{path}: row {int(bad['row'][0])} is malformed; every line needs "
                         f"{', '.join(FIELDS)}")
    return Trace(frame, block_size, str(path))


def _read_field(path, block_size: int, hash_field: str) -> Trace:
    path = Path(path) if path is not None else locate()
    schema = {**{k: v for k, v in SCHEMA.items() if k != "hash_ids"}, hash_field: SCHEMA["hash_ids"]}
    try:
        frame = (pl.scan_ndjson(path, schema=schema).select(*FIELDS[:3], hash_field)
                 .rename({hash_field: "hash_ids"}).collect())
    except Exception as e:  # noqa: BLE001  polars names neither line nor field
        raise TraceError(f"{path}: cannot read as JSONL with a {hash_field!r} field "
                         f"({type(e).__name__}: {e})") from e
    if frame["hash_ids"].null_count():
        row = int(frame.with_row_index("row").filter(pl.col("hash_ids").is_null())["row"][0])
        raise TraceError(f"{path}: line {row + 1} has no {hash_field!r} field")
    return Trace(frame, block_size, str(path))


def from_requests(requests: Sequence[Sequence[int]], output_lengths=0, block_size: int = MOONCAKE_BLOCK_SIZE,
                  timestamps=None, *, keys: Sequence | None = None, spans: Sequence | None = None) -> Trace:
    """A Mooncake trace from token-id sequences: each request's chained block hashes
    (``kv.block_hashes`` for full blocks, plus one for a trailing partial block) remapped to
    consecutive integers in order of first appearance.

    ``output_lengths`` is one int or one per request; ``timestamps`` default to 0, 1, 2, ... ms;
    ``keys`` (one per request: a salt, LoRA id, ...) joins the first block so different keys
    never share blocks; ``spans`` (one tuple per request of ``(token_start, token_end, key)``)
    join the blocks they overlap, as ``kv.CacheKey`` extra keys do (a tenant salt that starts after
    a public prefix: kvlab.tenants).

    Example:
        >>> t = kv.traces.from_requests([[1] * 40, [1] * 36], 8, block_size=16)
        >>> t.frame["hash_ids"].to_list()
        [[0, 1, 2], [0, 1, 3]]
    """
    block_size = _check_block_size(block_size)
    n = len(requests)
    outs = [int(output_lengths)] * n if np.isscalar(output_lengths) else [int(x) for x in output_lengths]
    ts = list(range(n)) if timestamps is None else [int(x) for x in timestamps]
    ks = [None] * n if keys is None else list(keys)
    sp = [()] * n if spans is None else [tuple(x or ()) for x in spans]
    if len(sp) != n:
        raise TraceError(f"{n} requests but {len(sp)} span lists; pass one per request")
    if not len(outs) == len(ts) == len(ks) == n:
        raise TraceError(f"{n} requests but {len(outs)} output lengths, {len(ts)} timestamps and "
                         f"{len(ks)} keys; pass one of each per request")
    remap: dict[bytes, int] = {}
    rows_ids, lengths = [], []
    for i, seq in enumerate(requests):
        if len(seq) == 0:
            raise TraceError(f"request {i} has no tokens; every request needs at least one")
        hashes = chained_hashes(seq, block_size, key=ks[i], extra_keys=sp[i])
        rows_ids.append([remap.setdefault(h, len(remap)) for h in hashes])
        lengths.append(len(seq))
    frame = pl.DataFrame({"timestamp": ts, "input_length": lengths, "output_length": outs,
                          "hash_ids": rows_ids}, schema=SCHEMA)
    return Trace(frame, block_size, None)


def from_workload(workload, tokenizer=None, block_size: int = MOONCAKE_BLOCK_SIZE) -> Trace:
    """Any workload tokenised and exported as a trace (chat workloads need a ``tokenizer``).

    Example:
        >>> kv.traces.from_workload(kv.workloads.prefix_repetition(), block_size=16)
        Trace(10 requests, ...)
    """
    ids = workload.token_ids(tokenizer)
    keys = [(r.salt, r.extra_keys) if (r.salt is not None or r.extra_keys) else None
            for r in workload.requests]
    t = from_requests(ids, [r.max_tokens for r in workload.requests], block_size, keys=keys)
    return Trace(t.frame, block_size, f"workload:{workload.name}")


def _check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise BlockSizeError(f"block_size must be a positive int (Mooncake traces use 512), "
                             f"got {block_size!r}")
    return int(block_size)


def _diagnose(path: Path) -> None:
    """Raise TraceError for the first line that is not a valid Mooncake record."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                                 "each line must be one JSON object") from None
            if not isinstance(rec, dict):
                raise TraceError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            for field in FIELDS:
                if field not in rec or rec[field] is None:
                    raise TraceError(f"{path}:{lineno}: missing field {field!r}; Mooncake records "
                                     f"need {', '.join(FIELDS)}")
            for field in FIELDS[:3]:
                v = rec[field]
                if isinstance(v, bool) or not isinstance(v, int):
                    raise TraceError(f"{path}:{lineno}: field {field!r} must be an integer, got {v!r:.40}")
            if rec["input_length"] < 1:
                raise TraceError(f"{path}:{lineno}: field 'input_length' must be >= 1, "
                                 f"got {rec['input_length']}")
            if rec["output_length"] < 0:
                raise TraceError(f"{path}:{lineno}: field 'output_length' must be >= 0, "
                                 f"got {rec['output_length']}")
            ids = rec["hash_ids"]
            if not isinstance(ids, list) or not all(
                    isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids):
                raise TraceError(f"{path}:{lineno}: field 'hash_ids' must be a list of integers "
                                 f">= 0, got {str(ids):.60}")


def _si(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
