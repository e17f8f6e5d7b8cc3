"""kvlab.models.attention: the one place kvlab reaches into mlx-lm's and mlx-vlm's attention.

Installed, with no wrapper and MLX's kernel, the dispatcher calls the library's own function:
logits are bit-identical (tolerance 0) to the uninstalled model. (kvlab's CPU kernel against MLX's
on every family: tests/integration/test_cpu_attention_models.py.)
"""

import threading

import mlx.core as mx
import pytest
from mlx_lm.models import base

import kvlab as kv
from kvlab import device
from kvlab.errors import KvlabError
from kvlab.models import attention

pytestmark = pytest.mark.model

IDS = mx.array([list(range(1000, 1037))])


def _logits(m):
    return m.net(IDS, cache=m.make_cache())


@pytest.mark.parametrize("name", ["tiny", "tiny:gemma3_text", "tiny:qwen3_5", "tiny:llama4"])
def test_installed_dispatcher_changes_nothing_and_sees_every_attention_layer(name):
    # mutants caught: install() missing a family's module (the spy sees fewer layers than the
    # layout has attention layers); a dispatcher that drops the mask or the scale (logits move)
    m = kv.load(name)
    with attention.using("mlx"):
        got = _logits(m)
        assert attention.uninstall() > 0
        try:
            want = _logits(m)
        finally:
            attention.install()
    assert mx.array_equal(got, want)

    seen = []

    def spy(call, q, k, v, cache, scale, mask, sinks):
        seen.append((q.shape, k.shape))
        return call(q, k, v, cache, scale, mask, sinks)

    with attention.wrapping(spy), attention.using("mlx"):
        spied = _logits(m)
    assert mx.array_equal(spied, want)
    attending = sum(1 for kind in m.layout.kinds if kind != "recurrent" and kind != "none")
    assert len(seen) == attending
    assert all(q[2] == IDS.shape[1] for q, _ in seen)


def test_wrappers_stay_in_their_thread_and_kernels_reach_every_thread():
    # mutant caught: wrappers held in a module global (a press entered in a notebook would run
    # inside the server's generation thread)
    m = kv.load("tiny")
    calls = {"main": 0, "other": 0}

    def count(where):
        def wrapper(call, *args):
            calls[where] += 1
            return call(*args)
        return wrapper

    other_done = threading.Event()

    def other():
        _logits(m)
        other_done.set()

    with attention.wrapping(count("main")):
        t = threading.Thread(target=other)
        t.start()
        assert other_done.wait(60)
        t.join()
        _logits(m)
    assert calls == {"main": m.num_layers, "other": 0}

    used = []

    def kernel(q, k, v, *, scale, mask=None, sinks=None):
        used.append(threading.current_thread().name)
        return attention.mlx_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)

    attention.set_kernel(kernel, "spy")
    try:
        assert attention.kernel_name() == "spy"
        t = threading.Thread(target=_logits, args=(m,), name="gen")
        t.start()
        t.join(60)
    finally:
        attention.use(None)
    # mutant caught: use(None) leaving the last kernel in place instead of the device's choice
    assert attention.kernel_name() == device.current().attention
    assert used == ["gen"] * m.num_layers


def test_quantized_caches_keep_the_library_path_and_bad_arguments_are_refused(smol):
    # mutant caught: a custom kernel handed a QuantizedKVCache's packed keys (it would attend to
    # uint32 words); the library's own quantized attention must run instead
    m = smol  # head dim 64: the tiny model's 16 is below MLX's smallest quantization group
    used = []

    def kernel(q, k, v, *, scale, mask=None, sinks=None):
        used.append(k.dtype)
        return attention.mlx_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)

    cache = m.make_cache()
    m.net(IDS, cache=cache)
    quantized = [c.to_quantized(group_size=32, bits=8) for c in cache]
    attention.set_kernel(kernel, "spy")
    try:
        m.net(mx.array([[1050]]), cache=quantized)
    finally:
        attention.use(None)
    assert used == []
    with pytest.raises(KvlabError, match="callable"):
        attention.set_kernel(3, "x")
    with pytest.raises(KvlabError, match="unknown attention kernel 'numpy'; choose one of kvlab-cpu, mlx"):
        attention.use("numpy")
    with pytest.raises(KvlabError, match="callable"):
        with attention.wrapping("not a function"):
            pass
    assert base.scaled_dot_product_attention.kvlab_original.__module__ == "mlx_lm.models.base"
