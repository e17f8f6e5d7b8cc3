"""kvlab.device: the platform decisions, per backend. Metal and CUDA cannot run here, so their
probe values (what ``mx.device_info()`` and friends return there; field names and the 499,000
default from the mlx sources) go through the same ``Device.from_probe`` that ``current()`` uses,
and stores are given that device. Each test names the broken implementation (mutant) it catches.
"""

import kvlab  # noqa: F401  (OpenBLAS before mlx)

import warnings

import mlx.core as mx
import pytest

from kvlab import device
from kvlab.device import Device
from kvlab.errors import BufferLimitError, DeviceError
from kvlab.stores import PagedStore, SharedRadixStore
from kvlab.stores.base import default_budget
from kvlab.primitives.tokens import from_ids

from tier_helpers import key_of, seq, snap_of

GiB = 1 << 30
TOKS = from_ids([0])
METAL_INFO = {"device_name": "Apple M2 Pro", "architecture": "applegpu_g14s",
              "max_recommended_working_set_size": 11 * GiB, "memory_size": 16 * GiB,
              "resource_limit": 499_000}
CUDA_INFO = {"device_name": "NVIDIA RTX 4090", "architecture": "sm_89", "total_memory": 24 * GiB,
             "free_memory": 23 * GiB}


def probe(**over):
    values = dict(metal=False, cuda=False, gpu_default=False, info={}, system="Linux", ram=32 * GiB,
                  processor="x86_64", fast_blas=True)
    values.update(over)
    return Device.from_probe(**values)


METAL = probe(metal=True, gpu_default=True, info=METAL_INFO, system="Darwin")
CUDA = probe(cuda=True, gpu_default=True, info=CUDA_INFO, fast_blas=False)
CPU = probe(info={"device_name": "Intel(R) Xeon(R) Processor"})


# Mutants: CPU rounding like a GPU; Metal rounding sizes at or below a page (1000 -> 16384) or
# rounding to powers of two; CUDA using pages below 16 KiB (3000 -> 16384), no 8-byte minimum, or
# "< page" written "<= page" on the power-of-two branch.
@pytest.mark.parametrize("dev, sizes", [
    (CPU, {0: 0, 1: 1, 3000: 3000, 16385: 16385, 20000: 20000}),
    (METAL, {0: 0, 1: 1, 1000: 1000, 16384: 16384, 16385: 32768, 20000: 32768, 49153: 65536}),
    (CUDA, {1: 8, 8: 8, 9: 16, 3000: 4096, 8192: 8192, 16383: 16384, 16384: 16384, 20000: 32768}),
], ids=["cpu", "metal", "cuda"])
def test_allocation_bytes(dev, sizes):
    assert {n: dev.allocation_bytes(n) for n in sizes} == sizes


# Mutants: backend from availability alone (a Mac whose default device is the CPU called "metal");
# CUDA checked before the default device; the CPU name ignoring device_info.
def test_backend_and_name_from_the_probe():
    assert (METAL.backend, METAL.name, METAL.buffer_limit) == ("metal", "Apple M2 Pro", 499_000)
    assert (CUDA.backend, CUDA.name, CUDA.buffer_limit) == ("cuda", "NVIDIA RTX 4090", None)
    assert (CPU.backend, CPU.name, CPU.buffer_limit) == ("cpu", "Intel(R) Xeon(R) Processor", None)
    mac_cpu = probe(metal=True, gpu_default=False, info=METAL_INFO, system="Darwin")
    assert (mac_cpu.backend, mac_cpu.memory, mac_cpu.blas) == ("cpu", 32 * GiB, "Accelerate")
    # an older macOS that does not report iogpu.rsrc_limit: mlx's own default
    assert probe(metal=True, gpu_default=True, system="Darwin", info={}).buffer_limit == 499_000
    with pytest.raises(DeviceError, match="one of cpu, metal, cuda, got 'rocm'"):
        Device.for_backend("rocm")


