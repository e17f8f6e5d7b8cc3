"""The targets BENCHMARKS.md and the README's summary judge: what was measured against each and
whether it was met are computed here from the tables' raw values, never typed by hand
(``kvlab.bench.report`` writes them into the file, section by section).

    kvlab bench --model smollm2 --repeats 3 --write BENCHMARKS.md

Example:
    >>> tables = kv.bench.run("tiny", repeats=2, only=["hashing"])
    >>> summary_table(tables).rows[0][2] in ("met", "not met", "not measured")
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import KvlabError
from .presses import agreement_target, bytes_target, time_target
from .table import Table
from ..primitives.display import summary_html

START, END = "<!-- bench-summary:start -->", "<!-- bench-summary:end -->"
KVLAB_STORES = ("radix", "shared-radix", "paged")  # the TTFT rows that are kvlab's own stores
LRU = "mlx-lm LRUPromptCache"


@dataclass(frozen=True)
class Target:
    """One target: what it promises, the section measuring it, and ``check(values) -> (met,
    measured)`` computing both from that section's ``Table.values``."""

    promise: str
    section: str
    check: Callable[[dict], tuple[bool, str]]

    def __repr__(self) -> str:
        return f"Target({self.promise!r}, from {self.section})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def _blas(v: dict) -> tuple[bool, str]:
    ref, fast = v["reference"], v["openblas"]
    mm, pf = fast["gflops"] / ref["gflops"], fast["prefill_tokens_per_s"] / ref["prefill_tokens_per_s"]
    return (mm >= 10 and pf >= 10 and fast["fast_blas"],
            f"matmul {ref['gflops']:.1f} -> {fast['gflops']:.0f} GFLOP/s ({mm:.0f}x); {v['model']} prefill "
            f"of {v['prefill_tokens']} tokens {ref['prefill_tokens_per_s']:.1f} -> "
            f"{fast['prefill_tokens_per_s']:.0f} tokens/s ({pf:.0f}x)")


def _ttft(v: dict) -> tuple[bool, str]:
    s = v["seconds"]
    limit, lru = s["physical limit"]["median"], s[LRU]
    parts, met = [], True
    for name in KVLAB_STORES:
        m = s[name]["median"]
        met &= m <= 1.10 * limit and m <= lru["median"] + lru["pstdev"]
        parts.append(f"{name} {m / limit:.2f}x")
    parts.append(f"{LRU} {lru['median'] / limit:.2f}x (pstdev {lru['pstdev'] / limit:.2f}x)")
    return met, ", ".join(parts) + " of the physical limit"


def _snapshot(v: dict) -> tuple[bool, str]:
    lengths = v["lengths"]
    med = {n: x["seconds"]["median"] for n, x in lengths.items()}
    lo, hi = min(med.values()), max(med.values())
    first, last = min(lengths), max(lengths)
    return (hi <= 3 * lo,
            f"{lo * 1e3:.2f}-{hi * 1e3:.2f} ms from {first} to {last} tokens "
            f"({lengths[first]['nbytes'] / 2**20:.0f} to {lengths[last]['nbytes'] / 2**20:.0f} MiB of KV)")


def _paged_memory(v: dict) -> tuple[bool, str]:
    stores, lower = v["stores"], v["lower_bound"]
    paged = next(x for name, x in stores.items() if name.startswith("paged"))
    others = ", ".join(f"{name} {x['counter'] / lower:.2f}x" for name, x in stores.items()
                       if not name.startswith("paged"))
    ratio = paged["counter"] / lower
    return ratio <= 1.10, f"paged {ratio:.2f}x ({paged['counter'] / 2**20:.0f} MiB); {others}"


def _shared_radix_memory(v: dict) -> tuple[bool, str]:
    ratio = v["stores"]["shared-radix"]["counter"] / v["lower_bound"]
    return ratio <= 1.05, f"shared-radix {ratio:.3f}x ({v['stores']['shared-radix']['counter'] / 2**20:.0f} MiB)"


