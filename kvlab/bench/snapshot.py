"""Snapshot + restore cost against cached length, on caches of the model's exact shapes."""

from __future__ import annotations


from ..primitives import timing
from .settings import Settings
from .table import Table, ms, spread

NEEDS_MODEL = True


def filled_cache(model, n: int) -> list:
    """A cache holding n tokens of random KV in the model's exact shapes and buffer layout
    (snapshot/restore cost depends on shapes, not values; a real 8k prefill takes minutes on CPU).

    Example:
        >>> filled_cache(kv.load("tiny"), 300)[0].offset
        300
    """
    import mlx.core as mx

    from ..primitives.snapshots import make_cache

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
    """Milliseconds to snapshot and restore a live cache of each length, and the snapshot's size.

    Example:
        >>> bench_snapshot(kv.load("tiny"), 2, lengths=(256,)).rows[0][0]
        256
    """
    from ..primitives.snapshots import restore, snapshot

    rows, values = [], {}
    for n in lengths:
        live = filled_cache(model, n)
        times = []
        for _ in range(max(repeats, 5)):
            t = timing.timed()
            restored = restore(snapshot(live))
            times.append(t.done([layer.state for layer in restored]))
        rows.append((n, ms(spread(times)).replace(" ms", ""), f"{snapshot(live).nbytes / 2**20:.1f}"))
        values[n] = {"seconds": spread(times), "nbytes": snapshot(live).nbytes}
    return Table(f"snapshot + restore cost vs cached length, model {model.name}",
                 f"kvlab bench --only snapshot --model {model.name} --repeats {repeats}",
                 ("cached tokens", "snapshot+restore ms median ± pstdev (min-max)", "snapshot MiB"),
                 tuple(rows), "Flat: snapshots are array views; MLX copies on write. The caches hold "
                 "random KV in the model's shapes (values do not affect the cost).",
                 values={"lengths": values, "model": model.name})


def table(s: Settings) -> Table:
    return bench_snapshot(s.model, s.repeats)
