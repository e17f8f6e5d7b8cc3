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
# # 16 · Cache privacy: attacks on a shared prefix cache, and what each defence costs
#
# A prefix cache shared between users is a side channel. Three attacks, run from an attacker's
# key against a victim's cached prompt (`kvlab.audit.attacks`, loopback only, a bounded number of
# requests):
#
# - **A, metadata**: a 6-digit PIN after a known prefix, read from `cached_tokens` one digit guess
#   per query (at most 10 a digit, 60 in all);
# - **B, timing only**: which of K candidates the victim placed before a known long tail, from the
#   fastest first token among K probes;
# - **C, diagnostics**: the victim's prompt text through `prompt_cache_options` and a response id
#   listed by `/kvlab/requests` (issue 33's transcript).
#
# against plain **mlx_lm.server**, **kvlab serve** without tenants, and **kvlab serve with
# `--api-keys`** (victim and attacker in different tenants: salted keys, scoped metadata). Then the
# defences, each with its cost: the tenant salt (hit rate lost against the number of tenants,
# computed exactly by the simulator and checked on the server), a public system prompt shared
# before the salt, block granularity, padding TTFT to a constant, and random jitter.

# %%
import kvlab as kv  # first: loads OpenBLAS before MLX (~40x faster float32 matmuls on Linux)
import random
import tempfile
from pathlib import Path

import httpx
import polars as pl
from IPython.display import Markdown

from kvlab.audit import Profile, audit, critical_d, ks_less
from kvlab.audit.attacks import pin_by_cached_tokens, prompt_by_diagnostics, secret_by_timing
from kvlab.audit.probe import Probe, letters, text
from kvlab.serving import peers
from kvlab.serving.tenanted import public_ids

# %% tags=["parameters"]
model = "tiny"          # the served model, the same folder everywhere ("smollm2": the real SmolLM2-135M, slower)
pin = "482913"          # attack A's secret: 6 digits after a known prefix
budget = 60             # attack A's query budget
candidates = 5          # attack B's K
trials = 3              # attack B's secrets tried per server
tail_letters = 400      # attack B's known tail (random letters): what a hit saves
audit_samples = 20      # hit and miss samples of the small audit under each defence
audit_letters = 300     # its prompt length (letters)
tenant_counts = [1, 2, 4, 8]  # tenants sharing one system prompt (the salt's cost)
per_tenant = 4          # requests per tenant in the hit-rate workload
block_size = 16         # the paged store's (and the simulator's) block
seed = 0
results_path = None     # None: a fresh runs/<notebook>-<timestamp>/results.parquet

# %%
m = kv.load(model)
rng = random.Random(seed)
home = Path(tempfile.mkdtemp(prefix="kvlab-16-"))
KEYS = {"victim-key": "alice", "attacker-key": "bob"}
KNOWN = "Note for my assistant: my bank PIN is "
SECRET_TEXT = f"{KNOWN}{pin}. Never share it. Patient John Smith, SSN 123-45-6789, diagnosis: hepatitis B."
TAILS = [text(letters(random.Random(seed + 1 + t), tail_letters)) for t in range(trials)]  # fresh a trial
NAMES = ["Alice", "Bruno", "Chen", "Dmitri", "Esther", "Farah", "Gustav", "Hiro"][:candidates]
rows = []


def servers():
    """(name, running server, victim key, attacker key) for each server under attack, started in turn."""
    yield "mlx_lm.server", peers.start_mlx_lm(m, prompt_cache_size=64), None, None
    yield "kvlab serve", kv.serve(m, "radix", api_key=""), None, None
    yield "kvlab serve, tenants", kv.serve(m, "radix", api_keys=KEYS, tenant_secret=home / "secret"), \
        "victim-key", "attacker-key"


