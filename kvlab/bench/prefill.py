"""Long-prompt prefill on the bench's model: kvlab's prefill with its attention kernel (the device's
choice), the same prefill with MLX's kernel (``KVLAB_CPU_ATTENTION=mlx``), and mlx-lm's own prefill
(``generate_step`` up to its first token, the library untouched), side by side in one process, at
several prompt lengths; and the limit the matmuls' FLOPs set at the BLAS rate measured in the same
run (a float32 matmul of the model's own MLP shape, interleaved with the prefills).

FLOPs of a prefill of n tokens: 2 n x (every matmul weight of the layers) + 4 n(n+1)/2 x heads x head
dim per attention layer (scores and weighted values over the keys each query sees); the output
projection of the last position only, as prefills compute.
"""

from __future__ import annotations

from ..primitives import timing
from .settings import Settings
from .table import Table, median_range, spread

NEEDS_MODEL = True
LENGTHS = (256, 1024, 2048, 4096)
JUDGED = 2048  # the length the target is stated for
KVLAB, MLX, MLX_LM = "kvlab prefill, kvlab attention", "kvlab prefill, MLX attention", "mlx-lm's own prefill"


def prefill_flops(model, n: int) -> float:
    """Matmul FLOPs of prefilling ``n`` tokens (module docstring).

    Example:
        >>> prefill_flops(kv.load(), 2048) / 1e9        # doctest: +SKIP
        579.9
    """
    from mlx.utils import tree_flatten

    weights = sum(v.size for k, v in tree_flatten(model.net.parameters())
                  if v.ndim == 2 and "embed" not in k and "lm_head" not in k)
    args = model.net.args
    heads = args.num_attention_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    attending = sum(1 for kind in model.layout.kinds if kind not in ("recurrent", "none"))
    return 2.0 * n * weights + attending * 4.0 * heads * dim * n * (n + 1) / 2 + 2.0 * model.vocab_size * args.hidden_size


def _blas_rate(model, n: int) -> float:
    import mlx.core as mx

    args = model.net.args
    x = mx.random.normal((n, args.hidden_size))
    w = mx.random.normal((args.hidden_size, args.intermediate_size))
    mx.eval(x, w, x @ w)
    t = timing.timed()
    mx.eval(x @ w)
    return 2.0 * n * args.hidden_size * args.intermediate_size / t.done()


def _contenders(model):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from ..models import attention
    from ..primitives.snapshots import prefill

    def ours(ids, kernel):
        with attention.using(kernel):
            prefill(model, ids)

    def mlx_lm_own(ids):
        attention.uninstall()
        try:
            next(generate_step(mx.array(ids), model.net, max_tokens=1))
        finally:
            attention.install()

    return {KVLAB: lambda ids: ours(ids, None), MLX: lambda ids: ours(ids, "mlx"), MLX_LM: mlx_lm_own}


def bench_prefill(model, repeats: int, lengths=LENGTHS) -> Table:
    """Prefill tokens/s per contender and length, and the BLAS-rate limit, interleaved over repeats.

    Example:
        >>> bench_prefill(kv.load("tiny"), 2, lengths=(64,)).columns[0]
        'prefill'
    """
    from ..models import attention

    contenders = _contenders(model)
    base = model.check_ids(range(1000, 1000 + max(lengths)))
    contenders[KVLAB](base[:16])  # compiled kernels and first-call allocations out of the timings
    secs = {name: {n: [] for n in lengths} for name in contenders}
    rates = {n: [] for n in lengths}
    for _ in range(max(repeats, 1)):
        for n in lengths:
            ids = list(base[:n])
            for name, fn in contenders.items():  # interleaved: every contender sees the same load
                t = timing.timed()
                fn(ids)
                secs[name][n].append(t.done())
            rates[n].append(_blas_rate(model, n))
    limit = {n: prefill_flops(model, n) / spread(rates[n])["median"] for n in lengths}
    stats = {name: {n: spread(n / x for x in secs[name][n]) for n in lengths} for name in contenders}
    rows = [(name, *(median_range(stats[name][n]) for n in lengths)) for name in contenders]
    rows.append(("limit: matmul FLOPs at the BLAS rate", *(f"{n / limit[n]:.0f}" for n in lengths)))
    rows.append((f"{KVLAB}: x the limit", *(f"{n / stats[KVLAB][n]['median'] / limit[n]:.2f}x" for n in lengths)))
    rows.append((f"{MLX}: x the limit", *(f"{n / stats[MLX][n]['median'] / limit[n]:.2f}x" for n in lengths)))
    return Table(f"prefill tokens/s of long prompts ({model.name}, {model.dtype})",
                 f"kvlab bench --only prefill --model {model.name} --repeats {repeats}",
                 ("prefill", *(f"{n:,} tokens" for n in lengths)), tuple(rows),
                 f"tokens/s median (min-max) over {max(repeats, 1)} repeats, interleaved. kvlab's attention here is "
                 f"`{attention.kernel_name()}` (kvlab.device's choice); the limit row is the prompt's matmul FLOPs "
                 "(kvlab/bench/prefill.py) at the GFLOP/s of a float32 matmul of the model's MLP shape measured "
                 "between the prefills.",
                 values={"model": model.name, "lengths": list(lengths), "judged": JUDGED, "kernel": attention.kernel_name(),
                         "tokens_per_s": stats, "limit_seconds": limit,
                         "blas_gflops": {n: spread(rates[n])["median"] / 1e9 for n in lengths}})


def table(s: Settings) -> Table:
    return bench_prefill(s.model, s.repeats)
