"""Bench sections for KV-cache presses (issue 32), on the bench's model (SmolLM2 by default):

- ``press_bytes``: KV bytes each press holds at 25/50/75% against ``(1 - ratio)`` of the full
  cache (target: the scorer presses within one row per KV head per layer);
- ``press_time``: compression cost against a plain prefill (target <= 10%): the press's capture
  during prefill (window queries, attention sums, query statistics) plus its scoring and gathering;
- ``press_decode``: greedy decode tokens/s at a long context, full cache against compressed;
- ``press_quality``: per press and ratio, teacher-forced KL / top-1 / ΔNLL over a continuation that
  copies a passage back, and needle and variable-tracking accuracy gated on the uncompressed
  model, beside its own (``kvlab.presses.battery``).

Example:
    >>> t = kv.bench.run("tiny", repeats=1, only=["press_bytes"])[0]
    >>> t.values["presses"]["knorm"]["0.5"]["rows"]                     # doctest: +SKIP
"""

from __future__ import annotations

from ..primitives import timing
from ..primitives.snapshots import prefill, restore
from .families import Section
from .settings import Settings
from .table import Table, median_range, spread

RATIOS = (0.25, 0.5, 0.75)
SCORERS = ("knorm", "streaming_llm", "snapkv", "expected_attention", "tova", "observed_attention", "keydiff",
           "lagkv", "random")
WRAPPED = ("pyramid", "chunkkv", "adakv")
BYTES_TOKENS, TIME_TOKENS, DECODE_TOKENS, QUALITY_TOKENS = 1024, 1024, 4096, 1024


def _press(name: str, ratio: float):
    from ..presses import press

    return press(name, ratio, **({"press": "knorm"} if name in ("chunkkv",) else {}))


def _kv_geometry(model) -> tuple[int, int]:
    """(bytes of one row of one KV head in one layer, full-attention layers) of ``model``."""
    from ..presses.apply import full_layers

    cache = model.make_cache()
    prefill(model, [1, 2], cache)
    layers = full_layers(cache)
    k = layers[0][2].keys
    return 2 * int(k.shape[-1]) * k.dtype.size, len(layers)


def bench_bytes(model, tokens: int = BYTES_TOKENS, names=SCORERS + WRAPPED, ratios=RATIOS) -> Table:
    """KV bytes held after each press at each ratio, against (1 - ratio) of the full cache."""
    from ..presses.compress import Prefilled
    from ..presses.quality import document

    ids, _ = document(model, tokens)
    grid = {(n, r): _press(n, r) for n in names for r in ratios}
    pre = Prefilled(model, ids, list(grid.values()))
    row_bytes, layers = _kv_geometry(model)
    heads = model.config.get("num_key_value_heads") or model.config["num_attention_heads"]
    tolerance = row_bytes * heads * layers  # one row per KV head in every layer
    rows, values = [], {}
    for (name, ratio), p in grid.items():
        c = pre.compress(p)
        target = (1 - ratio) * c.bytes_full
        off = c.bytes_kept - target
        rows.append((name, f"{ratio:.0%}", f"{c.kept_tokens:.1f}", f"{c.bytes_full / 2**20:.2f}",
                     f"{c.bytes_kept / 2**20:.3f}", f"{target / 2**20:.3f}",
                     f"{off / row_bytes / heads / layers:+.2f}"))
        values.setdefault(name, {})[str(ratio)] = {"bytes_full": c.bytes_full, "bytes_kept": c.bytes_kept,
                                                   "target": target, "rows": c.kept_tokens,
                                                   "within": abs(off) <= tolerance}
    return Table(f"KV bytes a press holds vs (1 - ratio) of the full cache ({len(ids)} tokens, {model.name})",
                 f"kvlab bench --only press_bytes --model {model.name}",
                 ("press", "ratio", "rows per head", "full MiB", "kept MiB", "target MiB",
                  "off (rows per head per layer)"),
                 tuple(rows), "Scorer presses keep int(T(1-ratio)) rows of every KV head (kvpress's rule), so "
                 "they sit within one row; pyramid spreads the same total over layers; chunkkv keeps whole "
                 "chunks; adakv masks and frees nothing (as kvpress's; compact=True frees down to its "
                 "largest head). Bytes count keys and values; the kept positions' index adds 4 B per row "
                 "per head.",
                 values={"presses": values, "tolerance": tolerance, "scorers": list(SCORERS), "model": model.name})


