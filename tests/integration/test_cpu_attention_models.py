"""kvlab's CPU attention kernel against MLX's in real models of every cache family.

TOL = 1e-5 on float32 logits (tiny models ~2 in magnitude, SmolLM2 ~20): the kernel and MLX
compute attention in float32 with additions in another order and another ~1 ulp exp; measured
<= 2e-6 on every model here, through 4-30 layers. A wrong mask, head map or offset moves logits
by 1e-2 to 1 (the mutants in tests/unit/test_cpu_attention.py).

Each model runs a prompt of odd length in two pieces (the second attends to a cached prefix:
L < S) and then one-token decode steps, once with each kernel; a spy records every attention
call, and the kernel must have computed all of them itself (``covers``), so no test passes
because the kernel handed the call back to MLX.
"""

import mlx.core as mx
import numpy as np
import pytest

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
@pytest.mark.parametrize("name", ["tiny", "tiny:gemma3_text", "tiny:gpt_oss", "tiny:qwen3_5", "tiny:llama4",
                                  "smollm2"])
def test_every_family_gives_mlx_logits_with_kvlab_attention(name, smol):
    m = smol if name == "smollm2" else kv.load(name)
    want, _ = _run(m, "mlx")
    got, calls = _run(m, "kvlab-cpu")
    assert got.shape == want.shape == (len(PROMPT) + 3 - 1 + 1, m.vocab_size)
    assert float(mx.abs(got - want).max()) <= TOL
    assert calls and all(calls), f"{calls.count(False)} of {len(calls)} calls went to MLX"


def _image(seed):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8))


# The VLMs' language models call mlx-vlm's scaled_dot_product_attention, which kvlab installs its
# dispatcher over as it does mlx-lm's; gemma4's mask lets an image's tokens see each other (a
# boolean array with a bidirectional block). Mutant caught: the kernel reading that mask as
# causal (the image tokens' logits move by ~1e-1).
@pytest.mark.vlm
@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_5", "gemma4"])
def test_vlms_give_mlx_logits_with_kvlab_attention(arch):
    pytest.importorskip("mlx_vlm")
    vlm = kv.load(f"tiny-vlm:{arch}")
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "image": _image(3)},
                                         {"type": "text", "text": "What is it?"}]}]
    toks = kv.tokenise(vlm, msgs)
    runs = {}
    for kernel in ("mlx", "kvlab-cpu"):
        calls, spy = _covered_calls()
        with attention.using(kernel), attention.wrapping(spy):
            runs[kernel] = vlm.prefill(toks, all_logits=True)[0]
    assert float(mx.abs(runs["kvlab-cpu"] - runs["mlx"]).max()) <= TOL
    assert calls and all(calls)
    if arch == "gemma4":
        assert float(mx.abs(runs["mlx"] - _without_image_block(vlm, toks)).max()) > 1e-3  # the mask matters


def _without_image_block(vlm, toks):
    from kvlab.vlm import archs

    real = archs.ImageBlockMask.make_mask
    archs.ImageBlockMask.make_mask = lambda self, n, window_size=None, return_array=False: \
        self.cache.make_mask(n, window_size=window_size, return_array=return_array)
    try:
        return vlm.prefill(toks, all_logits=True)[0]
    finally:
        archs.ImageBlockMask.make_mask = real
