# ---
# jupyter:
#   jupytext:
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python (kvlab)
#     language: python
#     name: kvlab
# ---

# %% [markdown]
# # 08 · Assemble an engine from the primitives
#
# kvlab's primitives compose: `kv.Engine` and `kv.PagedStore` are one way to put them together, not
# the only one. This notebook builds a working vLLM-style prefix cache from the primitives alone
#
# | step | primitive |
# |---|---|
# | text -> token ids, with message spans | `kv.tokenise` |
# | a name for every full block *and everything before it* | `kv.block_hashes` |
# | the cache | a `dict`: block hash -> snapshot |
# | reuse the hit | `kv.trim`, `kv.restore` |
# | compute the rest | `kv.prefill` |
# | remember this prompt | `kv.snapshot` |
#
# and then checks it against `kv.Engine` with a `kv.PagedStore` on the same workload: per request,
# the same number of reused tokens and the same next-token logits.

# %%
import kvlab as kv  # first: loads OpenBLAS before MLX (~40x faster float32 matmuls on Linux)
import dataclasses

import mlx.core as mx
import polars as pl
from IPython.display import Markdown
from kvlab.primitives.units import fmt_bytes

# %% tags=["parameters"]
model = "tiny"            # "smollm2": the embedded SmolLM2-135M-Instruct
users = 3                 # requests sharing one system prompt (then three more, see below)
system_tokens = 200
block_size = 16           # vLLM's default
tolerance = 1e-5          # max |logit difference| that counts as "the same logits" (float32)
seed = 0
results_path = None              # None: a fresh runs/<notebook>-<timestamp>/results.parquet

# %% [markdown]
# ## The workload
#
# `users` requests with one system prompt and different questions; then an exact repeat of the
# first request; the first request's token ids cut to a whole number of blocks (requests can be
# token ids too); and a follow-up that continues the second conversation. Between them they hit
# every case a prefix cache has: a cold miss, a shared prefix, a repeat, a prefix that ends on a
# block boundary, an extension.

