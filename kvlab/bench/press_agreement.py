"""kvlab's presses against kvpress (issue 32 §4): on a few SmolLM2 prompts, per press and ratio,
how many (layer, KV head) pairs keep exactly the positions kvpress 0.5.5 keeps on the same
weights, their Jaccard overlap, and how many of the differences are near-ties (a swap whose gap
at kvpress's cut is under ``kvpress_peer.NEAR_TIE`` of the head's typical score: float noise
between MLX and PyTorch can flip it). The whole prompt is compressed on both sides
(``kv.compress(model, ids, kv.press(name, ratio))`` and ``with press(model): model(ids)``), so
query-aware presses look at the prompt's last tokens on both.

kvpress answers every prompt, press and ratio in one subprocess (``.venv-kvpress``); kvlab's side
needs ``kv.press`` and ``kv.compress`` (issue 32 §1-2) and raises a KvlabError saying so where this
kvlab has not got them.

Example:
    >>> t = bench_press_agreement(kv.load(), presses=("knorm",), ratios=(0.5,), prompt_tokens=(256,))
    >>> t.values["knorm"][0.5]["exact_heads"], t.values["knorm"][0.5]["heads"]
    (90, 90)
"""

from __future__ import annotations

import numpy as np
import polars as pl

from ..errors import KvlabError
from ..presses import kvpress_peer
from .settings import Settings
from .table import Table

NEEDS_MODEL = True
PEERS = True  # kvpress loads the model folder (in float32): a cast kvlab model is not what it runs
PRESSES = ("streaming_llm", "knorm", "snapkv", "expected_attention", "tova", "observed_attention",
           "keydiff", "lagkv")
RATIOS = (0.25, 0.5, 0.75)
PROMPT_TOKENS = (256, 768)


def require_presses():
    """kvlab's ``kv.press`` and ``kv.compress``, or a KvlabError saying this kvlab has not got them."""
    import kvlab as kv

    try:
        return kv.press, kv.compress
    except AttributeError as e:
        raise KvlabError("the press_agreement section compares kvlab's presses with kvpress, and this kvlab "
                         "has no kv.press / kv.compress yet (issue 32 §1-2): merge them first") from e


def prompts(model, tokens=PROMPT_TOKENS, seed: int = 0) -> list[tuple[int, ...]]:
    """Chat prompts of roughly ``tokens`` ids each (a system line, seeded prose, a question; the
    prose is sized for the Qwen3 tokenizer, so lengths differ per model), rendered with the
    model's template: heterogeneous text, as a RULER haystack is."""
    from ..primitives.tokens import tokenise_text
    from ..workloads.text import prose, question

    rng = np.random.default_rng(seed)
    out = []
    for n in tokens:
        msgs = [{"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": prose(rng, n) + " " + question(rng, 16)}]
        out.append(tuple(tokenise_text(model.tokenizer, msgs).ids))
    return out


def compare(model, prompt_ids, presses=PRESSES, ratios=RATIOS) -> pl.DataFrame:
    """One row per (prompt, press, ratio, layer, KV head): ``kvpress_peer.agreement`` of
    kv.compress's kept positions with kvpress's, plus the explanation's verdict where they differ
    (``near_tie``, ``differs``, ``n_kept differs``; null where equal).

    Example:
        >>> f = compare(m, [ids], ("knorm",), (0.5,))
        >>> f.group_by("press").agg(pl.col("exact").mean())
    """
    press, compress = require_presses()
    cases = [kvpress_peer.Case(ids, name, r) for ids in prompt_ids for name in presses for r in ratios]
    frames = []
    for i, peer in enumerate(kvpress_peer.run(cases, model)):
        ours = compress(model, list(peer.case.ids), press(peer.press, peer.ratio)).kept
        frame = kvpress_peer.agreement(ours, peer)
        why = kvpress_peer.explain(ours, peer).select("layer", "head", "verdict")
        frames.append(frame.join(why, on=["layer", "head"], how="left").with_columns(
            prompt=pl.lit(i // (len(presses) * len(ratios))), tokens=pl.lit(peer.tokens),
            press=pl.lit(peer.press), ratio=pl.lit(peer.ratio)))
    return pl.concat(frames).select("prompt", "tokens", "press", "ratio", pl.exclude("prompt", "tokens", "press",
                                                                                     "ratio"))


def bench_press_agreement(model, *, presses=PRESSES, ratios=RATIOS, prompt_tokens=PROMPT_TOKENS) -> Table:
    """Rows: press x ratio over all prompts' layers and heads (see the module docstring)."""
    prompt_ids = prompts(model, prompt_tokens)
    frame = compare(model, prompt_ids, presses, ratios)
    values: dict = {}
    rows = []
    for name in presses:
        for r in ratios:
            f = frame.filter((pl.col("press") == name) & (pl.col("ratio") == r))
            v = {"heads": f.height, "exact_heads": int(f["exact"].sum()),
                 "jaccard_min": float(f["jaccard"].min()), "jaccard_mean": float(f["jaccard"].mean()),
                 "near_tie_heads": int((f["verdict"] == "near_tie").sum()),
                 "differing_heads": int(f["verdict"].is_in(["differs", "n_kept differs"]).sum())}
            values.setdefault(name, {})[r] = v
            rows.append((name, r, f"{v['exact_heads']} of {v['heads']}", v["jaccard_min"], v["jaccard_mean"],
                         v["near_tie_heads"], v["differing_heads"]))
    tokens = ", ".join(str(len(p)) for p in prompt_ids)
    return Table(f"kvlab presses vs kvpress {kvpress_peer.KVPRESS.split('==')[1]}: kept positions per layer "
                 f"and KV head ({len(prompt_ids)} prompts of {tokens} tokens)",
                 "kvlab bench --only press_agreement",
                 ("press", "ratio", "heads exact", "Jaccard min", "Jaccard mean", "near-tie heads",
                  "differing heads"),
                 tuple(rows),
                 "Both sides compress the whole prompt on the same weights (kvlab's model folder; kvpress in "
                 "float32 through transformers, CPU torch). A head is exact when both keep the same set of "
                 "positions; a near-tie is a difference whose swapped positions sit within "
                 f"{kvpress_peer.NEAR_TIE:g} of the head's median |score| of kvpress's cut; the rest differ "
                 "(kvlab.presses.kvpress_peer.explain lists them). knorm ties on repeated tokens (a token's "
                 "layer-0 key norm does not depend on its position: RoPE is a rotation); lagkv's scores are "
                 "ranks within each 128-token partition, equal across partitions, so its cut falls inside "
                 "ties that torch.topk and kvlab break in different orders.",
                 values=values)


def table(s: Settings) -> Table:
    return bench_press_agreement(s.model)
