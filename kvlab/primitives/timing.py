"""Every clock read in kvlab goes through this module (``tests/unit/test_timing.py`` fails on any other).

MLX is lazy, and on GPU backends (Metal, CUDA) asynchronous too: a clock read around unevaluated
arrays measures nothing. So a measured duration is taken by ``timed()``, which synchronises before
it starts and, when done, evaluates the outputs, synchronises, and only then reads the clock::

    t = timed()
    logits, cache = prefill(model, ids)
    seconds = t.done(logits, [c.state for c in cache])

or as a block (``done`` is called on leaving it if the block did not)::

    with timed() as t:
        t.done(model(x))
    print(t.seconds)

Clock reads that are not a measurement of work in this process go through the plain clock:
``now()`` for latencies and offsets seen from outside MLX (HTTP round trips, server event logs),
``wall()`` / ``wall_ns()`` / ``stamp(fmt)`` for timestamps stored in records and names, and
``deadline(seconds)`` for timeouts.

This module never imports MLX itself: when ``mlx.core`` is not loaded no MLX work can be pending,
so light modules (the load generator, block hashing) stay free of it.
"""

from __future__ import annotations

import html
import sys
import time
from typing import Callable


def _mlx():
    return sys.modules.get("mlx.core")


class Timer:
    """One measured duration: started on creation (after a synchronise), ended by ``done``.

    ``clock`` is the clock read (``time.perf_counter``); tests pass their own.

    Example:
        >>> t = Timer(clock=iter([1.0, 3.5, 4.0]).__next__)
        >>> t
        Timer(running)
        >>> t.done(), t.done()
        (2.5, 3.0)
        >>> t
        Timer(3.000000 s)
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.seconds: float | None = None
        mx = _mlx()
        if mx is not None:
            mx.synchronize()  # work queued before the timer is not part of it
        self.start = clock()

    def done(self, *outputs) -> float:
        """Evaluate ``outputs`` (arrays or trees of them; other leaves are ignored), synchronise,
        then read the clock; returns the seconds since the start (may be called again: a lap)."""
        mx = _mlx()
        if mx is not None:
            if outputs:
                mx.eval(*outputs)
            mx.synchronize()
        self.seconds = self.clock() - self.start
        return self.seconds

    def __enter__(self) -> Timer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self.seconds is None:
            self.done()

    def __repr__(self) -> str:
        return "Timer(running)" if self.seconds is None else f"Timer({self.seconds:.6f} s)"

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"


def timed(clock: Callable[[], float] = time.perf_counter) -> Timer:
    """Start a measured duration; ``.done(*outputs)`` ends it (see the module docstring).

    Example:
        >>> import mlx.core as mx
        >>> with timed(clock=iter([10.0, 10.25]).__next__) as t:
        ...     x = mx.ones((4, 4)) @ mx.ones((4, 4))
        ...     t.done(x)
        0.25
        >>> x[0, 0].item(), t.seconds
        (4.0, 0.25)
    """
    return Timer(clock)


# -- the plain clock: reads that are not a measurement of MLX work ---------------------------------
def now() -> float:
    """Monotonic seconds (``perf_counter``) for latencies seen from outside MLX and event offsets.

    Example:
        >>> t0 = now()
        >>> now() - t0 >= 0.0
        True
    """
    return time.perf_counter()


def wall() -> float:
    """Wall-clock seconds since the epoch (``time.time()``), for timestamps kept in records.

    Example:
        >>> wall() > 1.7e9
        True
    """
    return time.time()


def cpu() -> float:
    """This process's CPU seconds (``time.process_time()``): beside a wall-clock duration on a
    shared machine, the time the work itself held a core.

    Example:
        >>> cpu() >= 0.0
        True
    """
    return time.process_time()


def wall_ns() -> int:
    """Wall-clock nanoseconds since the epoch (``time.time_ns()``), e.g. for file mtimes."""
    return time.time_ns()


def stamp(fmt: str) -> str:
    """The local time now, formatted (``time.strftime(fmt)``), e.g. for run folder names.

    Example:
        >>> len(stamp("%Y%m%d-%H%M%S"))
        15
    """
    return time.strftime(fmt)


class Deadline:
    """A point ``seconds`` from now on a monotonic clock; ``expired()`` and ``remaining()``.

    Example:
        >>> d = Deadline(30.0, clock=iter([100.0, 110.0, 110.0, 131.0, 131.0]).__next__)
        >>> d.expired(), d.remaining()
        (False, 20.0)
        >>> d.expired(), d
        (True, Deadline(30 s, 0.000 s left))
    """

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.seconds, self.clock = float(seconds), clock
        self.at = clock() + self.seconds

    def remaining(self) -> float:
        """Seconds left (0.0 once expired)."""
        return max(0.0, self.at - self.clock())

    def expired(self) -> bool:
        """True once the clock has passed the deadline."""
        return self.clock() > self.at

    def __repr__(self) -> str:
        return f"Deadline({self.seconds:g} s, {self.remaining():.3f} s left)"

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"


def deadline(seconds: float, clock: Callable[[], float] = time.monotonic) -> Deadline:
    """A deadline ``seconds`` from now, for timeouts.

    Example:
        >>> deadline(60.0).expired()
        False
    """
    return Deadline(seconds, clock)