# %% [markdown]
# ## 1 · The attacks
#
# Each server starts empty (mlx_lm.server with room for 64 prompts: its default keeps 10, and the
# attacker's own probes would push the victim's note out before the attack ends; a busy server
# keeps many more). The victim sends its note once; the attacker, with its own key, runs C
# first (the note's text through the diagnostics, where the server has them: with every response
# id it can list, and the victim's own id as if learnt elsewhere), then A (digits of the PIN), then
# B over `trials` secrets (for each, the victim sends `secret + tail` once, a fresh tail each time,
# and the attacker probes the K candidates once each: they differ from their first token, so no
# probe reuses another's).

# %%
for name, server, vkey, akey in servers():
    with server:
        url = server.url
        with Probe(url, vkey) as victim:
            victim_id = victim.send(SECRET_TEXT)
            if name.startswith("kvlab"):
                guess = KNOWN + "x"  # no digit: it leaves attack A nothing of its own to find
                c = prompt_by_diagnostics(url, akey, guess=guess, known_ids=[victim_id], secret=SECRET_TEXT)
                rows.append({"section": "attack", "target": name, "item": "C: prompt via diagnostics",
                             "queries": c.queries, "success": c.leaked > 0, "score": c.leaked,
                             "recovered": c.recovered})
            a = pin_by_cached_tokens(url, akey, known=KNOWN, digits=len(pin), model=m, secret=pin, budget=budget)
            rows.append({"section": "attack", "target": name, "item": "A: PIN via cached_tokens",
                         "queries": a.queries, "success": a.success, "score": a.correct_prefix,
                         "recovered": a.recovered})
            wins, asked = 0, 0
            for t in range(trials):
                secret = NAMES[(seed + t) % len(NAMES)]
                victim.send(f"{secret} {TAILS[t]}")
                order = NAMES[t % len(NAMES):] + NAMES[:t % len(NAMES)]  # the secret is not always first
                b = secret_by_timing(url, akey, candidates=order, tail=TAILS[t], secret=secret)
                wins += b.success
                asked += b.queries
            rows.append({"section": "attack", "target": name, "item": "B: secret via timing",
                         "queries": asked, "success": wins == trials, "score": wins, "recovered": f"{wins}/{trials}"})
pl.DataFrame(rows).select("target", "item", "queries", "score", "recovered")

# %% [markdown]
# ## 2 · Defences: block granularity
#
# A paged store reuses whole blocks only, so `cached_tokens` moves in steps of `block_size`: a
# single guessed digit changes it only when it completes a block. Attack A against kvlab serve
# with `--store paged` (no tenants):

# %%
with kv.serve(m, "paged", api_key="", block_size=block_size) as server, Probe(server.url, None) as victim:
    victim.send(SECRET_TEXT)
    a = pin_by_cached_tokens(server.url, None, known=KNOWN, digits=len(pin), model=m, secret=pin, budget=budget)
rows.append({"section": "defence", "target": "kvlab serve, paged", "item": "A: PIN via cached_tokens",
             "queries": a.queries, "success": a.success, "score": a.correct_prefix, "recovered": a.recovered})
a

# %% [markdown]
# ## 3 · Defences against timing: padding TTFT, jitter, isolation
#
# A small audit (`kvlab.audit`, Gu et al.'s procedure with `audit_samples` + `audit_samples`
# samples of `audit_letters` letters, 95% shared) between two clients of kvlab serve without
# tenants, then between two tenants. Padding every time to first token up to a constant and adding
# uniform random jitter are applied to the measured times (what the audit would read if the server
# did so); each costs the latency it adds to every request.

# %%
small = Profile("notebook", audit_letters, audit_samples, (0.95,), (1,))
with kv.serve(m, "radix", api_key="") as server:
    shared = audit(server.url, "victim", "attacker", levels=["cross-tenant"], profile=small, seed=seed).levels[0]
with kv.serve(m, "radix", api_keys=KEYS, tenant_secret=home / "secret2") as server:
    isolated = audit(server.url, "victim-key", "attacker-key", levels=["cross-tenant"], profile=small, seed=seed).levels[0]

