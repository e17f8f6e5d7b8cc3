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
# # 05 · Multimodal prefix caching: same token ids, different images
#
# An image request's token ids are mostly placeholders: Qwen2-VL renders every image as
# `<|vision_start|>` + *N* × `<|image_pad|>` + `<|vision_end|>`, and *N* depends only on the image's
# size. Two requests that ask the same question about two different pictures of the same size have
# **identical token ids**. A prefix cache keyed on ids alone hands the second request the first
# picture's KV (vllm-mlx#718, LMCache#690): the answer is about the wrong image and nothing fails.
#
# kvlab hashes each image's decoded pixels (`Tokens.images`) and the Engine passes the hashes as
# extra keys of the blocks that hold (or follow) the placeholders: `kv.Engine(vlm, store)` does so by
# default, `image_keys=False` reproduces the bug on purpose. Every run here uses `verify=True`,
# which compares the cached request's logits with a cold run of the same request.
#
# 1. identical ids, different images: ids-only keys vs image-aware keys;
# 2. text-only requests on the VLM reuse as they would on a text model;
# 3. text first, then the same text with an image: reuse stops exactly where the image begins;
# 4. seed 000's table (vllm-mlx#259): cold vs cached TTFT of text-only requests, per family —
#    a dense qwen2_vl, the seed's Qwen3.5 (GatedDeltaNet hybrid) and Gemma 4 (sliding window,
#    KV-shared layers) as tiny VLMs — and the wrong image on each family;
# 5. mlx-vlm's own Automatic Prefix Caching as a peer: what it reports against what it reused,
#    and the same load through it (on, off) and through `kvlab serve`.
#
# Defaults are small (tiny random-weight VLMs, 56×84 px images = 6 image tokens) so CI runs this
# in a minute or two; pass `model=` a local mlx-vlm folder (qwen2_vl, qwen3_5 or gemma4) for a
# real model.

# %%
import kvlab as kv  # first: it loads a fast BLAS before MLX
import numpy as np
import polars as pl
from PIL import Image
from kvlab.primitives.tolerance import tolerance as logit_tolerance
from IPython.display import Markdown

# %% tags=["parameters"]
model = "tiny"            # "tiny" (random-weight qwen2_vl, built offline) or a local mlx-vlm folder
image_hw = [56, 84]       # synthetic picture size in pixels (tiny: 56x84 -> 6 image tokens)
pairs = 3                 # request pairs with identical ids and different pictures
stores = ["radix", "paged"]
block_size = 16           # PagedStore block size (vLLM's default)
max_tokens = 4            # tokens generated per request
tolerance = None          # max |logit difference| that still counts as "same as cold"; None: kvlab's
                          # table for the model's dtype (kvlab.primitives.tolerance: 1e-4 in float32)
seed = 0
families = ["tiny", "tiny-vlm:qwen3_5", "tiny-vlm:gemma4"]  # section 4: one VLM per cache family
system_tokens = 600       # section 4: the shared system prompt's length (tokens, about)
ttft_repeats = 5          # section 4: cached requests per family (TTFT: median over them)
peer_models = ["tiny-vlm", "tiny-vlm:qwen3_5", "tiny-vlm:gemma4"]  # section 5: VLMs served by mlx-vlm (APC on/off) and kvlab serve; [] skips
peer_traffic = ["text", "mixed"]  # section 5: text-only and mixed (every second request an image)
peer_requests = 8         # section 5: requests per server
peer_store = "radix"      # section 5: kvlab serve's store
results_path = None              # None: a fresh runs/<notebook>-<timestamp>/results.parquet

# %%
vlm = kv.load_vlm(model)
tolerance = logit_tolerance(vlm.dtype) if tolerance is None else tolerance
vlm

# %% [markdown]
# ## The pictures
#
# Smooth random colour fields, all the same size, so every request below has the same number of
# image tokens.

# %%
rng = np.random.default_rng(seed)
h, w = image_hw


def picture(rng):
    # a 3x4 random colour grid, smoothly upscaled: distinct pictures of one size
    small = Image.fromarray(rng.integers(0, 256, (3, 4, 3), dtype=np.uint8))
    return small.resize((w, h), Image.Resampling.BICUBIC)


pictures = [picture(rng) for _ in range(2 * pairs + 1)]
strip = Image.new("RGB", (len(pictures) * (w + 4), h), "white")
for i, p in enumerate(pictures):
    strip.paste(p, (i * (w + 4), 0))
strip

# %%
SYSTEM = "You describe pictures in one short sentence. Be precise and plain."