def _counter_is_memory(v: dict) -> tuple[bool, str]:
    ratios = {name: x["allocator"] / max(x["counter"], 1) for name, x in v["stores"].items()}
    return (all(abs(r - 1) <= 0.10 for r in ratios.values()),
            ", ".join(f"{name} {r:.2f}" for name, r in ratios.items()) + " (allocator / counter)")


def _hashing(v: dict) -> tuple[bool, str]:
    x = v["xxh3_128"]
    return x["median"] >= 20e6, (f"{x['median'] / 1e6:.1f}M tokens/s "
                                 f"({x['min'] / 1e6:.1f}-{x['max'] / 1e6:.1f}M)")


def _simulator(v: dict) -> tuple[bool, str]:
    return (v["speedup"]["median"] >= 10 and v["identical"],
            f"{v['speedup']['median']:.0f}x (kernel), {v['speedup_end_to_end']['median']:.0f}x end to end, "
            f"{len(v['capacities_tokens'])} capacities, results {'identical' if v['identical'] else 'DIFFERENT'}")


def _policies(v: dict) -> tuple[bool, str]:
    per = v["policies"]
    online = {name: x for name, x in per.items() if name != "belady"}
    slowest = min(online, key=lambda name: online[name]["speedup"]["median"])
    ok = all(x["speedup"]["median"] >= 20 and x["identical"] for x in per.values())
    return ok, (f"{len(online)} online policies: speed-ups {slowest} {online[slowest]['speedup']['median']:.0f}x "
                f"(the lowest) to {max(x['speedup']['median'] for x in online.values()):.0f}x, "
                f"{'all identical' if all(x['identical'] for x in per.values()) else 'results DIFFER'}"
                + (f"; belady {per['belady']['speedup']['median']:.0f}x" if "belady" in per else ""))


def _belady(v: dict) -> tuple[bool, str]:
    b = v["policies"].get("belady")
    if b is None:
        return False, "belady not run"
    s = b["compiled_seconds"]
    return (s["median"] < 10, f"{s['median']:.2f} s ({s['min']:.2f}-{s['max']:.2f}) over "
                              f"{len(v['capacities_blocks'])} capacities, {v['requests']:,} requests")


def _adapter(v: dict) -> tuple[bool, str]:
    from .serving import ADAPTER, adapter_overhead

    runs, plain = v["runs"], v["plain"]
    if ADAPTER not in runs or plain not in runs:
        return False, f"needs both {ADAPTER!r} and {plain!r} rows"
    parts, met = [], True
    for c in sorted(set(runs[ADAPTER]) & set(runs[plain])):
        ok, text = adapter_overhead(runs[ADAPTER][c], runs[plain][c])
        met &= ok
        parts.append(f"concurrency {c}: {text}")
    return met, "; ".join(parts)


def _cost_model(v: dict) -> tuple[bool, str]:
    load = ", ".join(f"{n} tokens {r:.2g}x" for n, r in v["disk_load_vs_recompute"].items())
    return (v["mape_holdout"] <= 0.15,
            f"held-out MAPE {v['mape_holdout']:.1%} (fit {v['mape_fit']:.1%}); disk load / recompute: {load}")


def _conformance(v: dict) -> tuple[bool, str]:
    c, by = v["counts"], {}
    for x in v["not_exact"]:
        by.setdefault(f"{x['status']} in {x['store']}", []).append(x["model_type"])
    refused = "; ".join(f"{what}: {', '.join(models)}" for what, models in by.items())
    return (c["exact"] == v["cells"], f"{c['exact']} of {v['cells']} cells exact on {v['workload']}, "
            f"{c['refused']} refused, {c['wrong']} wrong, {c['silent zero']} silent zero, {c.get('error', 0)} "
            "raised"
            + (f"; {refused} (reasons in the conformance table)" if refused else ""))


