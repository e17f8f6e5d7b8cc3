"""Side-by-side benchmarks: every contender runs in the same process, interleaved over repeats, and
each table reports the median and spread (pstdev, min-max) plus ratios against a reference.

    kvlab bench --model smollm2 --repeats 5 --write BENCHMARKS.md
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from . import _blas

SECTIONS = ("blas", "ttft", "snapshot", "memory", "hashing", "simulator")


@dataclass(frozen=True)
class Table:
    title: str
    command: str
    columns: tuple[str, ...]
    rows: tuple[tuple, ...]
    notes: str = ""

    def markdown(self) -> str:
        head = "| " + " | ".join(self.columns) + " |\n|" + "---|" * len(self.columns) + "\n"
        body = "".join("| " + " | ".join(_fmt(v) for v in row) + " |\n" for row in self.rows)
        notes = f"\n{self.notes}\n" if self.notes else ""
        return f"### {self.title}\n\n`{self.command}`\n\n{head}{body}{notes}"

    def __repr__(self) -> str:
        return f"Table({self.title!r}, {len(self.rows)} rows)"

    def _repr_html_(self) -> str:
        import html

        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>"
                       for row in self.rows)
        return f"<b>{html.escape(self.title)}</b><table><tr>{head}</tr>{body}</table>"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def spread(xs) -> dict:
    """Median, population stdev, min and max of repeated measurements."""
    xs = list(xs)
    return {"median": statistics.median(xs), "pstdev": statistics.pstdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs), "n": len(xs)}


def _ms(s: dict) -> str:
    return f"{s['median'] * 1e3:.1f} ± {s['pstdev'] * 1e3:.1f} ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f})"


# ---- 0. BLAS ------------------------------------------------------------------------------------

_BLAS_PROBE = r"""
import json, os, sys, time
import kvlab, kvlab._blas as b
import mlx.core as mx
a, w = mx.random.normal((1024, 896)), mx.random.normal((896, 4864)); mx.eval(a, w, a @ w)
g = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter(); mx.eval(a @ w); g.append(2*1024*896*4864/(time.perf_counter()-t)/1e9)
m = kvlab.load(sys.argv[1]); ids = list(range(1000, 1256))
kvlab.prefill(m, ids[:16])
p = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter(); kvlab.prefill(m, ids); p.append(256/(time.perf_counter()-t))
print(json.dumps({"fast": b.fast_blas_active(), "gflops": g, "prefill_tps": p}))
"""


def bench_blas(model: str, repeats: int) -> Table:
    rows = []
    for label, env in (("reference BLAS (KVLAB_BLAS=off)", {**os.environ, "KVLAB_BLAS": "off"}),
                       ("OpenBLAS (kvlab default)", dict(os.environ))):
        env.pop("LD_PRELOAD", None)
        out = subprocess.run([sys.executable, "-c", _BLAS_PROBE, model, str(max(repeats, 2))],
                             env=env, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        g, p = spread(r["gflops"]), spread(r["prefill_tps"])
        rows.append((label, f"{g['median']:.1f} ± {g['pstdev']:.1f}", f"{p['median']:.1f} ± {p['pstdev']:.1f}"))
    return Table("Linux CPU BLAS: float32 matmul and prefill", f"kvlab bench --only blas --model {model}",
                 ("BLAS", "GFLOP/s 1024x896@896x4864", f"prefill tokens/s ({model}, 256 tokens)"),
                 tuple(rows), "Each row is a fresh process; median ± pstdev over repeats.")


# ---- 1. TTFT on the agentic loop -------------------------------------------------------------

def bench_ttft(model, repeats: int, system_tokens: int = 1000, turns: int = 4) -> Table:
    """Cached TTFT per turn vs the physical limit (prefill only the new tokens on a live cache)."""
    import kvlab as kv
    from .snapshots import prefill

    wl = kv.workloads.agentic_loop(turns=turns, billing_header=False, system_tokens=system_tokens)
    prompts = [kv.tokenise(model, list(r.messages)).ids for r in wl.requests]
    stores = {"radix": lambda: kv.RadixStore(), "paged": lambda: kv.PagedStore(num_blocks=4096),
              "mlx-lm LRUPromptCache": lambda: kv.MlxLmLRUStore()}
    ttft = {name: [] for name in ("cold prefill", *stores, "physical limit")}
    for _ in range(repeats):
        for name, make in stores.items():
            engine = kv.Engine(model, make())
            for ids in prompts:
                r = engine.run(list(ids), max_tokens=1)
                if r.request_id > 1:
                    ttft[name].append(r.ttft_s)
        live = None
        for k, ids in enumerate(prompts):
            t = time.perf_counter()
            start = len(prompts[k - 1]) if k else 0
            logits, live = prefill(model, ids[start:], live)
            int(logits.argmax().item())
            if k:
                ttft["physical limit"].append(time.perf_counter() - t)
            t = time.perf_counter()
            logits, _ = prefill(model, ids)
            int(logits.argmax().item())
            if k:
                ttft["cold prefill"].append(time.perf_counter() - t)
    limit = spread(ttft["physical limit"])["median"]
    rows = []
    for name, xs in ttft.items():
        s = spread(xs)
        rows.append((name, _ms(s), f"{s['median'] / limit:.2f}x"))
    lens = " -> ".join(str(len(p)) for p in prompts)
    return Table(f"TTFT on the agentic loop ({lens} tokens, turns 2-{turns}), model {model.name}",
                 f"kvlab bench --only ttft --model {model.name} --repeats {repeats}",
                 ("method", "TTFT ms median ± pstdev (min-max)", "vs physical limit"), tuple(rows),
                 "Physical limit: prefill only the new tokens on top of an already-built live cache. "
                 "Targets: kvlab within 1.10x of it; no slower than LRUPromptCache.")


# ---- 2. snapshot + restore cost ----------------------------------------------------------------

def _filled_cache(model, n: int) -> list:
    """A cache holding n tokens of random KV in the model's exact shapes and buffer layout
    (snapshot/restore cost depends on shapes, not values; a real 8k prefill takes minutes on CPU)."""
    import mlx.core as mx

    from .snapshots import make_cache

    cache = make_cache(model)
    cfg = model.config
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype = getattr(mx, model.dtype)
    for c in cache:
        for start in range(0, n, 2048):
            m = min(2048, n - start)
            kv_ = mx.random.normal((1, heads, m, dim)).astype(dtype)
            c.update_and_fetch(kv_, kv_)
        mx.eval(c.state)
    return cache


def bench_snapshot(model, repeats: int, lengths=(256, 512, 1024, 2048, 4096, 8192)) -> Table:
    import kvlab as kv

    rows = []
    for n in lengths:
        live = _filled_cache(model, n)
        times = []
        for _ in range(max(repeats, 5)):
            t = time.perf_counter()
            kv.restore(kv.snapshot(live))
            times.append(time.perf_counter() - t)
        rows.append((n, _ms(spread(times)).replace(" ms", ""), f"{kv.snapshot(live).nbytes / 2**20:.1f}"))
    return Table(f"snapshot + restore cost vs cached length, model {model.name}",
                 f"kvlab bench --only snapshot --model {model.name} --repeats {repeats}",
                 ("cached tokens", "snapshot+restore ms median ± pstdev (min-max)", "snapshot MiB"),
                 tuple(rows), "Flat: snapshots are array views; MLX copies on write. The caches hold "
                 "random KV in the model's shapes (values do not affect the cost).")


# ---- 3. memory on prefix repetition -------------------------------------------------------------

def bench_memory(model, prefix_len=512, suffix_len=128, num_prompts=50) -> Table:
    import kvlab as kv

    wl = kv.workloads.prefix_repetition(prefix_len=prefix_len, suffix_len=suffix_len,
                                        num_prompts=num_prompts, num_prefixes=1, output_len=1,
                                        tokenizer=model.tokenizer)
    ids = [r.ids for r in wl.requests]
    per_token = kv.snapshot(kv.prefill(model, list(ids[0][:8]))[1]).nbytes / 8
    distinct = len({tuple(x[:k]) for x in ids for k in range(1, len(x) + 1)})
    lower = distinct * per_token
    stores = {"radix": kv.RadixStore(), "paged (block 16)": kv.PagedStore(block_size=16, num_blocks=8192),
              "mlx-lm LRUPromptCache": kv.MlxLmLRUStore(max_size=num_prompts)}
    rows = []
    for name, store in stores.items():
        engine = kv.Engine(model, store)
        for x in ids:
            engine.run(list(x), max_tokens=1)
        rows.append((name, store.nbytes / 2**20, f"{store.nbytes / lower:.2f}x",
                     f"{engine.stats()['token_hit_rate']:.3f}"))
    rows.append(("lower bound (each distinct token once)", lower / 2**20, "1.00x", "-"))
    return Table(f"memory held after prefix_repetition ({num_prompts} prompts, {prefix_len}-token prefix, "
                 f"{suffix_len}-token suffixes), model {model.name}",
                 f"kvlab bench --only memory --model {model.name}",
                 ("store", "MiB held", "vs lower bound", "token hit rate"), tuple(rows),
                 "Target: PagedStore within 1.10x of the lower bound. mlx-lm's LRUPromptCache keeps "
                 "at most max_size entries.")


# ---- 4-5. hashing and simulator -----------------------------------------------------------------

def bench_hashing_table(repeats: int) -> Table:
    from .blocks import bench_hashing

    r = bench_hashing(repeats=repeats)["algos"]
    rows = tuple((algo, f"{v['median_tokens_per_s'] / 1e6:.1f}",
                  f"{v['min_tokens_per_s'] / 1e6:.1f}-{v['max_tokens_per_s'] / 1e6:.1f}") for algo, v in r.items())
    return Table("block hashing throughput (32k-token prompt, block size 16)",
                 f"kvlab bench --only hashing --repeats {repeats}",
                 ("algorithm", "M tokens/s median", "min-max"), rows,
                 "Target: xxh3_128 >= 20M tokens/s (vLLM reports 31-80M tokens/s on GPU servers).")


def _median_range(v: dict, scale: float = 1.0) -> str:
    return f"{v['median'] * scale:.4g} ({v['min'] * scale:.4g}-{v['max'] * scale:.4g})"


def bench_simulator_table(repeats: int) -> Table:
    from .simulator import bench_simulator

    r = bench_simulator(repeats=repeats)
    rows = [("trace", f"{r['requests']} requests, {r['blocks']} block references, "
                      f"{r['distinct_blocks']} distinct blocks"),
            ("capacities", f"{len(r['capacities_tokens'])} (LRU, {r['capacities_tokens'][0]:,}-"
                           f"{r['capacities_tokens'][-1]:,} tokens)"),
            ("results identical to plain replays", r["identical"])]
    for key in ("sweep_seconds", "sweep_api_seconds", "numba_replays_seconds", "python_replays_seconds",
                "speedup", "speedup_end_to_end", "speedup_vs_numba_replays"):
        rows.append((key, _median_range(r[key])))
    for key, v in r["blocks_per_s"].items():
        rows.append((f"{key} block lookups/s (x capacities)", _median_range(v)))
    return Table("simulator throughput and sweep speed-up", f"kvlab bench --only simulator --repeats {repeats}",
                 ("measure", "median (min-max)"), tuple(rows),
                 "Target: a 16-capacity LRU sweep over a 12k-request trace >= 10x faster than 16 "
                 "plain-Python replays, identical results. `speedup` = python replays / stack-distance sweep.")


def run(model_name: str = "smollm2", repeats: int = 5, only=None, *, on_table=None,
        ttft_system_tokens: int = 1000) -> list[Table]:
    """Run the chosen benchmarks; ``on_table(table)`` is called as each one finishes."""
    import kvlab as kv

    only = set(only or SECTIONS)
    unknown = only - set(SECTIONS)
    if unknown:
        raise kv.KvlabError(f"unknown benchmark(s) {sorted(unknown)}; choose from {SECTIONS}")
    model = kv.load(model_name) if only & {"ttft", "snapshot", "memory"} else None
    steps = {
        "blas": lambda: bench_blas(model_name, repeats),
        "ttft": lambda: bench_ttft(model, repeats, ttft_system_tokens),
        "snapshot": lambda: bench_snapshot(model, repeats),
        "memory": lambda: bench_memory(model),
        "hashing": lambda: bench_hashing_table(repeats),
        "simulator": lambda: bench_simulator_table(repeats),
    }
    tables = []
    for name in SECTIONS:
        if name in only:
            tables.append(steps[name]())
            if on_table is not None:
                on_table(tables[-1])
    return tables


def machine() -> str:
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, BLAS {'OpenBLAS' if _blas.fast_blas_active() else 'reference'}")


def run_cli(args) -> int:
    only = args.only.split(",") if args.only else None
    started = time.perf_counter()
    if args.write:
        header = f"## Run of {time.strftime('%Y-%m-%d %H:%M')} — {machine()}\n\n"
        existing = open(args.write).read() if os.path.exists(args.write) else "# kvlab benchmarks\n\n"
        _replace(args.write, existing.rstrip() + "\n\n" + header)

    def emit(table: Table) -> None:
        text = table.markdown()
        print(text, flush=True)
        if args.write:
            _replace(args.write, open(args.write).read() + text + "\n")

    run(args.model, args.repeats, only, on_table=emit, ttft_system_tokens=args.ttft_system_tokens)
    if args.write:
        print(f"kvlab: appended to {args.write} ({time.perf_counter() - started:.0f} s)")
    return 0


def _replace(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