# %%
m = kv.load(model)
wl = kv.workloads.shared_system_prompt(num_users=users, seed=seed, system_tokens=system_tokens)
requests = [list(r.messages) for r in wl]
requests.append(requests[0])
first_ids = kv.tokenise(m, requests[0]).ids
requests.append(list(first_ids[: len(first_ids) // block_size // 2 * block_size]))
requests.append(requests[1] + [{"role": "assistant", "content": "Use the Read tool first."},
                               {"role": "user", "content": "And after that?"}])
kinds = ["first"] + ["shared system prompt"] * (users - 1) + ["exact repeat", "block-aligned ids", "follow-up"]
m, [len(kv.tokenise(m, r)) for r in requests]

# %% [markdown]
# ## The prefix cache, in one function
#
# 1. **Tokenise.** The chat template renders the request; the cache works on its token ids.
# 2. **Hash the full blocks.** `kv.block_hashes` chains each block's hash to its parent's, so hash
#    *i* names the whole prefix `ids[:(i + 1) * block_size]`, not just block *i*: equal hashes mean
#    equal prefixes, and one dict lookup per block finds the longest cached prefix. A partial last
#    block has no hash, so only full blocks are ever reused (as in vLLM).
# 3. **Look up.** Walk the hashes while they are in the dict, stopping before the block that holds
#    the last token: that token is always computed, because its logits start generation (so a
#    prompt of exactly *k* cached blocks reuses *k - 1* of them).
# 4. **Restore.** The snapshot under the last hit may hold a longer prompt (the one that stored
#    it): `kv.trim` gives a new snapshot of exactly the reused tokens, `kv.restore` turns it into
#    fresh mlx-lm cache objects. Snapshots are never written to, so one can serve many requests.
# 5. **Prefill the rest** on top of the restored cache; the last position's logits come back.
# 6. **Snapshot and insert.** `kv.snapshot` is copy-free (it keeps views of the cache's arrays),
#    and the dict files it under every block hash it covers that is not cached yet.

# %%
snapshots = {}  # block hash -> a snapshot holding (at least) every token up to the end of that block


def run(request):
    toks = kv.tokenise(m, request)                                          # 1
    hashes = kv.block_hashes(toks, block_size)                              # 2
    hit = 0                                                                 # 3
    while hit < (len(toks.ids) - 1) // block_size and hashes[hit] in snapshots:
        hit += 1
    reused, cache = hit * block_size, None
    if hit:                                                                 # 4
        snap = snapshots[hashes[hit - 1]]
        cache = kv.restore(kv.trim(snap, snap.offset - reused))
    logits, cache = kv.prefill(m, toks.ids[reused:], cache)                 # 5
    snap = kv.snapshot(cache, tokens=toks.ids, model=m)                     # 6
    for h in hashes:
        snapshots.setdefault(h, snap)
    return reused, logits


assembled = [run(r) for r in requests]
[reused for reused, _ in assembled]

# %% [markdown]
# That is the whole cache. What it leaves out is what `kv.PagedStore` adds: each block's KV stored
# once (here a snapshot keeps its whole prompt, shared prefix included), reference counts, eviction
# under a byte budget, and an event for every block stored or removed.

# %% [markdown]
# ## The same workload through `kv.Engine` and `kv.PagedStore`
#
# The Engine returns results, not logits. To compare logits we give it the same model with a
# network that remembers the last position it computed: with `max_tokens=1` (no decoding) and
# no verification, the last call the Engine makes for a request is the prefill of its last token.

# %%
class Watch:
    """The model's network, keeping the logits of the last position of its last call."""

    def __init__(self, net):
        self.net, self.logits = net, None

    def __call__(self, ids, cache=None):
        out = self.net(ids, cache=cache)
        self.logits = out[0, -1].astype(mx.float32)
        return out

    def __getattr__(self, name):  # layers, make_cache, ...: the network's own
        return getattr(self.net, name)


watch = Watch(m.module)
engine = kv.Engine(dataclasses.replace(m, module=watch), kv.PagedStore(block_size=block_size), max_tokens=1)
by_engine = []
for r in requests:
    result = engine.run(r, 1)
    by_engine.append((result.reused_tokens, watch.logits))
engine.store

# %% [markdown]
# ## Results
#
# Per request: the tokens each implementation reused, and the largest difference between their
# next-token logits. As a third opinion, the assembled cache's logits are also compared with a
# cold prefill of the whole prompt (no cache at all).

# %%
rows = []
for i, (request, kind, (reused, logits), (engine_reused, engine_logits)) in enumerate(
        zip(requests, kinds, assembled, by_engine), 1):
    ids = kv.tokenise(m, request).ids
    cold, _ = kv.prefill(m, ids)
    rows.append({"request": i, "kind": kind, "prompt_tokens": len(ids),
                 "reused_tokens": reused, "engine_reused_tokens": engine_reused,
                 "max_logit_diff_vs_engine": mx.abs(logits - engine_logits).max().item(),
                 "max_logit_diff_vs_cold": mx.abs(logits - cold).max().item()})
results = pl.DataFrame(rows).with_columns(
    (pl.col("reused_tokens") == pl.col("engine_reused_tokens")).alias("same_reuse"),
    (pl.col("max_logit_diff_vs_engine") < tolerance).alias("same_logits"),
    pl.lit(tolerance).alias("tolerance"), pl.lit(block_size).alias("block_size"), pl.lit(m.name).alias("model"))
results

# %%
distinct = {id(s): s for s in snapshots.values()}  # bytes: what the snapshots and the PagedStore hold
results = results.with_columns(assembled_bytes=pl.lit(sum(s.nbytes for s in distinct.values())), store_bytes=pl.lit(engine.store.nbytes))
print(f"{len(snapshots)} block hashes -> {len(distinct)} snapshots; the PagedStore holds {engine.store.entries} blocks")
results = kv.runner.save_results(results, results_path, "08_assemble_an_engine")

# %% [markdown]
# ## Findings

# %%
same, n, b = results["same_reuse"] & results["same_logits"], results.height, results.row(0, named=True)
differ = ", ".join(f"{i} {k}" for i, k in results.filter(~same).select("request", "kind").iter_rows())
verdict = f"matches it on all {n} requests" if same.all() else f"differs from it on {n - same.sum()} of {n} requests ({differ})"
finding = (f"**The prefix cache assembled from the primitives {verdict}** (kv.Engine with kv.PagedStore): the same reused "
           f"tokens on {results['same_reuse'].sum()} of {n}, next-token logits within the {tolerance:g} tolerance on "
           f"{results['same_logits'].sum()} of {n} (at most {results['max_logit_diff_vs_engine'].max():.1e} from the engine's, "
           f"{results['max_logit_diff_vs_cold'].max():.1e} from a cold prefill). It reused {results['reused_tokens'].sum()} of "
           f"{results['prompt_tokens'].sum()} prompt tokens. What it leaves out costs memory: its snapshots hold "
           f"{fmt_bytes(b['assembled_bytes'])}, {b['assembled_bytes'] / b['store_bytes']:.1f}x the {fmt_bytes(b['store_bytes'])} "
           "kv.PagedStore holds with each block once.\n\n| request | reused / prompt tokens | kv.Engine reused | logit diff "
           "vs kv.Engine |\n|---|---|---|---|\n" + "".join(f"| {r['request']} · {r['kind']} | {r['reused_tokens']} / "
           f"{r['prompt_tokens']} | {r['engine_reused_tokens']} | {r['max_logit_diff_vs_engine']:.1e} |\n" for r in results.iter_rows(named=True)))
Markdown(finding)
