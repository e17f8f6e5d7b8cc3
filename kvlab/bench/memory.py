"""Memory each store holds after seed 004's prefix repetition: the store's own byte counter beside
the allocator's (``mx.get_active_memory()`` growth while the store lives), against the lower bound
(every distinct token's KV stored once)."""

from __future__ import annotations

import gc

from .settings import Settings
from .table import Table

NEEDS_MODEL = True


def active_bytes() -> int:
    """MLX's active memory after a garbage collection and with its buffer cache emptied."""
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def bench_memory(model, prefix_len=512, suffix_len=128, num_prompts=50) -> Table:
    """MiB each store counts and MiB the allocator shows it holding, the ratio of the two, the
    counter against the lower bound, and the token hit rate.

    Example:
        >>> bench_memory(kv.load("tiny"), 64, 16, 4).columns[:3]
        ('store', 'MiB counted', 'MiB allocator')
    """
    from .. import workloads
    from ..engine import Engine
    from ..primitives.snapshots import prefill, snapshot
    from ..stores import MlxLmLRUStore, PagedStore, RadixStore, SharedRadixStore

    wl = workloads.prefix_repetition(prefix_len=prefix_len, suffix_len=suffix_len,
                                     num_prompts=num_prompts, num_prefixes=1, output_len=1,
                                     tokenizer=model.tokenizer)
    ids = [r.ids for r in wl.requests]
    per_token = snapshot(prefill(model, list(ids[0][:8]))[1]).nbytes / 8
    distinct = len({tuple(x[:k]) for x in ids for k in range(1, len(x) + 1)})
    lower = distinct * per_token
    stores = {"radix": lambda: RadixStore(), "shared-radix": lambda: SharedRadixStore(),
              "paged (block 16)": lambda: PagedStore(block_size=16, num_blocks=8192),
              "mlx-lm LRUPromptCache": lambda: MlxLmLRUStore(max_size=num_prompts)}
    Engine(model, None).run(list(ids[0]), max_tokens=1)  # one-time allocations before any baseline
    rows, values = [], {}
    for name, make in stores.items():
        store = make()
        engine = Engine(model, store)
        base = active_bytes()
        for x in ids:
            engine.run(list(x), max_tokens=1)
        held = active_bytes() - base
        hit = engine.stats()["token_hit_rate"]
        values[name] = {"counter": store.nbytes, "allocator": held, "token_hit_rate": hit}
        rows.append((name, store.nbytes / 2**20, held / 2**20, f"{held / max(store.nbytes, 1):.2f}",
                     f"{store.nbytes / lower:.2f}x", f"{hit:.3f}"))
        del engine, store
    rows.append(("lower bound (each distinct token once)", lower / 2**20, "-", "-", "1.00x", "-"))
    return Table(f"memory held after prefix_repetition ({num_prompts} prompts, {prefix_len}-token prefix, "
                 f"{suffix_len}-token suffixes), model {model.name}",
                 f"kvlab bench --only memory --model {model.name}",
                 ("store", "MiB counted", "MiB allocator", "allocator / counted", "vs lower bound",
                  "token hit rate"), tuple(rows),
                 "MiB counted: the store's own byte counter (what its budget limits). MiB allocator: "
                 "how much MLX's active memory grew while the store held its entries (gc'd, buffer "
                 "cache emptied). Targets: allocator within 10% of the counter for every store; "
                 "PagedStore within 1.10x of the lower bound, SharedRadixStore (nodes own their "
                 "edge's KV) within 1.05x. mlx-lm's LRUPromptCache keeps at most max_size entries.",
                 values={"stores": values, "lower_bound": lower, "model": model.name})


def table(s: Settings) -> Table:
    return bench_memory(s.model)