# Mutants: the budget from host RAM on every backend (today's 25% of RAM); Metal's memory_size
# preferred over the recommended working set; CUDA without total_memory giving a None budget.
def test_usable_memory_and_default_budget():
    assert (METAL.memory, METAL.memory_source) == (11 * GiB, "Metal recommended working set")
    assert probe(metal=True, gpu_default=True, system="Darwin",
                 info={"memory_size": 16 * GiB}).memory == 16 * GiB
    assert (CUDA.memory, CPU.memory) == (24 * GiB, 32 * GiB)
    old_cuda = probe(cuda=True, gpu_default=True, info={})
    assert old_cuda.memory is None and old_cuda.default_budget() == 8 * GiB  # host RAM / 4
    assert [default_budget(device=d) for d in (METAL, CUDA, CPU)] == [11 * GiB // 4, 6 * GiB, 8 * GiB]
    assert PagedStore(device=METAL).budget_bytes == 11 * GiB // 4
    assert SharedRadixStore(device=CUDA).budget_bytes == 6 * GiB


# Mutants: "OpenBLAS" printed on a Mac (the demo's old label); fast_blas consulted on CUDA.
def test_blas_label():
    assert [d.blas for d in (METAL, CUDA, CPU)] == ["Accelerate", "cuBLAS", "OpenBLAS"]
    assert probe(fast_blas=False).blas == "reference BLAS"
    assert probe(system="Darwin").blas == "Accelerate"
    assert METAL.label == "metal (Apple M2 Pro), BLAS Accelerate, attention mlx"


# Mutants: kvlab's CPU kernel chosen on Metal or CUDA (MLX's fused kernels win there), on macOS's
# CPU backend (not measured), or on Linux CPU despite KVLAB_CPU_ATTENTION=mlx; a typo in the
# switch silently ignored.
def test_attention_kernel_per_backend_and_switch():
    assert [d.attention for d in (METAL, CUDA, CPU)] == ["mlx", "mlx", "kvlab-cpu"]
    assert probe(system="Darwin").attention == "mlx"
    assert probe(metal=True, gpu_default=False, info=METAL_INFO, system="Darwin").attention == "mlx"
    assert probe(cpu_attention="mlx").attention == "mlx"
    assert probe(cpu_attention="MLX ").attention == "mlx"
    assert probe(cpu_attention="auto").attention == probe(cpu_attention="kvlab").attention == "kvlab-cpu"
    assert probe(cuda=True, gpu_default=True, info=CUDA_INFO, cpu_attention="kvlab").attention == "mlx"
    assert Device.for_backend("metal").attention == Device.for_backend("cuda").attention == "mlx"
    with pytest.raises(DeviceError, match="KVLAB_CPU_ATTENTION='numpy' is not understood.*'mlx'"):
        probe(cpu_attention="numpy")
    assert "attention kvlab-cpu" in repr(CPU) and "attention mlx" in METAL._repr_html_()


# Mutants: the warning gated on fast_blas alone (a CUDA machine has no OpenBLAS preloaded and was
# told matmuls run ~40x slower), or never given at all.
def test_slow_blas_warning_only_on_linux_cpu():
    slow_cpu = probe(fast_blas=False)
    assert slow_cpu.slow_blas and "float32 matmuls run ~40x slower" in device.blas_warning(slow_cpu)
    for dev in (CUDA, METAL, probe(system="Darwin", fast_blas=False), CPU):
        assert not dev.slow_blas and device.blas_warning(dev) is None
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            device.warn_if_slow_blas(dev)
        assert seen == []


# Mutant: the buffer cache emptied before every copy on GPU backends too.
def test_cache_cleared_for_copies_on_cpu_only():
    assert [d.clears_cache_for_copies for d in (CPU, METAL, CUDA)] == [True, False, False]


# Mutants: counters adding array.nbytes on a GPU backend; rounding applied on CPU.
def test_held_bytes_per_backend():
    arrays = [mx.zeros((5000,), dtype=mx.float32), mx.zeros((3,), dtype=mx.float16)]  # 20000 B, 6 B
    assert [device.held_bytes(arrays, d) for d in (CPU, METAL, CUDA)] == [20006, 32774, 32776]


# Mutant: a paged block counted at array.nbytes: block_size 3 of 2 heads x 4 dims float32 is 96 B
# per K or V array, 128 B on CUDA; 2 layers x K, V x 2 blocks.
def test_paged_store_counts_allocation_sizes():
    for dev, per_array in ((CPU, 96), (CUDA, 128)):
        store = PagedStore(block_size=3, budget_bytes=1 << 20, device=dev)
        store.insert(key_of(seq(0, 6)), TOKS, snap_of(seq(0, 6)))
        assert store.nbytes == 2 * 2 * 2 * per_array


# snap_of: 2 layers x K, V = 4 buffers a block; block_size 16 of 2 heads x 4 dims float32 is 512 B
# an array, 2048 B a block. 128 MiB holds 65,536 blocks (262,144 buffers); 256 MiB 131,072 (524,288).
# Mutants: no buffer check on Metal; the check before the budget is turned into blocks; a message
# without the count or the limit; the check applied on CPU.
def test_paged_store_refused_past_metals_buffer_limit():
    store = PagedStore(block_size=16, budget_bytes=256 << 20, device=METAL)
    with pytest.raises(BufferLimitError) as e:
        store.insert(key_of(seq(0, 32)), TOKS, snap_of(seq(0, 32)))
    assert str(e.value) == (
        "paged: 131,072 blocks of 16 tokens x 4 buffers (K and V per layer) would keep up to 524,288 "
        "buffers, but Apple M2 Pro (metal) allows 499,000 live buffers (mx.device_info()['resource_limit']); "
        "raise block_size (now 16) or lower budget_bytes (now 268,435,456)")
    assert store.entries == 0 and store.nbytes == 0
    fits = PagedStore(block_size=16, budget_bytes=128 << 20, device=METAL)
    fits.insert(key_of(seq(0, 32)), TOKS, snap_of(seq(0, 32)))
    assert (fits.entries, fits.nbytes) == (2, 4096)
    bigger_blocks = PagedStore(block_size=32, budget_bytes=256 << 20, device=METAL)
    bigger_blocks.insert(key_of(seq(0, 32)), TOKS, snap_of(seq(0, 32)))
    assert bigger_blocks.entries == 1
    on_cpu = PagedStore(block_size=16, budget_bytes=256 << 20, device=CPU)
    on_cpu.insert(key_of(seq(0, 32)), TOKS, snap_of(seq(0, 32)))
    assert on_cpu.entries == 2


# Mutant: num_blocks not checked until KV arrives (a pool that can never fit is accepted).
def test_paged_pool_refused_at_construction():
    with pytest.raises(BufferLimitError, match=r"300,000 blocks .* up to 600,000 buffers, .* allows 499,000 "
                                               r".* or num_blocks \(now 300,000\)"):
        PagedStore(block_size=16, num_blocks=300_000, device=METAL)
    assert PagedStore(block_size=16, num_blocks=200_000, device=METAL).num_blocks == 200_000


# A Metal with a resource limit of 12 buffers: 3 nodes of 2 layers x K, V. Mutants: the shared
# radix store ignoring the buffer limit (a 4th disjoint prompt is kept: 4 nodes, 0 evictions);
# buffers not given back on eviction (the 5th prompt would evict everything or fail).
def test_shared_radix_evicts_for_buffers_and_refuses_a_path_past_the_limit():
    tight = probe(metal=True, gpu_default=True, system="Darwin", info={**METAL_INFO, "resource_limit": 12})
    store = SharedRadixStore(budget_bytes=1 << 30, device=tight)
    for i in range(5):
        store.insert(key_of(seq(1000 * i, 8)), TOKS, snap_of(seq(1000 * i, 8)))
    assert (store.entries, store.evictions) == (3, 2)
    tiny = probe(metal=True, gpu_default=True, system="Darwin", info={**METAL_INFO, "resource_limit": 6})
    with pytest.raises(BufferLimitError, match="shared-radix: this request's path would keep up to 8 buffers"):
        SharedRadixStore(budget_bytes=1 << 30, device=tiny).insert(key_of(seq(0, 8)), TOKS, snap_of(seq(0, 8)))