def ask(image, question="What is in this picture?"):
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                         {"type": "image", "image": image},
                                         {"type": "text", "text": question}]}]


a, b = kv.tokenise(vlm, ask(pictures[0])), kv.tokenise(vlm, ask(pictures[1]))
print("identical token ids:", a.ids == b.ids, f"({len(a.ids)} tokens)")
print("picture 0:", a.images[0], a.images[0].hash[:16])
print("picture 1:", b.images[0], b.images[0].hash[:16])
a

# %% [markdown]
# ## What the wrong KV does to the logits
#
# Prefill request *b* three ways: cold; on top of request *a*'s cache trimmed to *n − 1* tokens
# (what an ids-only key finds: everything but the last token "matches"); and on top of *a*'s cache
# trimmed to the first placeholder (what image-aware keys allow).

# %%
cold_logits, _ = vlm.prefill(b)
_, cache_a = vlm.prefill(a)
snap_a = kv.snapshot(cache_a)
start = b.images[0].token_start
ids_only_logits, _ = vlm.prefill(b, kv.restore(kv.trim(snap_a, 1)))
image_aware_logits, _ = vlm.prefill(b, kv.restore(kv.trim(snap_a, snap_a.offset - start)))


def top(logits, k=5):
    order = np.argsort(-np.array(logits))[:k]
    return [f"{vlm.tokenizer.decode([int(t)])!r} {float(logits[int(t)]):.2f}" for t in order]


print(f"max |logit - cold|: ids-only {float(abs(ids_only_logits - cold_logits).max()):.3g}, "
      f"image-aware {float(abs(image_aware_logits - cold_logits).max()):.3g}")
pl.DataFrame({"rank": range(1, 6), "cold": top(cold_logits), "ids-only keys": top(ids_only_logits),
              "image-aware keys": top(image_aware_logits)})


# %% [markdown]
# ## 1 · Identical ids, different images, through the Engine
#
# Each pair runs on a fresh store: picture *2i* first (it fills the cache), then picture *2i + 1*
# with the same question. Expected reuse: ids-only keys match all but the last token; image-aware
# keys stop at the first placeholder (block-rounded for the paged store).

# %%
def make_store(name):
    return kv.stores.make_store(name, block_size=block_size)


def rounded(n, store):
    # a paged store reuses whole blocks only
    return n // block_size * block_size if store == "paged" else n


cold_engine = kv.Engine(vlm, None)  # the reference: no cache at all
rows = []


def record(experiment, store, keys, r, request, expected):
    ref = cold_engine.run(request, max_tokens)
    rows.append({"experiment": experiment, "store": store, "keys": keys, "request": r.request_id,
                 "prompt_tokens": r.prompt_tokens, "reused_tokens": r.reused_tokens,
                 "expected_reused": expected, "verify_diff": float(r.verify_diff),
                 "matches_cold": bool(r.verify_diff <= tolerance),
                 "same_output": r.output_ids == ref.output_ids, "output": r.text,
                 "cold_output": ref.text})


for store in stores:
    for image_keys in (False, True):
        keys = "image-aware" if image_keys else "ids-only"
        for i in range(pairs):
            engine = kv.Engine(vlm, make_store(store), image_keys=image_keys, verify=True)
            first, second = ask(pictures[2 * i]), ask(pictures[2 * i + 1])
            engine.run(first, max_tokens)
            r = engine.run(second, max_tokens)
            toks = kv.tokenise(vlm, second)
            expected = toks.images[0].token_start if image_keys else len(toks.ids) - 1
            record("different images", store, keys, r, second, rounded(expected, store))

frame = pl.DataFrame(rows)
frame.select("store", "keys", "prompt_tokens", "reused_tokens", "expected_reused", "verify_diff",
             "matches_cold", "same_output", "output", "cold_output")

# %% [markdown]
# ## 2 · Text-only requests on the VLM
#
# A growing conversation without images: each turn should reuse the previous prompt, exactly as on
# a text model (image keys only apply to image requests).

# %%
questions = ["Name a colour.", "Another one, please.", "Which of the two is warmer?"]
for store in stores:
    engine = kv.Engine(vlm, make_store(store), verify=True)
    conversation, previous = [{"role": "system", "content": SYSTEM}], []
    for q in questions:
        conversation = conversation + [{"role": "user", "content": q}]
        ids = kv.tokenise(vlm, conversation).ids
        shared = max([kv.tokens.common_prefix_len(p, ids) for p in previous] or [0])
        r = engine.run(conversation, max_tokens)
        record("text only", store, "image-aware", r, conversation, rounded(min(shared, len(ids) - 1), store))
        previous.append(ids)
        conversation = conversation + [{"role": "assistant", "content": "Blue."}]

