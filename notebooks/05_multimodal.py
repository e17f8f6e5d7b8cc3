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
# 3. text first, then the same text with an image: reuse stops exactly where the image begins.
#
# Defaults are small (the tiny random-weight qwen2_vl, 56×84 px images = 6 image tokens) so CI
# runs this in seconds; pass `model=` a local mlx-vlm qwen2_vl folder for a real model.

# %%
import kvlab as kv  # first: it loads a fast BLAS before MLX
import numpy as np
import polars as pl
from PIL import Image
from kvlab.primitives.tolerance import tolerance as logit_tolerance
from IPython.display import Markdown

# %% tags=["parameters"]
model = "tiny"            # "tiny" (random-weight qwen2_vl, built offline) or a local mlx-vlm qwen2_vl folder
image_hw = [56, 84]       # synthetic picture size in pixels (tiny: 56x84 -> 6 image tokens)
pairs = 3                 # request pairs with identical ids and different pictures
stores = ["radix", "paged"]
block_size = 16           # PagedStore block size (vLLM's default)
max_tokens = 4            # tokens generated per request
tolerance = None          # max |logit difference| that still counts as "same as cold"; None: kvlab's
                          # table for the model's dtype (kvlab.primitives.tolerance: 1e-4 in float32)
seed = 0
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
results = kv.runner.save_results(results, results_path, "05_multimodal")

# %% [markdown]
# ## Findings

# %%
images = results.filter(pl.col("experiment") == "different images")
wrong, right = (images.filter(pl.col("keys") == k) for k in ("ids-only", "image-aware"))
aware = results.filter(pl.col("keys") == "image-aware")
finding = (f"With identical token ids and different images, ids-only keys reused {wrong['reused_tokens'].sum()} of "
           f"{wrong['prompt_tokens'].sum()} prompt tokens and matched a cold run on {wrong['matches_cold'].sum()} of "
           f"{wrong.height} requests (logits up to {wrong['verify_diff'].max():.2f} away); image-aware keys reused "
           f"{right['reused_tokens'].sum()} and every image-aware request matched cold on {aware['matches_cold'].sum()} "
           f"of {aware.height} (within {aware['verify_diff'].max():.1e}, tolerance {tolerance:g}). Reuse was exactly "
           f"what the keys allow on {results['reuse_as_expected'].sum()} of {results.height} requests.")
Markdown(finding)