hit, miss = shared.hit, shared.miss
pad = max(hit + miss)
jrng = random.Random(seed)
spread = sorted(miss)[len(miss) // 2] - sorted(hit)[len(hit) // 2]
defended = {"none": (hit, miss, 0.0), "pad TTFT to the slowest": ([max(t, pad) for t in hit], [max(t, pad) for t in miss], None),
            "jitter U(0, gap)": ([t + jrng.uniform(0, spread) for t in hit], [t + jrng.uniform(0, spread) for t in miss], spread / 2),
            "jitter U(0, 10 x gap)": ([t + jrng.uniform(0, 10 * spread) for t in hit],
                                     [t + jrng.uniform(0, 10 * spread) for t in miss], 10 * spread / 2)}
need = critical_d(audit_samples, audit_samples, 1e-8)
for label, (h, mi, added) in defended.items():
    r = ks_less(h, mi)
    cost = (sum(max(t, pad) - t for t in hit + miss) / len(hit + miss)) if added is None else added
    rows.append({"section": "timing", "target": "kvlab serve", "item": label, "ks_d": r.d, "p": r.p,
                 "success": r.d >= need, "added_ms": cost * 1e3})
r = isolated.ks
rows.append({"section": "timing", "target": "kvlab serve, tenants", "item": "tenant salt", "ks_d": r.d, "p": r.p,
             "success": r.d >= need, "added_ms": 0.0})
print(f"the audit rejects at D+ >= {need:.2f} with {audit_samples} + {audit_samples} samples (alpha 1e-8)")

# %% [markdown]
# ## 4 · The tenant salt's cost, exactly: hit rate against the number of tenants
#
# A workload where every request sends one system prompt and its own question, `per_tenant`
# requests per tenant, tenants taking turns. Salted, each tenant pays the system prompt once; with
# the system prompt declared public (`public_prefix`), only the tokens after it are salted. The
# simulator replays the exact token ids and keys (`kv.traces.from_requests` with a salt per
# tenant, or the salt as an extra key after the public prefix, blocks of `block_size`); the
# server (a paged store, the simulator's block) runs the same requests at 4 tenants.

# %%
SYSTEM = ("You are the support assistant of a small research lab. Answer in one short sentence, "
          "cite no sources, never use lists, and say so when you do not know. ") * 2


def workload(tenants):
    reqs = []
    for i in range(tenants * per_tenant):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}: what is item {i * 7}?"}]
        reqs.append((f"t{i % tenants}", msgs, tuple(m.tokenise(msgs).ids)))
    return reqs


P = len(public_ids(m, SYSTEM))


def simulated(tenants, mode):
    reqs = workload(tenants)
    ids = [r[2] for r in reqs]
    keys = [None if mode == "shared" or mode == "public" else r[0] for r in reqs]
    spans = [((P, P + 1, r[0]),) if mode == "public" else () for r in reqs]
    trace = kv.traces.from_requests(ids, 2, block_size, keys=keys, spans=spans)
    res = kv.simulate(trace, "lru", block_size=block_size)
    return res.summary["hit_tokens"] / res.summary["prompt_tokens"]


def served(tenants, mode):
    keys = {f"key-{t}": f"t{t}" for t in range(tenants)}
    kw = dict(api_keys=keys, tenant_secret=home / f"secret-{mode}") if mode != "shared" else dict(api_key="")
    if mode == "public":
        kw["public_prefix"] = SYSTEM
    with kv.serve(m, "paged", block_size=block_size, **kw) as server, httpx.Client(timeout=120) as http:
        for tenant, msgs, _ in workload(tenants):
            auth = {} if mode == "shared" else {"Authorization": f"Bearer key-{tenant[1:]}"}
            http.post(server.url + "/v1/chat/completions", headers=auth,
                      json={"model": "m", "max_tokens": 2, "messages": msgs}).raise_for_status()
        s = server.stats()
    return s["reused_tokens"] / s["prompt_tokens"]


