"""What tenant isolation costs per request, model-free: a RadixStore lookup of a 4096-token prompt
keyed unsalted, salted, and salted after a 1024-token public prefix (the reuse core's key work:
``CacheKey.symbols`` tags every salted token); identifying a caller among 1000 keys (constant
time: every key compared); and the audit's exact KS p-value at 250 + 250 samples.

Contenders run interleaved over repeats; ratios are against the unsalted lookup."""

from __future__ import annotations

from .settings import Settings
from .table import Table, ms, spread

NEEDS_MODEL = False
PROMPT, PUBLIC = 4096, 1024


def _contenders():
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from ..primitives.snapshots import snapshot
    from ..primitives.tokens import from_ids
    from ..stores import RadixStore
    from ..tenants import KeyRing, Namespace, PublicPrefixes, key_of, parse_keys
    from ..audit.ks import ks_less

    ids = [(i * 7919) % 50000 for i in range(PROMPT)]
    toks = from_ids(ids)
    cache = KVCache()
    k = mx.zeros((1, 1, PROMPT, 8))
    cache.state = (k, k, PROMPT)
    snap = snapshot([cache], tokens=ids)
    public = PublicPrefixes([ids[:PUBLIC]])
    spaces = {"unsalted": (None, None), "tenant salt": (Namespace("a", "t:ab"), None),
              "salt after a public prefix": (Namespace("a", "t:ab"), public)}
    stores = {}
    for name, (ns, pub) in spaces.items():
        store = RadixStore()
        store.insert(key_of(toks, ns, pub), toks, snap)
        stores[name] = store

    def lookup(name):
        ns, pub = spaces[name]
        return lambda: stores[name].lookup(key_of(toks, ns, pub), toks, limit=PROMPT - 1).tokens

    ring = KeyRing(parse_keys("\n".join(f"key-{i:04d} t{i % 50}" for i in range(1000))), admin_key="root")
    hit, miss = [0.01 * i for i in range(250)], [0.01 * i + 0.6 for i in range(250)]
    return {**{f"radix lookup, {n}": lookup(n) for n in spaces},
            "identify a key among 1000": lambda: ring.identify("key-0999"),
            "exact KS p-value, 250 + 250": lambda: ks_less(hit, miss).p}


def table(s: Settings) -> Table:
    from ..primitives import timing

    fns = _contenders()
    seconds = {name: [] for name in fns}
    for _ in range(max(1, s.repeats)):
        for name, fn in fns.items():
            t0 = timing.timed()
            fn()
            seconds[name].append(t0.done())
    stats = {name: spread(v) for name, v in seconds.items()}
    base = stats["radix lookup, unsalted"]["median"]
    rows = tuple((name, ms(v), f"{v['median'] / base:.2f}x" if name.startswith("radix") else "")
                 for name, v in stats.items())
    return Table(f"tenant isolation per request (model-free; {PROMPT}-token prompt)",
                 f"kvlab bench --only tenants --repeats {s.repeats}", ("step", "ms", "vs unsalted lookup"), rows,
                 "The salt's cost on a request is the tagged key (one tuple per token past the public prefix); "
                 "identifying a caller compares every key, so it grows with the keys file, not with the caller.",
                 values=stats)
