"""Recording real traffic: one JSON line per finished request, Mooncake fields first.

Each line holds the four Mooncake fields ``kv.traces.read`` needs (``timestamp`` in ms since the
epoch at arrival, ``input_length``, ``output_length``, ``hash_ids``: chained hashes of 512-token
blocks, the last one covering a trailing partial block) plus kvlab's own: ``kvlab_hash_ids`` at
``kvlab_block_size`` (16 unless the server was given another), arrival and finish times (epoch
seconds), ``ttft_s`` and ``e2e_s`` measured by the server, ``reused_tokens`` (what the prompt cache
served), ``match``, ``status`` (``ok`` or ``disconnected``), ``finish_reason``, the API used,
``store``, ``budget_bytes``, ``normalise``, the model and its fingerprint, and ``tenant``. On a
server of tenants the hash ids are those of the request's key, its tenant's salt included: equal
prompts of two tenants get different hash ids, as they got different KV, so a simulator replaying
the file shares exactly what the server shared, and the file reveals no tenant's prompt as equal
to another's (salts are keyed with the server's secret). Token ids
(``prompt_ids``, ``output_ids``), the request's messages and the output text only with
``record_text=True``: traffic can be private.

A hash id is the first 63 bits of kvlab's chained xxh3-128 block hash (``kv.traces.
chained_hashes``), not a per-file counter, so a file appended to by several runs stays consistent:
equal ids at equal positions are equal prefixes, whichever run wrote them.

Lines are written whole: one ``os.write`` of the complete line on a file opened with O_APPEND,
under a lock, as soon as the request finishes, so stopping the server (Ctrl-C, SIGTERM) loses no
finished request and a reader never sees half a line.

Example:
    >>> with kv.serve("tiny", "radix", record="runs/radix.jsonl") as server: ...
    >>> t = kv.traces.read("runs/radix.jsonl")                      # Mooncake fields, 512 blocks
    >>> t16 = kv.traces.read("runs/radix.jsonl", block_size=16, hash_field="kvlab_hash_ids")
    >>> kv.simulate(t16, "lru")
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from ..errors import KvlabError
from ..request import Request, Workload
from ..primitives.blocks import chained_hashes
from ..experiments.traces import MOONCAKE_BLOCK_SIZE
from ..primitives.display import summary_html

ID_BITS = (1 << 63) - 1


def hash_ids(ids, block_size: int, key=None) -> list[int]:
    """Chained block hashes of ``ids`` as non-negative 63-bit ints (see module docstring), in the
    namespace of ``key`` (a ``kv.CacheKey`` of these ids: its salt and extra keys) when given.

    Example:
        >>> len(hash_ids(range(1000), 512))
        2
    """
    salt, spans = (key.salt, key.extra_keys) if key is not None else (None, ())
    hashes = chained_hashes(list(ids), block_size, key=salt, extra_keys=spans)
    return [int.from_bytes(h[:8], "little") & ID_BITS for h in hashes]


class Recorder:
    """Appends one JSON line per finished request to ``path`` (see module docstring)."""

    def __init__(self, path, *, record_text: bool = False, block_size: int = 16):
        self.path = Path(path)
        self.record_text = record_text
        self.block_size = block_size
        self.lines = 0
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise KvlabError(f"cannot record to {self.path}: {e.strerror}; pass a writable path "
                             "(its folder is created if missing)") from e

    def line(self, rec: dict) -> dict:
        """The JSON object written for one finished request (``rec``: the ledger's fields)."""
        prompt, output = rec.pop("prompt_ids"), rec.pop("output_ids")
        messages, text = rec.pop("messages", None), rec.pop("text", "")
        key = rec.pop("key", None)
        if key is not None and tuple(key.ids) != tuple(prompt):
            key = None  # a key of other ids (never expected) must not salt these
        out = {"timestamp": int(rec["arrival"] * 1000), "input_length": len(prompt),
               "output_length": len(output), "hash_ids": hash_ids(prompt, MOONCAKE_BLOCK_SIZE, key),
               "kvlab_block_size": self.block_size, "kvlab_hash_ids": hash_ids(prompt, self.block_size, key),
               **rec}
        if self.record_text:
            out.update(prompt_ids=list(prompt), output_ids=list(output), messages=messages, text=text)
        return out

    def write(self, rec: dict) -> None:
        data = (json.dumps(self.line(dict(rec)), separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            if self._fd is None:
                raise KvlabError(f"the recorder for {self.path} is closed")
            view = memoryview(data)
            while view:  # one write of the whole line; loop only if the kernel took part of it
                view = view[os.write(self._fd, view):]
            self.lines += 1

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None

    def __repr__(self) -> str:
        text = ", with text" if self.record_text else ""
        return f"Recorder({self.path}, {self.lines} lines{text})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def read_records(path) -> list[dict]:
    """Every line of a recording as a dict (all fields, not only Mooncake's).

    Example:
        >>> read_records("runs/radix.jsonl")[0]["reused_tokens"]
        0
    """
    path = Path(path)
    if not path.is_file():
        raise KvlabError(f"no recording at {path}")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise KvlabError(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
    return out


def workload(path, *, name: str | None = None) -> Workload:
    """The recorded requests as a Workload of token ids for ``kv.Engine(...).run_all`` (needs a
    recording made with ``record_text=True``; ``max_tokens`` is each request's output length).

    Example:
        >>> engine.run_all(kv.serving.record.workload("runs/radix.jsonl"))
    """
    recs = read_records(path)
    missing = [i for i, r in enumerate(recs) if "prompt_ids" not in r]
    if missing:
        raise KvlabError(f"{path}: line {missing[0] + 1} has no prompt_ids; replaying through an "
                         "Engine needs a recording made with --record-text (record_text=True)")
    reqs = tuple(Request(ids=tuple(r["prompt_ids"]), max_tokens=max(1, r["output_length"]),
                         name=f"r{r.get('request', i)}") for i, r in enumerate(recs))
    return Workload(name or Path(path).stem, reqs)
