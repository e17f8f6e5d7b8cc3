"""kvlab's CPU attention kernel against MLX's in real models of every cache family.

TOL = 1e-5 relative to the logits' scale (max |logit|: 5-11 on the tiny models, 33 on SmolLM2).
Both kernels compute in float32 with the same exp (MLX's, to the bit) and their products' additions
in another order; measured differences 3e-6..9.5e-5 absolute, 0.5e-6..3e-6 relative. An absolute
1e-5 would ask for MLX's summation order, not for accuracy: MLX's own float32 logits are as far
from a float64 run of the same model (1.3e-5 tiny, 4.2e-5 gemma3_text, 8.4e-5 SmolLM2), and
``test_kvlab_attention_is_as_accurate_as_mlx`` holds kvlab's kernel to that. A wrong mask, head
map or offset moves logits by 1e-2 to 1 (the mutants in tests/unit/test_cpu_attention.py).

Each model runs a prompt of odd length in two pieces (the second attends to a cached prefix:
L < S) and then one-token decode steps, once with each kernel; a spy records every attention
call, and the kernel must have computed all of them itself (``covers``), so no test passes
because the kernel handed the call back to MLX.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import kvlab as kv
from kvlab.models import attention, cpu_attention
from kvlab.primitives.snapshots import prefill

pytestmark = pytest.mark.model

TOL = 1e-5
PROMPT = list(range(1000, 1101))  # 101 tokens: wraps the tiny families' 32-token windows and chunks


def _covered_calls():
    calls = []

    def spy(call, q, k, v, cache, scale, mask, sinks):
        calls.append(cpu_attention.covers(q, k, v, mask, sinks))
        return call(q, k, v, cache, scale, mask, sinks)

    return calls, spy


def _run(m, kernel, ids=PROMPT, cut=60, steps=3):
    calls, spy = _covered_calls()
    with attention.using(kernel), attention.wrapping(spy):
        first, cache = prefill(m, ids[:cut], all_logits=True)
        second, cache = prefill(m, ids[cut:], cache, all_logits=True)
        out = [first, second]
        for t in range(steps):
            logits, cache = prefill(m, [2000 + t], cache)
            out.append(logits[None])
    return mx.concatenate(out, axis=0), calls


# Mutants caught (on top of the unit tests'): the dispatcher giving the kernel the cache's whole
# preallocated buffer instead of its keys (a causal offset of 256 - L); a sliding window's or a
# chunk's boolean mask dropped; gpt_oss's sinks dropped (logits move by 1e-2..1).
# (dense: SmolLM2 here, qwen2_vl below)
@pytest.mark.parametrize("name", ["tiny:gemma3_text", "tiny:gpt_oss", "tiny:qwen3_5", "tiny:llama4", "smollm2"])
def test_every_family_gives_mlx_logits_with_kvlab_attention(name, request):
    m = request.getfixturevalue("smol") if name == "smollm2" else kv.load(name)
    want, _ = _run(m, "mlx")
    got, calls = _run(m, "kvlab-cpu")
    assert got.shape == want.shape == (len(PROMPT) + 3, m.vocab_size)
    assert float(mx.abs(got - want).max()) <= TOL * float(mx.abs(want).max())
    assert calls and all(calls), f"{calls.count(False)} of {len(calls)} calls went to MLX"


# Mutant caught: a kernel that is consistent with itself but less accurate than MLX's (the exp
# without its polynomial's last term: 4x MLX's error against float64).
def test_kvlab_attention_is_as_accurate_as_mlx():
    m = kv.load("tiny:gemma3_text")
    got, _ = _run(m, "kvlab-cpu")
    want, _ = _run(m, "mlx")
    wide = {k: v.astype(mx.float64) for k, v in tree_flatten(m.net.parameters())}
    m.net.load_weights(list(wide.items()))  # float64 runs on MLX's CPU backend (MLX's kernel)
    try:
        exact, _ = _run(m, "mlx")
    finally:
        m.net.load_weights([(k, v.astype(mx.float32)) for k, v in wide.items()])
    exact = exact.astype(mx.float32)
    assert float(mx.abs(got - exact).max()) <= 2 * float(mx.abs(want - exact).max())


def _image(seed):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8))


# The VLMs' language models call mlx-vlm's scaled_dot_product_attention, which kvlab installs its
# dispatcher over as it does mlx-lm's; gemma4's mask lets an image's tokens see each other (a
# boolean array with a bidirectional block: checked to reach the kernel). Mutant caught: the
# kernel reading an array mask as causal.
@pytest.mark.vlm
@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_5", "gemma4"])
def test_vlms_give_mlx_logits_with_kvlab_attention(arch):
    pytest.importorskip("mlx_vlm")
    vlm = kv.load(f"tiny-vlm:{arch}")
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "image": _image(3)},
                                         {"type": "text", "text": "What is it?"}]}]
    toks = kv.tokenise(vlm, msgs)
    runs, masks = {}, []

    def keep_mask(call, q, k, v, cache, scale, mask, sinks):
        masks.append(mask)
        return call(q, k, v, cache, scale, mask, sinks)

    for kernel in ("mlx", "kvlab-cpu"):
        calls, spy = _covered_calls()
        with attention.using(kernel), attention.wrapping(spy, keep_mask):
            runs[kernel] = vlm.prefill(toks, all_logits=True)[0]
    assert float(mx.abs(runs["kvlab-cpu"] - runs["mlx"]).max()) <= TOL * float(mx.abs(runs["mlx"]).max())
    assert calls and all(calls)
    if arch == "gemma4":  # some query sees a later key: the image block, not a causal mask
        arrays = [np.asarray(m) for m in masks if isinstance(m, mx.array)]
        assert any(np.triu(m.reshape(m.shape[-2:]), 1).any() for m in arrays)