pl.DataFrame(rows).filter(pl.col("experiment") == "text only").select(
    "store", "prompt_tokens", "reused_tokens", "expected_reused", "verify_diff", "matches_cold")

# %% [markdown]
# ## 3 · Text first, then the same text with an image
#
# The image request shares the text before its image with the text-only request. The two part ways
# at `<|vision_start|>` (token `token_start - 1`), which a text-only prompt does not have there: that
# is exactly where reuse must stop.

# %%
text_first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Look:"}]
with_image = ask(pictures[-1])
toks = kv.tokenise(vlm, with_image)
for store in stores:
    engine = kv.Engine(vlm, make_store(store), verify=True)
    engine.run(text_first, max_tokens)
    r = engine.run(with_image, max_tokens)
    record("text then image", store, "image-aware", r, with_image,
           rounded(toks.images[0].token_start - 1, store))

pl.DataFrame(rows).filter(pl.col("experiment") == "text then image").select(
    "store", "prompt_tokens", "reused_tokens", "expected_reused", "verify_diff", "matches_cold")

# %% [markdown]
# ## 4 · Seed 000's table: cold vs cached TTFT of text-only requests, per family
#
# Seed 000 (vllm-mlx#259) caches text-only requests of a VLM server and measures TTFT cold and
# cached: Gemma 4 26B-A4B 1.94x, Gemma 4 31B 1.52x, Qwen3.5-27B 2.67x on an M3 Ultra. Here each
# family's tiny VLM serves `ttft_repeats` users who share a system prompt of about
# `system_tokens` tokens and ask different questions: cold is a fresh engine with no store, cached
# is the second user onwards on an engine whose store holds the first user's prompt. Every cached
# request is verified against a cold prefill. The speedup's shape (how much of the prompt the
# shared prefix is) carries over; the absolute milliseconds are a tiny model's on this CPU.

# %%
SEED_000 = {"Gemma 4 26B-A4B (MoE)": (497, 255), "Gemma 4 31B (Dense)": (1055, 691),
            "Gemma 4 26B Uncensored": (651, 302), "Qwen3.5-27B": (871, 326)}  # cold ms, cached ms
text_rng = np.random.default_rng(seed)
long_system = SYSTEM + " " + kv.workloads.text.prose(text_rng, system_tokens)
questions_4 = [kv.workloads.text.question(text_rng, 12) for _ in range(ttft_repeats + 1)]


def user(q):
    return [{"role": "system", "content": long_system}, {"role": "user", "content": q}]


ttft_rows = []
for name in families:
    fam = kv.load_vlm(name) if name == "tiny" else kv.load(name)
    fam_tol = logit_tolerance(fam.dtype)
    cold = kv.Engine(fam, None)
    cached = kv.Engine(fam, kv.stores.make_store("radix"), verify=True)
    cold.run(user(questions_4[0]), 1)  # warm-up: first-call compilation is no one's TTFT
    cached.run(user(questions_4[0]), 1)  # the first user fills the cache
    first = kv.tokenise(fam, user(questions_4[0])).ids
    for q in questions_4[1:]:
        c, r = cold.run(user(q), 1), cached.run(user(q), 1)
        toks = kv.tokenise(fam, user(q))
        ttft_rows.append({"model": name, "arch": fam.arch, "family": fam.layout.summary(),
                          "prompt_tokens": r.prompt_tokens, "reused_tokens": r.reused_tokens,
                          "shared_prefix_tokens": kv.tokens.common_prefix_len(first, toks.ids),
                          "system_ends_at": toks.spans[0].token_end,
                          "cold_ttft_ms": c.ttft_s * 1e3, "cached_ttft_ms": r.ttft_s * 1e3,
                          "verify_diff": float(r.verify_diff), "matches_cold": bool(r.verify_diff <= fam_tol)})
ttft = pl.DataFrame(ttft_rows)
seed_table = (ttft.group_by("model", "arch", "family", maintain_order=True)
              .agg(pl.col("prompt_tokens").median(), pl.col("reused_tokens").median(),
                   pl.col("cold_ttft_ms").median().alias("cold ms"), pl.col("cached_ttft_ms").median().alias("cached ms"),
                   pl.col("matches_cold").all(), pl.col("verify_diff").max())
              .with_columns((pl.col("cold ms") / pl.col("cached ms")).alias("speedup")))
seed_rows = pl.DataFrame([{"model": k, "cold ms": float(a), "cached ms": float(b), "speedup": a / b}
                          for k, (a, b) in SEED_000.items()])
