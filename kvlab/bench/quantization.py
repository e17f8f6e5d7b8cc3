"""Quantized KV caches: snapshot save/load throughput (float vs quantized, same cached length) and
what the quantization sweep costs (its teacher-forced runs per KV format, and a whole sweep),
side by side in one run, interleaved over repeats."""

from __future__ import annotations

import os
import tempfile

from ..primitives import timing
from .settings import Settings
from .table import Table, ms, spread

NEEDS_MODEL = True
COLUMNS = ("operation", "kv format", "MiB", "ms median ± pstdev (min-max)", "MB/s (median)", "time vs float")


def _formats(shapes) -> list[tuple[int | None, int | None]]:
    from ..quantization import valid_group_sizes

    groups = valid_group_sizes(shapes)
    if not groups:
        return []
    g = 64 if 64 in groups else groups[0]
    return [(None, None), (8, g), (4, g)]


def _name(bits, group) -> str:
    return "float" if bits is None else f"q{bits}g{group}"


def bench_quantized_files(model, repeats: int, tokens: int = 1024) -> list[tuple]:
    """Rows: save and load of a ``tokens``-token snapshot per KV format (random KV in the model's
    shapes; file I/O cost depends on sizes, not values), with MB/s of the file written or read.

    Example:
        >>> bench_quantized_files(kv.load(), 2, tokens=256)[0][:2]
        ('save 256-token snapshot', 'float32')
    """
    from ..quantization import attention_shapes, quantize
    from ..primitives.kv_format import kv_format
    from ..primitives.snapshot_files import load_snapshot, save
    from ..primitives.snapshots import snapshot
    from .snapshot import filled_cache

    formats = _formats(attention_shapes(model))
    base = snapshot(filled_cache(model, tokens), model=model)
    snaps = {f: base if f[0] is None else quantize(base, *f) for f in formats}
    saves, loads, sizes = ({f: [] for f in formats} for _ in range(3))
    with tempfile.TemporaryDirectory(prefix="kvlab-bench-") as d:
        for r in range(max(repeats, 3)):
            for f, snap in snaps.items():  # interleaved, so drift hits every format alike
                path = os.path.join(d, f"{_name(*f)}-{r}.safetensors")
                t = timing.timed()
                save(snap, path)
                saves[f].append(t.done())
                t = timing.timed()
                load_snapshot(path, model, kv_format=kv_format(snap))
                loads[f].append(t.done())
                sizes[f] = os.path.getsize(path)
                os.remove(path)
    rows = []
    for op, times in ((f"save {tokens}-token snapshot", saves), (f"load {tokens}-token snapshot", loads)):
        ref = spread(times[formats[0]])["median"]
        for f in formats:
            s = spread(times[f])
            rows.append((op, kv_format(snaps[f]), sizes[f] / 2**20, ms(s), sizes[f] / s["median"] / 1e6,
                         f"{s['median'] / ref:.2f}x"))
    return rows


def bench_sweep_cost(model, repeats: int, prefix: int = 64, eval_tokens: int = 32) -> list[tuple]:
    """Rows: the sweep's teacher-forced run (``eval_tokens`` tokens over a ``prefix``-token cache)
    per KV format, and one whole ``kv.quantization_sweep`` over those formats.

    Example:
        >>> bench_sweep_cost(kv.load(), 2)[-1][0]
        'whole quantization_sweep (1 text, 2 formats + float)'
    """
    from ..quantization import SAMPLE_TEXTS, attention_shapes, quantization_sweep

    formats = _formats(attention_shapes(model))[1:]
    bits, group = tuple(b for b, _ in formats), formats[0][1]
    quantization_sweep(model, SAMPLE_TEXTS[:1], bits=bits, group_sizes=(group,), lengths=(prefix,),
                       eval_tokens=eval_tokens)  # warm-up: first calls compile kernels
    per_format, whole = {}, []
    for _ in range(max(repeats, 3)):
        t = timing.timed()
        df = quantization_sweep(model, SAMPLE_TEXTS[:1], bits=bits, group_sizes=(group,),
                                lengths=(prefix,), eval_tokens=eval_tokens)
        whole.append(t.done())
        for fmt, secs in zip(df["kv_format"], df["seconds"]):
            per_format.setdefault(fmt, []).append(secs)
    ref = spread(next(iter(per_format.values())))["median"]
    rows = [(f"teacher-forced {eval_tokens} tokens on a {prefix}-token cache", fmt, "-", ms(spread(v)), "-",
             f"{spread(v)['median'] / ref:.2f}x") for fmt, v in per_format.items()]
    rows.append((f"whole quantization_sweep (1 text, {len(bits)} formats + float)", "all", "-",
                 ms(spread(whole)), "-", "-"))
    return rows


def table(s: Settings) -> Table:
    from ..quantization import attention_shapes

    model = s.model
    title = f"quantized KV: snapshot files and sweep cost, model {model.name}"
    command = f"kvlab bench --only quantization --model {model.name} --repeats {s.repeats}"
    if not _formats(attention_shapes(model)):
        return Table(title, command, COLUMNS, (("n/a", "-", "-", "-", "-", "-"),),
                     f"{model.name}'s head dimension is divisible by no mlx group size (32/64/128): its KV "
                     "cannot be quantized. Run with --model smollm2.")
    rows = bench_quantized_files(model, s.repeats) + bench_sweep_cost(model, s.repeats)
    return Table(title, command, COLUMNS, tuple(rows),
                 "Files: random KV in the model's shapes, written with kv.save and read back with "
                 "kv.load_snapshot (digest checked) right away, so reads come from the OS page cache. "
                 "MB/s counts the file's own bytes (a quantized file holds the same tokens in fewer "
                 "bytes, and more arrays: packed words, scales and biases). Sweep: the per-format run times come from the sweep's "
                 "own `seconds` column; the quantized runs use mlx's quantized attention kernels.")