def bench_time(model, repeats: int, tokens: int = TIME_TOKENS, names=SCORERS + WRAPPED) -> Table:
    """Compression time against a plain prefill of the same prompt, each press at 0.5; beside it,
    what reading the prompt's queries during prefill adds (query-aware presses only)."""
    from ..presses.compress import Prefilled
    from ..presses.quality import document

    ids, _ = document(model, tokens)
    plain = []
    per = {n: {"compress": [], "capture": []} for n in names}
    for _ in range(max(1, repeats)):
        t = timing.timed()
        logits, _ = prefill(model, ids)
        plain.append(t.done(logits))
        bare = Prefilled(model, ids, [])  # presses that read no queries share one prefill
        for n in names:  # interleaved with the plain prefill, repeat by repeat; costs paired with it
            p = _press(n, 0.5)
            pre = Prefilled(model, ids, [p]) if p.needs.queries else bare
            per[n]["capture"].append((pre.prefill_s - plain[-1]) / plain[-1] if p.needs.queries else 0.0)
            per[n]["compress"].append(pre.compress(p).compress_s / plain[-1])
    base = spread(plain)
    rows, values = [], {"plain": base, "presses": {}, "tokens": len(ids), "model": model.name}
    for n in names:
        cs, cap = spread(per[n]["compress"]), spread(per[n]["capture"])
        rows.append((n, median_range(cs, 100), median_range(cap, 100) if _press(n, 0.5).needs.queries else "none"))
        values["presses"][n] = {"compress": cs, "capture": cap, "cost": cs["median"]}
    return Table(f"compression time vs prefill time at ratio 0.5 ({len(ids)} tokens, {model.name})",
                 f"kvlab bench --only press_time --model {model.name} --repeats {repeats}",
                 ("press", "compress % of prefill", "query capture during prefill, % of prefill"), tuple(rows),
                 f"Plain prefill {median_range(base, 1e3)} ms. Each repeat's times are divided by that repeat's "
                 "plain prefill, run just before (median (min-max) over repeats). The capture column is what "
                 "reading the prompt's queries adds to its prefill (window queries, attention sums, query "
                 "statistics): observed_attention recomputes every query's attention weights, as kvpress needs "
                 "eager attention for it. The attention weights' softmax uses the attention kernel's exp "
                 "(kvlab.models.attention.softmax: kvlab's on Linux CPU, MLX's elsewhere).",
                 values=values)


def bench_decode(model, repeats: int, tokens: int = DECODE_TOKENS, steps: int = 32) -> Table:
    """Greedy decode tokens/s after a long prompt, on the full cache and compressed by knorm."""
    from ..presses.compress import Prefilled
    from ..presses.quality import decode_speed, document

    ids, cont = document(model, tokens)
    pre = Prefilled(model, ids, [])
    caches = {"full": None} | {f"knorm {r:.0%}": pre.compress(_press("knorm", r)).cache for r in (0.5, 0.75)}
    runs = {name: [] for name in caches}
    for _ in range(max(1, repeats)):
        for name, cache in caches.items():
            runs[name].append(decode_speed(model, restore(pre.snapshot) if cache is None else cache, cont[0], steps))
    full = spread(runs["full"])["median"]
    rows = [(name, median_range(spread(x)), f"{spread(x)['median'] / full:.2f}x") for name, x in runs.items()]
    return Table(f"decode tokens/s after {len(ids)} tokens, full vs compressed ({model.name})",
                 f"kvlab bench --only press_decode --model {model.name} --repeats {repeats}",
                 ("cache", "decode tokens/s median (min-max)", "vs full"), tuple(rows),
                 f"{steps} greedy tokens per run, the first step not timed; repeats interleaved.",
                 values={"runs": {k: spread(v) for k, v in runs.items()}, "tokens": len(ids), "model": model.name})