Markdown(f"kvlab, {ttft_repeats} cached requests per family (median), beside seed 000's M3 Ultra figures:")

# %%
seed_table

# %%
seed_rows

# %% [markdown]
# ### The wrong image, on every family
#
# The pitfall of section 1 on each family's tiny VLM: two pictures of one size under the same
# question, the second run with ids-only keys and with image-aware keys on a radix store.

# %%
wrong_rows = []
for name in families:
    fam = kv.load_vlm(name) if name == "tiny" else kv.load(name)
    fam_tol = logit_tolerance(fam.dtype)
    for image_keys in (False, True):
        engine = kv.Engine(fam, kv.stores.make_store("radix"), image_keys=image_keys, verify=True)
        engine.run(ask(pictures[0]), 1)
        r = engine.run(ask(pictures[1]), 1)
        start = kv.tokenise(fam, ask(pictures[1])).images[0].token_start
        wrong_rows.append({"model": name, "arch": fam.arch, "keys": "image-aware" if image_keys else "ids-only",
                           "prompt_tokens": r.prompt_tokens, "reused_tokens": r.reused_tokens,
                           "image_starts_at": start, "verify_diff": float(r.verify_diff),
                           "matches_cold": bool(r.verify_diff <= fam_tol)})
wrong_image = pl.DataFrame(wrong_rows)
wrong_image

# %% [markdown]
# ## 5 · mlx-vlm's Automatic Prefix Caching as a peer
#
# mlx-vlm (installed with kvlab) ships its own prefix cache, APC: chained block hashes salted with
# the request's image hashes, checkpoints for windowed and recurrent caches, a byte budget. First
# an audit: a fixed sequence (a text request, the same again, an image, the same image again, a
# different image with identical ids) against APC on and off, with what APC's `/v1/cache/stats`
# says beside what it reused (usage `cached_tokens`) and what an exact cache could reuse. Then the
# same multimodal load through APC on, APC off and `kvlab serve --store {peer_store}`, each a fresh
# server on loopback, one request at a time.

# %%
from kvlab.bench.vlm_peers import bench_vlm_peers  # noqa: E402
from kvlab.serving.apc_audit import audit_apc  # noqa: E402
from kvlab.serving.peers_vlm import start_mlx_vlm  # noqa: E402

audit = None
if peer_models:
    with start_mlx_vlm(peer_models[0]) as apc_on, start_mlx_vlm(peer_models[0], apc=False) as apc_off:
        audit = audit_apc(apc_on, apc_off, peer_models[0])
audit

# %%
peer_table = (bench_vlm_peers(1, models=peer_models, traffic=peer_traffic, store=peer_store,
                              num_requests=peer_requests) if peer_models else None)
peer_table

# %%
peers = pl.DataFrame([{"model": m, "traffic": t, "server": arm, **v}
                      for m, by_traffic in (peer_table.values if peer_table else {}).items()
                      for t, by_arm in by_traffic.items() for arm, v in by_arm.items()])
peers

# %% [markdown]
# ## Reuse and correctness
#
# Per experiment, store and keying: how many prompt tokens were reused, whether reuse was what the
# keys allow, and whether the cached logits matched a cold run. Ids-only keys reuse the most and are
# wrong; image-aware keys give up the image's blocks and are right.

# %%
results = pl.DataFrame(rows).with_columns(
    (pl.col("reused_tokens") == pl.col("expected_reused")).alias("reuse_as_expected"))
summary = (results.group_by("experiment", "store", "keys", maintain_order=True)
           .agg(pl.len().alias("requests"), pl.col("prompt_tokens").sum(), pl.col("reused_tokens").sum(),
                pl.col("reuse_as_expected").all(), pl.col("matches_cold").all(),
                pl.col("verify_diff").max().alias("max_verify_diff"))
           .with_columns((pl.col("reused_tokens") / pl.col("prompt_tokens")).alias("token_hit_rate")))
summary

# %%
# the saved table: sections 1-3 as above, then sections 4 and 5, one experiment each
parts = {"text-only TTFT": ttft, "wrong image per family": wrong_image, "peers": peers}
results = pl.concat([results] + [f.with_columns(pl.lit(k).alias("experiment")) for k, f in parts.items() if f.height],
                    how="diagonal_relaxed")
results = kv.runner.save_results(results, results_path, "05_multimodal")

# %% [markdown]
# ## Findings

# %%
def span(lo, hi, unit, fmt="{:.2f}"):
    return fmt.format(lo) + unit if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}{unit}"


