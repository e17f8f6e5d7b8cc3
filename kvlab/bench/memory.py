"""Memory each store holds after seed 004's prefix repetition, against the lower bound (every
distinct token's KV stored once)."""

from __future__ import annotations

from .settings import Settings
from .table import Table

NEEDS_MODEL = True


def bench_memory(model, prefix_len=512, suffix_len=128, num_prompts=50) -> Table:
    """MiB held by each store, its ratio to the lower bound, and its token hit rate.

    Example:
        >>> bench_memory(kv.load("tiny"), 64, 16, 4).columns[0]
        'store'
    """
    from .. import workloads
    from ..engine import Engine
    from ..snapshots import prefill, snapshot
    from ..stores import MlxLmLRUStore, PagedStore, RadixStore

    wl = workloads.prefix_repetition(prefix_len=prefix_len, suffix_len=suffix_len,
                                     num_prompts=num_prompts, num_prefixes=1, output_len=1,
                                     tokenizer=model.tokenizer)
    ids = [r.ids for r in wl.requests]
    per_token = snapshot(prefill(model, list(ids[0][:8]))[1]).nbytes / 8
    distinct = len({tuple(x[:k]) for x in ids for k in range(1, len(x) + 1)})
    lower = distinct * per_token
    stores = {"radix": RadixStore(), "paged (block 16)": PagedStore(block_size=16, num_blocks=8192),
              "mlx-lm LRUPromptCache": MlxLmLRUStore(max_size=num_prompts)}
    rows = []
    for name, store in stores.items():
        engine = Engine(model, store)
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


def table(s: Settings) -> Table:
    return bench_memory(s.model)