for tenants in tenant_counts:
    for mode in ("shared", "salted", "public"):
        rows.append({"section": "tenant_cost", "target": "simulator", "item": mode, "tenants": tenants,
                     "hit_rate": simulated(tenants, mode)})
check = 4 if 4 in tenant_counts else tenant_counts[-1]
for mode in ("shared", "salted", "public"):
    rows.append({"section": "tenant_cost", "target": "kvlab serve, paged", "item": mode, "tenants": check,
                 "hit_rate": served(check, mode)})

# %% [markdown]
# ## Results
#
# One row per attack (`score`: PIN digits or secret characters recovered, or trials won), per
# timing defence (`ks_d`, `p`: the audit's statistic on the defended times; `success`: the audit
# would say "shared"; `added_ms`: the mean latency the defence adds), per tenant count and mode
# (`hit_rate`: reused / prompt tokens).

# %%
results = pl.DataFrame(rows, schema={
    "section": pl.Utf8, "target": pl.Utf8, "item": pl.Utf8, "queries": pl.Int64, "success": pl.Boolean,
    "score": pl.Int64, "recovered": pl.Utf8, "ks_d": pl.Float64, "p": pl.Float64, "added_ms": pl.Float64,
    "tenants": pl.Int64, "hit_rate": pl.Float64})
results = kv.runner.save_results(results, results_path, "16_cache_privacy")
results.filter(pl.col("section") == "attack").select("target", "item", "queries", "score", "recovered", "success")

# %% [markdown]
# ## 5 · Attack success, and the defences side by side

# %%
def figures():
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    cost = results.filter(pl.col("section") == "tenant_cost")
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "hit rate against tenants (lines: simulator; markers: server)", "audit D+ under each timing defence"))
    colours = {"shared": "#2166ac", "salted": "#b2182b", "public": "#1b7837"}
    for mode, colour in colours.items():
        sim = cost.filter((pl.col("target") == "simulator") & (pl.col("item") == mode)).sort("tenants")
        fig.add_trace(go.Scatter(x=sim["tenants"], y=sim["hit_rate"] * 100, mode="lines+markers", name=f"{mode} (simulator)",
                                 line_color=colour), row=1, col=1)
        srv = cost.filter((pl.col("target") != "simulator") & (pl.col("item") == mode))
        fig.add_trace(go.Scatter(x=srv["tenants"], y=srv["hit_rate"] * 100, mode="markers", name=f"{mode} (server)",
                                 marker=dict(color=colour, size=14, symbol="x")), row=1, col=1)
    t = results.filter(pl.col("section") == "timing")
    fig.add_trace(go.Bar(x=t["item"], y=t["ks_d"], name="audit D+", marker_color="#762a83"), row=1, col=2)
    fig.add_hline(y=need, line_dash="dot", annotation_text=f"rejects at {need:.2f}", row=1, col=2)
    fig.update_xaxes(title_text="tenants sharing the server", row=1, col=1)
    fig.update_yaxes(title_text="prompt tokens reused (%)", row=1, col=1)
    fig.update_xaxes(title_text="defence", row=1, col=2)
    fig.update_yaxes(title_text="KS statistic D+ (hit vs miss TTFT)", range=[0, 1.05], row=1, col=2)
    fig.update_layout(height=430, width=1200, title=f"The salt's cost ({per_tenant} requests a tenant, "
                      f"blocks of {block_size}) and the timing defences ({audit_samples}+{audit_samples} samples) on {model}")
    return fig


try:
    figure = figures()
except ImportError as e:  # plotly comes with the notebook extras
    figure = f"plotly is not available: {e}"
figure

# %% [markdown]
# ## Findings

# %%
att = {(r["target"], r["item"][0]): r for r in results.filter(pl.col("section") == "attack").iter_rows(named=True)}
tim = {r["item"]: r for r in results.filter(pl.col("section") == "timing").iter_rows(named=True)}
cost = results.filter(pl.col("section") == "tenant_cost")


