"""TTFT on the agentic loop: each store against a cold prefill and the physical limit (prefill
only the new tokens on top of an already-built live cache)."""

from __future__ import annotations


from ..primitives import timing
from .settings import Settings
from .table import Table, ms, spread

NEEDS_MODEL = True


def bench_ttft(model, repeats: int, system_tokens: int = 1000, turns: int = 4) -> Table:
    """Cached TTFT per turn vs the physical limit (prefill only the new tokens on a live cache).

    Example:
        >>> bench_ttft(kv.load("tiny"), 2, system_tokens=200).columns[0]
        'method'
    """
    from .. import workloads
    from ..engine import Engine
    from ..primitives.snapshots import prefill
    from ..stores import MlxLmLRUStore, PagedStore, RadixStore, SharedRadixStore
    from ..primitives.tokens import tokenise

    wl = workloads.agentic_loop(turns=turns, billing_header=False, system_tokens=system_tokens)
    prompts = [tokenise(model, list(r.messages)).ids for r in wl.requests]
    # shared-radix: a hit concatenates the path's KV slices, a cost this table includes
    stores = {"radix": lambda: RadixStore(), "shared-radix": lambda: SharedRadixStore(),
              "paged": lambda: PagedStore(num_blocks=4096),
              "mlx-lm LRUPromptCache": lambda: MlxLmLRUStore()}
    ttft = {name: [] for name in ("cold prefill", *stores, "physical limit")}
    for _ in range(repeats):
        for name, make in stores.items():
            engine = Engine(model, make())
            for ids in prompts:
                r = engine.run(list(ids), max_tokens=1)
                if r.request_id > 1:
                    ttft[name].append(r.ttft_s)
        live = None
        for k, ids in enumerate(prompts):
            t = timing.timed()
            start = len(prompts[k - 1]) if k else 0
            logits, live = prefill(model, ids[start:], live)
            int(logits.argmax().item())
            if k:
                ttft["physical limit"].append(t.done())
            t = timing.timed()
            logits, _ = prefill(model, ids)
            int(logits.argmax().item())
            if k:
                ttft["cold prefill"].append(t.done())
    limit = spread(ttft["physical limit"])["median"]
    rows, stats = [], {}
    for name, xs in ttft.items():
        s = spread(xs)
        stats[name] = s
        rows.append((name, ms(s), f"{s['median'] / limit:.2f}x"))
    cold_tokens = [len(p) for p in prompts[1:]] * repeats  # cold prefills ran in this order
    lens = " -> ".join(str(len(p)) for p in prompts)
    return Table(f"TTFT on the agentic loop ({lens} tokens, turns 2-{turns}), model {model.name}",
                 f"kvlab bench --only ttft --model {model.name} --repeats {repeats}",
                 ("method", "TTFT ms median ± pstdev (min-max)", "vs physical limit"), tuple(rows),
                 "Physical limit: prefill only the new tokens on top of an already-built live cache. "
                 "Targets: kvlab within 1.10x of it; no slower than LRUPromptCache. shared-radix "
                 "concatenates its path's KV slices on every hit (a copy of the reused prefix).",
                 values={"seconds": stats, "prompt_tokens": [len(p) for p in prompts],
                         "cold_tokens_per_s": spread([n / t for n, t in zip(cold_tokens, ttft["cold prefill"])]),
                         "model": model.name})


def table(s: Settings) -> Table:
    return bench_ttft(s.model, s.repeats, s.ttft_system_tokens)