def _cost_aware(v: dict) -> tuple[bool, str]:
    ratios = {w: p["cost_aware"]["of_optimal"] for w, p in v["workloads"].items()}
    return (all(r >= 0.90 for r in ratios.values()),
            ", ".join(f"{w} {r:.3f} of optimal" for w, r in ratios.items()) + f" ({v['model']})")


def _hybrid_ttft(v: dict) -> tuple[bool, str]:
    s = v["seconds"]
    limit = s["limit"]["median"]
    stores = v["judged"]
    return (all(s[n]["median"] <= 1.10 * limit for n in stores),
            ", ".join(f"{n} {s[n]['median'] / limit:.2f}x" for n in stores)
            + f" of the limit ({limit * 1e3:.0f} ms: {v['n'] - v['p']} of {v['n']} tokens, {v['model']})")


def _sliding_bytes(v: dict) -> tuple[bool, str]:
    runs = {n: r for n, r in v["runs"].items() if r.get("judged", True)}
    released = {n: r for n, r in v["runs"].items() if not r.get("judged", True)}
    also = "; with keep_superseded_windows=True " + ", ".join(
        f"{r['ratio']:.3f}x reusing {r['reused']} tokens" for r in released.values()) if released else ""
    return (all(r["ratio"] <= 1.10 for r in runs.values()),
            ", ".join(f"{n} {r['ratio']:.3f}x" + (f" reusing {r['reused']} tokens" if released else "")
                      for n, r in runs.items()) + f" of the bound{also} ({v['model']})")


def _proxy(v: dict) -> tuple[bool, str]:
    added, direct = v["added_ms"], v["direct_ms"]
    return (added["median"] <= 5.0,
            f"{added['median']:+.2f} ms TTFT (pstdev {added['pstdev']:.2f}) over mlx_lm.server's "
            f"{direct['median']:.1f} ms, {v['requests']} request pairs x {v['repeats']} ({v['model']} upstream)")


def _attention(v: dict) -> tuple[bool, str]:
    steps = v["steps"]
    mlx, last = steps[0]["seconds"]["median"], steps[-1]["seconds"]["median"]
    gains = ", ".join(f"{x['name'].split(' (')[0].lstrip('+ ')} {steps[i]['seconds']['median'] / x['seconds']['median']:.1f}x"
                      for i, x in enumerate(steps[1:]))
    return (last <= 0.15, f"{last * 1e3:.0f} ms, {mlx / last:.1f}x less than MLX's {mlx * 1e3:.0f} ms "
                          f"(steps: {gains}; max abs diff {steps[-1]['max_abs_diff']:.0e})")


def _prefill(v: dict) -> tuple[bool, str]:
    from .prefill import KVLAB, MLX, MLX_LM

    n = v["judged"]
    if n not in v["lengths"]:
        return False, f"{n} tokens not measured"
    tps, limit = v["tokens_per_s"], v["limit_seconds"][n]
    ratio = {name: n / x[n]["median"] / limit for name, x in tps.items()}
    ours, theirs, own = KVLAB, MLX, MLX_LM
    return (ratio[ours] <= 2.5, f"{ratio[ours]:.2f}x the limit ({tps[ours][n]['median']:.0f} tokens/s, "
                                f"limit {limit:.1f} s at {v['blas_gflops'][n]:.0f} GFLOP/s); with MLX's attention "
                                f"{ratio[theirs]:.2f}x, mlx-lm's own prefill {ratio[own]:.2f}x ({v['model']})")


def _cluster(v: dict) -> tuple[bool, str]:
    runs = v["runs"]
    cpu = {k: r["cpu_seconds"]["median"] for k, r in runs.items()}
    wall = {k: r["seconds"]["median"] for k, r in runs.items()}
    slowest = max(cpu, key=cpu.get)
    return (cpu[slowest] < 60,
            f"slowest {slowest}: {cpu[slowest]:.0f} CPU s ({wall[slowest]:.0f} s wall); "
            + ", ".join(f"{k} {c:.0f}" for k, c in cpu.items() if k != slowest)
            + f" CPU s; {v['requests']:,} requests over {v['instances']} instances")