speed = seed_table.sort("speedup")
seed_lo, seed_hi = min(r["speedup"] for r in seed_rows.iter_rows(named=True)), max(seed_rows["speedup"])
lo, hi = speed["speedup"][0], speed["speedup"][-1]
shape = ("inside" if seed_lo <= lo and hi <= seed_hi else "above" if lo > seed_hi else "below" if hi < seed_lo
         else "overlapping")
per_family = ", ".join(f"{r['arch']} {r['speedup']:.2f}x ({r['cold ms']:.1f} -> {r['cached ms']:.1f} ms, "
                       f"{r['reused_tokens']:.0f} of {r['prompt_tokens']:.0f} tokens reused)"
                       for r in seed_table.iter_rows(named=True))
family_finding = (
    f"**Text-only requests on a VLM: caching cut TTFT {span(lo, hi, 'x')} across {seed_table.height} "
    f"{'family' if seed_table.height == 1 else 'families'}**, "
    f"{shape} seed 000's {seed_lo:.2f}-{seed_hi:.2f}x: {per_family}; "
    f"{ttft['matches_cold'].sum()} of {ttft.height} cached requests matched a cold prefill (largest difference "
    f"{ttft['verify_diff'].max():.1e}). The ratio follows the share of the prompt the system prompt is; the "
    "milliseconds are tiny models' on this CPU, not the seed's M3 Ultra.")
wi = {k: wrong_image.filter(pl.col("keys") == k) for k in ("ids-only", "image-aware")}
past = wi["image-aware"].filter(pl.col("reused_tokens") > pl.col("image_starts_at")).height
family_finding += (
    f" The wrong image on every family: ids-only keys reused "
    f"{span(wi['ids-only']['reused_tokens'].min(), wi['ids-only']['reused_tokens'].max(), ' tokens', '{}')} and matched cold on {wi['ids-only']['matches_cold'].sum()} "
    f"of {wi['ids-only'].height} (logits up to {wi['ids-only']['verify_diff'].max():.2f} away); image-aware "
    f"keys reused past the image on {past} and matched cold on {wi['image-aware']['matches_cold'].sum()} of "
    f"{wi['image-aware'].height}.")

if peer_table is None:
    peer_finding = "Section 5 did not run (`peer_models` is empty)."
else:
    parts = []
    for (m, t), g in peers.group_by("model", "traffic", maintain_order=True):
        g = g.sort("ttft_ms_p50")
        best, worst = g.row(0, named=True), g.row(-1, named=True)
        most = g.sort("reused_tokens", descending=True).row(0, named=True)
        parts.append(f"on {m} with {t} traffic {best['server']} had the lowest TTFT p50 ({best['ttft_ms_p50']:.1f} ms, "
                     f"{worst['ttft_ms_p50'] / best['ttft_ms_p50']:.2f}x faster than {worst['server']}) and "
                     f"{most['server']} reused the most ({most['reused_tokens']:.0f} of {most['prompt_tokens']:.0f} "
                     "prompt tokens)")
    wrong_apc = audit.disagreements().height if audit is not None else 0
    peer_finding = ("**Peers:** " + "; ".join(parts) + ". APC audit: "
                    + (f"{wrong_apc} of {audit.frame.height} steps disagree: " + "; ".join(
                        [x for x in audit.findings() if "did not reuse" in x or "differs" in x]
                        + [x for x in audit.findings() if "never replays" in x])
                       if audit is not None else "not run") + ".")

core = results.filter(pl.col("experiment").is_in(["different images", "text only", "text then image"]))
images = core.filter(pl.col("experiment") == "different images")
wrong, right = (images.filter(pl.col("keys") == k) for k in ("ids-only", "image-aware"))
aware = core.filter(pl.col("keys") == "image-aware")
core_finding = (f"With identical token ids and different images, ids-only keys reused {wrong['reused_tokens'].sum()} of "
           f"{wrong['prompt_tokens'].sum()} prompt tokens and matched a cold run on {wrong['matches_cold'].sum()} of "
           f"{wrong.height} requests (logits up to {wrong['verify_diff'].max():.2f} away); image-aware keys reused "
           f"{right['reused_tokens'].sum()} and every image-aware request matched cold on {aware['matches_cold'].sum()} "
           f"of {aware.height} (within {aware['verify_diff'].max():.1e}, tolerance {tolerance:g}). Reuse was exactly "
           f"what the keys allow on {core['reuse_as_expected'].sum()} of {core.height} requests.")
finding = "\n\n".join((core_finding, family_finding, peer_finding))
Markdown(finding)