def bench_quality(model, tokens: int = QUALITY_TOKENS, names=SCORERS + WRAPPED, ratios=RATIOS, n: int = 6) -> Table:
    """Per press and ratio: KL / top-1 / ΔNLL and gated needle / variable-tracking accuracy."""
    from ..presses.compress import Prefilled
    from ..presses.quality import answers, divergence, document, gated
    from ..presses.tasks import suite

    grid = {(name, r): _press(name, r) for name in names for r in ratios}
    ids, cont = document(model, tokens)
    pre = Prefilled(model, ids, list(grid.values()))
    full = prefill(model, cont, restore(pre.snapshot), all_logits=True)[0]
    words = int(tokens * 0.7)
    found = {kind: answers(model, suite(kind, n, words=words), list(grid.values())) for kind in ("needle", "vt")}
    rows, values = [], {"model": model.name, "tokens": len(ids), "cells": {}}
    base = {kind: gated(got[None], got[None])[1] for kind, got in found.items()}
    for (name, r), p in grid.items():
        d = divergence(model, pre, p, cont, full_logits=full)
        acc = {kind: gated(got[None], got[p.key])[0] for kind, got in found.items()}
        rows.append((name, f"{r:.0%}", f"{d['kl']:.3f}", f"{d['top1']:.2f}", f"{d['delta_nll']:+.3f}",
                     _pct(acc["needle"]), _pct(acc["vt"])))
        values["cells"][f"{name}@{r}"] = {**d, **{f"{k}_accuracy": v for k, v in acc.items()}}
    values["baseline"] = base
    return Table(f"quality against ratio per press ({len(ids)}-token context, {model.name})",
                 f"kvlab bench --only press_quality --model {model.name}",
                 ("press", "ratio", "KL nats/token", "top-1", "ΔNLL", "needle acc (gated)", "vt acc (gated)"),
                 tuple(rows), f"Uncompressed baseline: needle {_pct(base['needle'])}, variable tracking "
                 f"{_pct(base['vt'])} of {n} tasks each; accuracy counts only the questions it answers. KL, "
                 "top-1 and ΔNLL are teacher-forced over 64 tokens that copy a passage of the context back.",
                 values=values)


def _pct(x) -> str:
    return "—" if x is None else f"{x:.0%}"


press_bytes = Section(True, lambda s: bench_bytes(s.model))
press_time = Section(True, lambda s: bench_time(s.model, s.repeats))
press_decode = Section(True, lambda s: bench_decode(s.model, s.repeats))
press_quality = Section(True, lambda s: bench_quality(s.model))


def bytes_target(v: dict) -> tuple[bool, str]:
    """The scorer presses within one row per KV head per layer of (1 - ratio) at every ratio."""
    cells = [(n, r, x) for n, per in v["presses"].items() if n in v["scorers"] for r, x in per.items()]
    bad = [f"{n}@{r}" for n, r, x in cells if not x["within"]]
    worst = max(abs(x["bytes_kept"] - x["target"]) for _, _, x in cells) / v["tolerance"]
    return not bad, (f"{len(cells) - len(bad)} of {len(cells)} scorer cells within one row per head per layer "
                     f"(worst {worst:.2f} of that){'; off: ' + ', '.join(bad) if bad else ''} ({v['model']})")


def time_target(v: dict) -> tuple[bool, str]:
    """Every press's compression time <= 10% of a plain prefill (the capture reported beside it)."""
    costs = {n: x["cost"] for n, x in v["presses"].items()}
    captures = {n: x["capture"]["median"] for n, x in v["presses"].items() if x["capture"]["max"] != 0.0}
    worst = max(costs, key=costs.get)
    heavy = max(captures, key=captures.get) if captures else None
    return (all(c <= 0.10 for c in costs.values()),
            f"worst {worst} {costs[worst]:.1%}, median press {sorted(costs.values())[len(costs) // 2]:.1%} of a "
            f"{v['plain']['median']:.2f} s prefill of {v['tokens']} tokens ({v['model']})"
            + (f"; query capture adds up to {captures[heavy]:.0%} ({heavy})" if heavy else ""))


AGREED = ("streaming_llm", "knorm", "snapkv", "expected_attention", "tova")  # issue 32's agreement presses


def agreement_target(v: dict) -> tuple[bool, str]:
    """Every (layer, KV head) of the five presses keeps kvpress's positions, or differs by a
    near-tie only (``kvlab.bench.press_agreement``'s values)."""
    cells = [(n, r, x) for n, per in v.items() if n in AGREED for r, x in per.items()]
    heads = sum(x["heads"] for _, _, x in cells)
    exact = sum(x["exact_heads"] for _, _, x in cells)
    ties = sum(x["near_tie_heads"] for _, _, x in cells)
    bad = [f"{n}@{r}: {x['differing_heads']}" for n, r, x in cells if x["differing_heads"]]
    return (bool(cells) and not bad,
            f"{exact} of {heads} heads exact, {ties} near-ties"
            + (f"; differing heads {', '.join(bad)}" if bad else ""))