def _route(v: dict) -> tuple[bool, str]:
    err = v["ttft_median_abs_rel_error"]
    return (v["decisions_equal"] and v["reused_equal"] and err <= 0.25,
            f"decisions equal: {v['decisions_equal']}, reused tokens equal: {v['reused_equal']} "
            f"({v['requests']} requests, {v['model']}); held-out TTFT median error {err:.0%} "
            f"({v['ttft_median_s']:.3f} s measured, {v['modelled_ttft_median_s']:.3f} s modelled)")


TARGETS = (
    Target("OpenBLAS path on Linux CPU: >= 10x the bundled reference BLAS on float32 matmul and on "
           "prefill", "blas", _blas),
    Target("cached TTFT (radix, shared-radix, paged) within 1.10x of the physical limit and no slower than "
           "LRUPromptCache (median <= its median + pstdev)", "ttft", _ttft),
    Target("snapshot + restore flat in cached length (slowest median <= 3x the fastest)", "snapshot", _snapshot),
    Target("PagedStore memory within 1.10x of the lower bound", "memory", _paged_memory),
    Target("SharedRadixStore memory within 1.05x of the lower bound", "memory", _shared_radix_memory),
    Target("every store's byte counter within 10% of the memory the allocator shows it holding",
           "memory", _counter_is_memory),
    Target("xxh3_128 block hashing >= 20M tokens/s", "hashing", _hashing),
    Target("16-capacity LRU sweep over 12k requests >= 10x faster than 16 plain-Python replays, "
           "identical results", "simulator", _simulator),
    Target("every eviction policy's compiled 16-capacity sweep over the 12k-request Mooncake trace >= 20x "
           "its plain-Python replays, identical results", "policies", _policies),
    Target("belady (the offline optimum) over 16 capacities of that trace < 10 s", "policies", _belady),
    Target("kvlab serve's adapter overhead: `kvlab serve mlx-lru` within 5% of plain mlx_lm.server's "
           "throughput, TTFT p50 no higher (<= its median + pstdev) at equal hit rate", "serving", _adapter),
    Target("prefill cost model's error on held-out points <= 15% (MAPE)", "tiers", _cost_model),
    Target("a million requests routed over 8 instances by the cluster simulator in < 60 s on one core "
           "(CPU seconds of the slowest rule)", "cluster", _cluster),
    Target("kvlab proxy adds <= 5 ms to TTFT p50 in front of mlx_lm.server", "proxy", _proxy),
    Target("a real 2-instance cluster behind kvlab route routes and reuses exactly as the simulator predicts; "
           "modelled TTFT within 25% of measured (median, held-out requests) after calibration", "route", _route),
    Target("every cache family x store cell reuses exactly (refusals listed with reasons)", "conformance",
           _conformance),
    Target("cost_aware checkpoints within 10% of optimal's reused tokens at equal bytes on agentic_loop and "
           "branching", "checkpoint_policies", _cost_aware),
    Target("hybrid model: cached TTFT <= 1.10x the limit (prefill of only the tokens past the restored "
           "state)", "hybrid_ttft", _hybrid_ttft),
    Target("a sliding-window model's bytes per cached token in the paged store <= 1.10x the "
           "dense-equivalent bound", "sliding_bytes", _sliding_bytes),
    Target("one causal attention layer at 2,048 tokens (SmolLM2's 9/3 heads, dim 64) <= 0.15 s with kvlab's "
           "CPU attention", "attention", _attention),
    Target("prefill of a 2,048-token prompt on SmolLM2 <= 2.5x the BLAS-rate limit of its matmul FLOPs",
           "prefill", _prefill),
    Target("KV-cache presses hold (1 - ratio) of the full cache's KV at 25/50/75% within one row per KV head "
           "(scorer presses, every layer)", "press_bytes", bytes_target),
    Target("compression (the press's capture during prefill + scoring and gathering) <= 10% of a plain "
           "prefill, every press at 0.5", "press_time", time_target),
    Target("kvlab's streaming_llm, knorm, snapkv, expected_attention and tova keep the positions kvpress 0.5.5 "
           "keeps on the same SmolLM2 weights, every layer and KV head (or differ by a near-tie only)",
           "press_agreement", agreement_target),
)


