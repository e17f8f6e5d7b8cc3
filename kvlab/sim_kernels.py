"""The simulator's compiled kernels now live in kvlab.sim (kernels_lists, kernels_heap,
kernels_stack, kernels_reasons; dispatch picks one per policy). This module keeps the old
import path working."""

from .sim.dispatch import replay_kernel, run_kernel
from .sim.kernels_stack import lru_stack_kernel

__all__ = ["replay_kernel", "run_kernel", "lru_stack_kernel"]
