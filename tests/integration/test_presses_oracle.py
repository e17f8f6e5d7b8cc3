"""The exact oracle for every press: a compressed cache computes what the uncompressed cache
computes with the evicted positions masked per KV head (kvlab.presses.oracle), for a question block
(N > 1 tokens: the "causal" mask path) and then a decode step (one token: no mask), on the tiny
dense, hybrid and sliding models and on SmolLM2 (9 query / 3 KV heads).

Two oracles, both attention wrappers on the uncompressed cache:
- gathered (the kept rows taken out of the full cache, in the compressed layout): bit-identical
  (tolerance 0) everywhere;
- masked (the full cache, evicted positions masked): float32 within 1e-5 on the tiny models
  (measured 0.0 with MLX's attention, 8.1e-6 with kvlab's CPU kernel). On SmolLM2 it differs by
  float32 rounding alone, because the attention sums run over more keys (the masked zeros) and are
  grouped differently (measured up to 3.7e-5 with MLX's attention and OpenBLAS, 6.6e-5 with
  kvlab's CPU kernel, at 80-100 tokens): judged there by kvlab's float32 cache-vs-cold bound,
  ``tolerance("float32")`` = 1e-4; the gathered oracle shows the rows, positions and masks are exact.

One prefill per model serves every press (kvlab.presses.compress.Prefilled), so the whole grid
costs a few prefills.
"""

import mlx.core as mx
import numpy as np
import pytest

import kvlab as kv
from kvlab.presses import continue_logits, oracle_logits
from kvlab.presses.compress import Prefilled
from kvlab.primitives.snapshots import prefill, restore
from kvlab.primitives.tolerance import tolerance

pytestmark = pytest.mark.model

TOL = 1e-5  # float32, the masked oracle on small models; both sides run one attention kernel


def scorer_logit(keys, values, queries):
    """A user's press: the window's attention (averaged over each GQA group) plus the value norm."""
    heads, group = keys.shape[0], queries.shape[0] // keys.shape[0]
    att = mx.softmax(queries @ mx.repeat(keys, group, axis=0).swapaxes(-1, -2), axis=-1)
    att = mx.mean(mx.mean(att, axis=1).reshape(heads, group, -1), axis=1)
    return att + mx.linalg.norm(values, axis=-1)


def presses(n_layers: int, window: int = 16) -> dict:
    """Every press kvlab has, with options that fit a prompt of about 150 tokens."""
    p = kv.press
    return {
        "random": p("random", 0.5), "streaming_llm": p("streaming_llm", 0.5), "knorm": p("knorm", 0.5),
        "snapkv": p("snapkv", 0.5, window_size=window), "expected_attention": p("expected_attention", 0.5),
        "tova": p("tova", 0.5), "observed_attention": p("observed_attention", 0.5), "keydiff": p("keydiff", 0.6),
        "lagkv": p("lagkv", 0.5, lag_size=window), "pyramid": p("pyramid", 0.5, window_size=window,
                                                                    press=p("snapkv", 0.5, window_size=window)),
        "chunkkv": p("chunkkv", 0.5, press="knorm", chunk_length=8),
        "adakv": p("adakv", 0.5, press=p("snapkv", 0.5, window_size=window)),
        "composed": p("composed", presses=[p("streaming_llm", 0.25), p("knorm", 0.5)]),
        "per_layer": p("per_layer", press="knorm", ratios=[0.2 + 0.5 * i / n_layers for i in range(n_layers)]),
        "decoding": p("decoding", 0.5, press="keydiff"),
        "function": kv.presses.from_function(scorer_logit, 0.5, window=window),
    }


def prompt(n: int, seed: int = 0) -> tuple[list[int], list[int], int]:
    rng = np.random.default_rng(seed)
    return rng.integers(1000, 20000, n).tolist(), rng.integers(1000, 20000, 6).tolist(), int(rng.integers(1000, 20000))


def check_every_press(m, chosen, n_tokens, masked_tol=TOL):
    ids, question, step_id = prompt(n_tokens)
    grid = presses(len(m.make_cache()))
    grid = {k: v for k, v in grid.items() if chosen is None or k in chosen}
    pre = Prefilled(m, ids, list(grid.values()))
    unmasked = prefill(m, question, restore(pre.snapshot), all_logits=True)[0]
    bad = {}
    for name, press in grid.items():
        c = pre.compress(press)
        assert c.layers_compressed, name
        assert c.kept_tokens < n_tokens, f"{name} kept everything"
        got = continue_logits(m, c, question, [step_id])
        exact = float(mx.abs(oracle_logits(m, c, question, [step_id], full=pre.snapshot, gather=True) - got).max())
        want = oracle_logits(m, c, question, [step_id], full=pre.snapshot)
        masked = float(mx.abs(want - got).max())
        # the oracle is not vacuous: masking the evicted positions changes the question's logits
        moved = float(mx.abs(want[: len(question)] - unmasked).max())
        if exact != 0.0 or masked > masked_tol or moved < 1e-3:
            bad[name] = (exact, masked, moved)
    assert not bad, f"(|compressed - gathered oracle|, |compressed - masked oracle|, |oracle - uncompressed|) for {bad}"


# mutants caught (each checked by breaking kvlab.primitives.kept_cache and seeing this fail):
# update_and_fetch writing the question at the offset instead of after the rows (the RoPE offset
# taken for the row count: the new rows land past what keys_and_values returns); the offset set to
# the kept row count (the question's queries and keys rotated as if it sat right after n_kept
# tokens)
@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "gemma3_text"])
def test_every_press_equals_the_masked_oracle_on_tiny_models(name, tiny, family):
    check_every_press(tiny if name == "qwen3" else family(name), None, 150)


def test_head_layout_presses_equal_the_masked_oracle_on_smollm2(smol):
    # SmolLM2's 9 query heads over 3 KV heads: GQA averaging (snapkv, expected_attention,
    # observed_attention), one set for all heads (tova), head-wise budgets (adakv)
    # mutant caught (checked): KeptKVCache.attention_mask spreading a KV head's mask over its query
    # heads in the wrong order (mx.tile instead of mx.repeat) hides another head's rows
    check_every_press(smol, {"snapkv", "tova", "expected_attention", "observed_attention", "adakv"}, 80,
                      masked_tol=tolerance(smol.dtype))


@pytest.mark.parametrize("inner", ["knorm", "snapkv"])
def test_decoding_press_recompresses_while_decoding_and_each_step_equals_the_oracle(tiny, inner):
    # every 4 decoded tokens the layer goes back to 50 rows; each step's logits equal the
    # uncompressed cache masked with the rows the compressed one held at that step. Mutant caught:
    # a re-compression that leaves the boundary where it was (the rows and their positions no
    # longer line up)
    from kvlab.models import attention
    from kvlab.presses import masked_attention

    ids, steps = prompt(120)[0], prompt(13, seed=5)[0]
    options = {"window_size": 8} if inner == "snapkv" else {}
    c = kv.compress(tiny, ids, kv.press("decoding", 0.5, press=kv.press(inner, 0.5, **options), every=4, target=50))
    live, (_, full) = c.cache, prefill(tiny, ids)
    worst = 0.0
    for t in steps:
        got = prefill(tiny, [t], live, all_logits=True)[0]
        kept = tuple(layer.positions() for layer in live)
        with attention.wrapping(masked_attention(kept, full, live[0].offset)):
            want = prefill(tiny, [t], full, all_logits=True)[0]
        worst = max(worst, float(mx.abs(want - got).max()))
    assert live[0].on_append.count == 3 and live[0].rows == 51 and worst <= TOL