def _by_section(tables) -> dict[str, Table]:
    return {t.section: t for t in tables if t.section}


def summary_table(tables) -> Table:
    """One row per target: the promise, what this run measured, and "met" / "not met" (or "not
    measured" when its section was not run), all computed from the tables' values.

    Example:
        >>> [row[0] for row in summary_table([]).rows][0].startswith("OpenBLAS")
        True
    """
    sections = _by_section(tables)
    rows = []
    for t in TARGETS:
        if t.section not in sections:
            rows.append((t.promise, f"(not run: add {t.section} to --only)", "not measured"))
            continue
        met, measured = t.check(sections[t.section].values)
        rows.append((t.promise, measured, "met" if met else "not met"))
    return Table("Summary against the targets", "computed from the tables below (kvlab/bench/summary.py)",
                 ("target", "measured", "met"), tuple(rows), section="summary")


def findings(tables) -> list[str]:
    """Findings stated with this run's numbers (only those whose sections were run).

    Example:
        >>> findings([])
        []
    """
    s = _by_section(tables)
    if "exp" not in s:
        return []
    v = s["exp"].values
    mlx, numpy = v["seconds"]["mlx (mx.exp)"]["median"], v["seconds"]["numpy (np.exp)"]["median"]
    text = (f"**Finding: MLX's CPU `exp` is slow** (kvlab's CPU attention computes its own, vectorised: the "
            f"attention and prefill tables). `mx.exp` on {v['n'] / 1e6:.1f}M float32 "
            f"values takes {mlx * 1e3:.1f} ms ({v['n'] / mlx / 1e6:.0f}M values/s); NumPy takes "
            f"{numpy * 1e3:.1f} ms on the same values ({mlx / numpy:.0f}x less). Softmax inherits it, so "
            "attention's share of prefill grows with the context")
    if "blas" in s and "ttft" in s:
        b, t = s["blas"].values, s["ttft"].values
        lens, short = t["prompt_tokens"][1:], b["openblas"]["prefill_tokens_per_s"]
        cold = t["cold_tokens_per_s"]["median"]
        text += (f": {b['model']} prefills {b['prefill_tokens']} tokens at {short:.0f} tokens/s (BLAS "
                 f"table) and the TTFT table's cold prefills of {min(lens)}-{max(lens)} tokens at "
                 f"{cold:.0f} tokens/s")
        if cold < short:
            text += (f" ({short / cold:.1f}x slower per token). That is why the TTFT table uses a loop "
                     "of this length rather than several thousand tokens")
    return [text + ". The cache comparisons are ratios and do not depend on it."]


def replace_marked(text: str, block: str, *, name: str = "README.md") -> str:
    """``text`` with everything between the bench-summary markers replaced by ``block``; the
    markers stay. Raises KvlabError when the markers are missing, repeated or out of order.

    Example:
        >>> replace_marked(f"a\\n{START}\\nold\\n{END}\\nb", "new")
        'a\\n<!-- bench-summary:start -->\\nnew\\n<!-- bench-summary:end -->\\nb'
    """
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise KvlabError(f"{name} needs exactly one {START} line followed by one {END} line for "
                         "kvlab bench to rewrite the summary between them; add them (or fix their order)")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{block.strip()}\n{END}{tail}"
