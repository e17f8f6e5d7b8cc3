"""The device MLX runs kvlab's arrays on, and every decision that depends on it.

One place for platform facts: the backend (``cpu``, ``metal``, ``cuda``), the device's name, the
memory it can use, the size its allocator really takes for a byte count, Metal's buffer limit, the
BLAS that runs matmuls and the attention kernel (``kvlab.models.cpu_attention`` on Linux CPU,
MLX's own elsewhere or with ``KVLAB_CPU_ATTENTION=mlx``). Store budgets, memory counters, the BLAS label and warning and the
benchmark headers all read them from here, so a Mac or a CUDA machine is not told Linux-CPU things.

``current()`` reads mlx once (``read_probe``) and decides (``Device.from_probe``); tests decide for
a backend that cannot run here by passing that backend's probe values to the same code.

Example:
    >>> current()                                     # doctest: +SKIP
    Device(cpu, Intel(R) Xeon(R) Processor, 7.8 GiB usable, BLAS OpenBLAS, attention kvlab-cpu)
    >>> Device.for_backend("metal").allocation_bytes(20_000)
    32768
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

from . import _blas

_blas.load_fast_blas()  # before mlx.core

import mlx.core as mx  # noqa: E402
import psutil  # noqa: E402

from .errors import BufferLimitError, DeviceError  # noqa: E402
from .primitives.display import summary_html  # noqa: E402
from .primitives.units import fmt_bytes  # noqa: E402

BACKENDS = ("cpu", "metal", "cuda")
# Allocator rounding, from the mlx sources (ml-explore/mlx):
# - mlx/backend/metal/allocator.cpp, MetalAllocator::malloc: 0 bytes get no buffer; a size above
#   vm_page_size (16 KiB on Apple silicon) is aligned up to whole pages; smaller sizes are kept.
# - mlx/backend/cuda/allocator.cpp, CudaAllocator::malloc: up to 8 bytes take an 8-byte block of
#   the small pool; below page_size (16 KiB) the next power of two; from it, whole 16 KiB pages.
# - mlx/backend/no_gpu/allocator.cpp (CPU): malloc of the size asked (plus a size header).
METAL_PAGE = 16384
CUDA_PAGE = 16384
CUDA_SMALL_BLOCK = 8
# mlx/backend/metal/device_info.cpp: sysctl iogpu.rsrc_limit, 499000 when the OS does not say
METAL_RESOURCE_LIMIT = 499_000
# the attention kernels kvlab can choose (kvlab.models.cpu_attention.NAME, and MLX's own) and the
# switch that keeps MLX's on Linux CPU too
KVLAB_ATTENTION, MLX_ATTENTION = "kvlab-cpu", "mlx"
ATTENTION_SWITCH = "KVLAB_CPU_ATTENTION"
ATTENTION_SWITCH_VALUES = ("", "auto", "kvlab", MLX_ATTENTION)


@dataclass(frozen=True)
class Device:
    """Where kvlab's arrays live. ``memory``: bytes the device can use (None when mlx does not
    say), ``memory_source`` says where the figure came from; ``ram``: the host's physical memory;
    ``buffer_limit``: live buffers the backend allows (Metal), else None; ``blas``: what runs
    float32 matmuls; ``system``: ``platform.system()``; ``fast_blas``: OpenBLAS is loaded (Linux);
    ``attention``: the attention kernel kvlab's models use (KVLAB_ATTENTION or MLX_ATTENTION)."""

    backend: str
    name: str
    memory: int | None
    memory_source: str
    ram: int
    buffer_limit: int | None
    blas: str
    system: str
    fast_blas: bool = True
    attention: str = MLX_ATTENTION

    @classmethod
    def from_probe(cls, *, metal: bool, cuda: bool, gpu_default: bool, info: dict, system: str,
                   ram: int, processor: str = "", fast_blas: bool = True, cpu_attention: str = "") -> "Device":
        """The device these probe values describe (``read_probe()`` gives this process's).

        Example:
            >>> Device.from_probe(metal=True, cuda=False, gpu_default=True, system="Darwin",
            ...                   ram=16 << 30, info={"device_name": "Apple M2"}).blas
            'Accelerate'
        """
        backend = "cpu"
        if gpu_default and metal:
            backend = "metal"
        elif gpu_default and cuda:
            backend = "cuda"
        name = str(info.get("device_name") or processor or platform.machine() or "unknown")
        memory, source = ram, "physical RAM"
        if backend == "metal":
            if info.get("max_recommended_working_set_size"):
                memory, source = int(info["max_recommended_working_set_size"]), "Metal recommended working set"
            elif info.get("memory_size"):
                memory, source = int(info["memory_size"]), "Mac memory size"
        elif backend == "cuda":
            memory, source = (int(info["total_memory"]), "CUDA device memory") if info.get("total_memory") \
                else (None, "not reported by this mlx; budgets use host RAM")
        limit = int(info.get("resource_limit") or METAL_RESOURCE_LIMIT) if backend == "metal" else None
        if backend == "cuda":
            blas = "cuBLAS"
        elif system == "Darwin":
            blas = "Accelerate"
        else:
            blas = "OpenBLAS" if fast_blas else "reference BLAS"
        return cls(backend, name, memory, source, int(ram), limit, blas, system, bool(fast_blas),
                   choose_attention(backend, system, cpu_attention))

    @classmethod
    def for_backend(cls, backend: str, **probe) -> "Device":
        """The device of ``backend`` with this process's other probe values (``probe`` overrides
        them): how tests and notebooks ask what kvlab would decide on a Mac or a CUDA machine.

        Example:
            >>> Device.for_backend("cuda", info={"total_memory": 24 << 30}).memory
            25769803776
        """
        if backend not in BACKENDS:
            raise DeviceError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        values = {**read_probe(), "metal": backend == "metal", "cuda": backend == "cuda",
                  "gpu_default": backend != "cpu"}
        if backend == "metal":
            values.update(system="Darwin", info={})
        elif backend == "cuda":
            values.update(system="Linux", info={})
        values.update(probe)
        return cls.from_probe(**values)

    # -- decisions ---------------------------------------------------------------------------------
    def allocation_bytes(self, nbytes: int) -> int:
        """The bytes this backend's allocator takes for a buffer of ``nbytes`` (rules above).

        Example:
            >>> Device.for_backend("cuda").allocation_bytes(3000)
            4096
        """
        n = int(nbytes)
        if self.backend == "metal":
            return -(-n // METAL_PAGE) * METAL_PAGE if n > METAL_PAGE else n
        if self.backend == "cuda":
            if n <= CUDA_SMALL_BLOCK:
                return CUDA_SMALL_BLOCK
            if n < CUDA_PAGE:
                return 1 << (n - 1).bit_length()
            return -(-n // CUDA_PAGE) * CUDA_PAGE
        return n

    def held_bytes(self, arrays) -> int:
        """What the device holds for ``arrays``, each its own buffer (a store's own copies)."""
        return sum(self.allocation_bytes(a.nbytes) for a in arrays)

    def default_budget(self, fraction: float = 0.25) -> int:
        """``fraction`` of the memory the device can use (host RAM when it does not say)."""
        return int((self.memory if self.memory is not None else self.ram) * fraction)

    @property
    def clears_cache_for_copies(self) -> bool:
        """Empty MLX's buffer cache before a store copies KV into its own buffers? On CPU yes:
        the cache would hand a small copy a freed buffer up to twice its size, so the counter
        would not be what is held, and re-allocating is a malloc. On Metal and CUDA no: emptying
        it makes the next forward pass allocate every intermediate from the driver again; a
        reused buffer is at most min(2x, +2 pages) of the rounded size there (the allocators'
        ``reuse_from_cache``)."""
        return self.backend == "cpu"

    @property
    def slow_blas(self) -> bool:
        """Linux CPU on the mlx[cpu] wheel's reference BLAS: the only place matmuls run ~40x slow."""
        return self.backend == "cpu" and self.system == "Linux" and not self.fast_blas

    @property
    def half_precision_slow(self) -> bool:
        """Half-precision matmuls much slower than float32: CPU off macOS, where bf16/fp16 skip BLAS
        (~5 GFLOP/s against 200+ for float32 with OpenBLAS). Not on macOS (Accelerate), not on a GPU."""
        return self.backend == "cpu" and self.system != "Darwin"

    def check_buffers(self, needed: int, what: str, fix: str) -> None:
        """Refuse a store that would keep more live buffers than the backend allows."""
        if self.buffer_limit is not None and needed > self.buffer_limit:
            raise BufferLimitError(f"{what} would keep up to {needed:,} buffers, but {self.name} ({self.backend}) "
                              f"allows {self.buffer_limit:,} live buffers (mx.device_info()['resource_limit']); "
                              f"{fix}")

    @property
    def label(self) -> str:
        """One line for headers: backend, device name, BLAS, attention kernel."""
        return f"{self.backend} ({self.name}), BLAS {self.blas}, attention {self.attention}"

    def __repr__(self) -> str:
        mem = "unknown" if self.memory is None else fmt_bytes(self.memory)
        limit = "" if self.buffer_limit is None else f", {self.buffer_limit:,} buffers"
        return (f"Device({self.backend}, {self.name}, {mem} usable{limit}, BLAS {self.blas}, "
                f"attention {self.attention})")

    def _repr_html_(self) -> str:
        mem = "unknown" if self.memory is None else fmt_bytes(self.memory)
        return summary_html("Device", self.backend, self.name, f"{mem} usable ({self.memory_source})",
                            None if self.buffer_limit is None else f"{self.buffer_limit:,} buffers max",
                            f"BLAS {self.blas}", f"attention {self.attention}")


def choose_attention(backend: str, system: str, switch: str = "") -> str:
    """The attention kernel for this platform: kvlab's CPU kernel on Linux CPU, where MLX's ``exp``
    is scalar and softmax dominates a long prefill; MLX's fused kernels on Metal and CUDA (and on
    macOS CPU, not measured); ``switch`` (the KVLAB_CPU_ATTENTION value) ``mlx`` keeps MLX's.

    Example:
        >>> choose_attention("cpu", "Linux"), choose_attention("metal", "Darwin"), choose_attention("cpu", "Linux", "mlx")
        ('kvlab-cpu', 'mlx', 'mlx')
    """
    switch = (switch or "").strip().lower()
    if switch not in ATTENTION_SWITCH_VALUES:
        raise DeviceError(f"{ATTENTION_SWITCH}={switch!r} is not understood: unset it (kvlab chooses), or set "
                          f"it to {MLX_ATTENTION!r} to keep MLX's own attention kernel")
    if switch == MLX_ATTENTION or backend != "cpu" or system != "Linux":
        return MLX_ATTENTION
    return KVLAB_ATTENTION


def read_probe() -> dict:
    """What mlx and the OS say about this process's device (``Device.from_probe``'s arguments)."""
    cuda = getattr(mx, "cuda", None)  # mlx builds before the CUDA backend have no mx.cuda
    metal = bool(mx.metal.is_available())
    if hasattr(mx, "device_info"):
        info = dict(mx.device_info())
    else:  # older mlx: only Metal reports
        info = dict(mx.metal.device_info()) if metal else {}
    return {"metal": metal, "cuda": bool(cuda is not None and cuda.is_available()),
            "gpu_default": mx.default_device().type == mx.gpu, "info": info,
            "system": platform.system(), "ram": int(psutil.virtual_memory().total),
            "processor": platform.processor(), "fast_blas": _blas.fast_blas_active(),
            "cpu_attention": os.environ.get(ATTENTION_SWITCH, "")}


@functools.cache
def current() -> Device:
    """This process's device, read once."""
    return Device.from_probe(**read_probe())


def held_bytes(arrays, device: Device | None = None) -> int:
    """Bytes the device holds for ``arrays`` (each its own buffer): ``array.nbytes`` rounded up
    to what the allocator takes; equal to the plain sum on CPU.

    Example:
        >>> held_bytes([mx.zeros((4,))])
        16
    """
    return (device or current()).held_bytes(arrays)


def before_copies(device: Device | None = None) -> None:
    """Call before a store copies KV into buffers of its own (``Device.clears_cache_for_copies``)."""
    if (device or current()).clears_cache_for_copies:
        mx.clear_cache()


def blas_warning(device: Device | None = None) -> str | None:
    """The slow-BLAS warning this device deserves: only Linux CPU on the reference BLAS gets one."""
    return _blas.slow_message() if (device or current()).slow_blas else None


def warn_if_slow_blas(device: Device | None = None) -> None:
    """Say once, with the fix, when matmuls run on the reference BLAS (Linux CPU only)."""
    message = blas_warning(device)
    if message:
        _blas.warn_once(message)