def rate(target, mode, tenants):
    r = cost.filter((pl.col("target") == target) & (pl.col("item") == mode) & (pl.col("tenants") == tenants))
    return r["hit_rate"].item()


def said(target):
    a, b = att[(target, "A")], att[(target, "B")]
    c = att.get((target, "C"))
    return (f"{target}: A {a['score']} of {len(pin)} digits in {a['queries']} queries, B won {b['recovered']} trials "
            f"(chance: 1 in {candidates}), " + ("C not applicable (no diagnostics)" if c is None else
                                                f"C {c['score']} characters of the victim's prompt"))


iso, shared_ks = tim["tenant salt"], tim["none"]
padded = tim["pad TTFT to the slowest"]
big_jitter = tim["jitter U(0, 10 x gap)"]
hi = max(tenant_counts)
exact = all(abs(rate("kvlab serve, paged", mode, check) - rate("simulator", mode, check)) < 1e-12
            for mode in ("shared", "salted", "public"))
paged = results.filter(pl.col("target") == "kvlab serve, paged").row(0, named=True)
tenants = "kvlab serve, tenants"
# B's wins are a few guesses among K (chance wins some): the audit says whether timing still tells
blocked = att[(tenants, "A")]["score"] == 0 and att[(tenants, "C")]["score"] == 0 and iso["ks_d"] < need
lost = rate("simulator", "shared", hi) - rate("simulator", "salted", hi)
back = (rate("simulator", "public", hi) - rate("simulator", "salted", hi)) / lost if lost > 0 else 0.0
verdict = (f"**Turn on tenants (`kvlab serve --api-keys`) and declare the common system prompt public "
           f"(`--public-prefix`): across tenants the salt left attacks A and C nothing and the audit no timing gap, and the public prompt wins back "
           f"{back:.0%} of the hit rate the salt costs.**" if blocked else
           "**Tenants did not stop every attack here: see the attack rows for the tenant-salted server.**")
granular = (f"Block granularity ({block_size}-token blocks) stopped attack A here: {paged['score']} of {len(pin)} "
            f"digits in {paged['queries']} queries, because `cached_tokens` moves a block at a time and a guessed "
            f"digit shows only when it completes one; guessing whole blocks costs up to 10^k queries for k digits "
            f"in a block, and it changes nothing for timing (B) or the diagnostics (C)." if paged["score"] < len(pin) else
            f"Block granularity did not stop attack A: {paged['score']} of {len(pin)} digits in {paged['queries']} queries.")
finding = (
    f"{verdict} {said('mlx_lm.server')}; {said('kvlab serve')}; {said(tenants)}. "
    f"Across tenants the audit's D+ fell from {shared_ks['ks_d']:.2f} (p {shared_ks['p']:.2g}) to {iso['ks_d']:.2f} "
    f"(p {iso['p']:.2g}; it rejects at {need:.2f}) at no latency cost. The price is the hit rate: with one system "
    f"prompt shared by {hi} tenants the simulator gives {rate('simulator', 'shared', hi):.1%} reused unsalted, "
    f"{rate('simulator', 'salted', hi):.1%} salted and {rate('simulator', 'public', hi):.1%} salted after the public "
    f"prompt; at {check} tenants the server measured {rate('kvlab serve, paged', 'shared', check):.1%}, "
    f"{rate('kvlab serve, paged', 'salted', check):.1%} and {rate('kvlab serve, paged', 'public', check):.1%}"
    f"{', exactly the simulator' if exact else ' (the simulator said otherwise: see the table)'}. {granular} "
    f"Padding every first token to the slowest one hides timing (D+ {padded['ks_d']:.2f}) but adds "
    f"{padded['added_ms']:.0f} ms to the mean request and leaves `cached_tokens` and the diagnostics as they were; "
    f"jitter of ten times the median gap left D+ {big_jitter['ks_d']:.2f} for {big_jitter['added_ms']:.0f} ms a "
    f"request. Only isolation closes all three channels, at no latency cost.")
Markdown(finding)
