"""kvlab.primitives.timing: every clock read in kvlab/ goes through it (issue 20, point 6).

MLX is lazy, and asynchronous on GPU backends: a duration read before ``mx.eval`` and
``mx.synchronize()`` measures nothing. ``timed()`` evaluates, synchronises, then reads the clock;
the plain clock (``now``, ``wall``, ``stamp``, ``deadline``) is for reads that are not a measurement
of MLX work. No test here depends on how long anything takes: the clocks are fakes.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from kvlab.primitives import timing

ROOT = Path(__file__).resolve().parents[2]
KVLAB = ROOT / "kvlab"
HOME = KVLAB / "primitives" / "timing.py"

# Reading any of these is a clock read, called or handed over (``default_factory=time.perf_counter``).
CLOCKS = {f"time.{n}" for n in ("perf_counter", "perf_counter_ns", "time", "time_ns", "monotonic",
                                 "monotonic_ns", "process_time", "process_time_ns", "thread_time",
                                 "thread_time_ns", "clock_gettime", "clock_gettime_ns")}
CLOCKS |= {"datetime.datetime.now", "datetime.datetime.utcnow", "datetime.datetime.today",
           "datetime.date.today"}
# These read the clock only when called without a time: time.strftime(fmt), time.localtime(), ...
NO_TIME_GIVEN = {"time.strftime": 1, "time.localtime": 0, "time.gmtime": 0, "time.ctime": 0,
                 "time.asctime": 0}


def clock_reads(source: str, filename: str = "<src>") -> list[str]:
    """``file:line: name`` for every clock read in ``source`` (aliases and from-imports resolved)."""
    tree = ast.parse(source, filename)
    alias = {"time": "time", "datetime": "datetime"}  # caught even before its import is added
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                alias[(a.asname or a.name).split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module in ("time", "datetime") and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                alias[a.asname or a.name] = full
                if full in CLOCKS or full in NO_TIME_GIVEN:
                    found.append((node.lineno, f"from {node.module} import {a.name}"))

    def dotted(node) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in alias:
            return None
        return ".".join([alias[node.id], *reversed(parts)])

    calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Attribute, ast.Name)) or isinstance(getattr(node, "ctx", None), ast.Store):
            continue
        name = dotted(node)
        if name in CLOCKS:
            found.append((node.lineno, name))
        elif name in NO_TIME_GIVEN and id(node) in calls:
            call = calls[id(node)]
            if len(call.args) + len(call.keywords) <= NO_TIME_GIVEN[name]:
                found.append((node.lineno, f"{name}() without a time"))
    return [f"{filename}:{line}: {what}" for line, what in sorted(set(found))]


def test_scanner_finds_every_form_of_clock_read():
    # Mutant caught: a scanner that misses a form (a from-import, an alias, a reference handed over
    # as a default, datetime.now, strftime without a time) would let test_no_clock_read_outside_timing pass.
    src = ("import time\nimport time as T\nimport datetime\nfrom time import perf_counter as pc\n"
           "from datetime import datetime as dt\nfrom dataclasses import field\n"
           "a = time.perf_counter()\nb = T.monotonic()\nc = pc()\nd = datetime.datetime.now()\n"
           "e = dt.utcnow()\nf = field(default_factory=time.time)\ng = time.strftime('%Y')\n"
           "h = time.strftime('%Y', time.gmtime(0))\ni = time.sleep(0)\nj = time.time_ns()\n")
    assert clock_reads(src) == [
        "<src>:4: from time import perf_counter", "<src>:7: time.perf_counter", "<src>:8: time.monotonic",
        "<src>:9: time.perf_counter", "<src>:10: datetime.datetime.now", "<src>:11: datetime.datetime.utcnow",
        "<src>:12: time.time", "<src>:13: time.strftime() without a time", "<src>:16: time.time_ns"]
    assert clock_reads("time = 3\nx = time\nfrom kvlab.primitives import timing\ny = timing.now()\n") == []


# scripts kvlab runs in another interpreter, where kvlab is not installed (a peer's venv)
STANDALONE = {KVLAB / "presses" / "kvpress_runner.py"}


def test_no_clock_read_outside_timing():
    # Mutant caught: a new `time.perf_counter()` (or time.time(), datetime.now, ...) anywhere in
    # kvlab/ outside kvlab/primitives/timing.py, e.g. `t = time.perf_counter()` added to kvlab/engine.py.
    files = sorted(p for p in KVLAB.rglob("*.py") if p != HOME and p not in STANDALONE)
    assert len(files) > 100
    reads = [r for p in files for r in clock_reads(p.read_text(), str(p.relative_to(ROOT)))]
    assert reads == [], "clock reads outside kvlab/primitives/timing.py (use timing.timed() for a " \
                        "measured duration, timing.now/wall/stamp/deadline otherwise):\n" + "\n".join(reads)


def test_timed_evaluates_and_synchronises_before_reading_the_clock(monkeypatch):
    # Mutants caught: done() reading the clock before mx.eval (or without evaluating its outputs),
    # done() not calling mx.synchronize(), and the start not synchronising first (queued work counted).
    events, readings = [], iter([100.0, 101.5])
    real_eval, real_sync = mx.eval, mx.synchronize

    def eval_(*args):
        events.append(("eval", args))
        return real_eval(*args)

    def sync(*args):
        events.append(("sync", args))
        return real_sync(*args)

    def clock():
        events.append(("clock", ()))
        return next(readings)

    monkeypatch.setattr(mx, "eval", eval_)
    monkeypatch.setattr(mx, "synchronize", sync)
    a = mx.ones((256, 256))
    y = a
    for _ in range(12):  # a lazy graph of 12 matmuls: nothing is computed until it is evaluated
        y = (y @ a) / 256
    t = timing.timed(clock=clock)
    assert repr(t) == "Timer(running)"
    seconds = t.done(y, None, [7])
    assert [e for e, _ in events] == ["sync", "clock", "eval", "sync", "clock"]
    assert events[2][1][0] is y and events[2][1][1:] == (None, [7])
    assert seconds == t.seconds == 1.5
    assert repr(t) == "Timer(1.500000 s)"
    assert t._repr_html_() == "<code>Timer(1.500000 s)</code>"
    monkeypatch.undo()
    assert y.shape == (256, 256) and y.sum().item() == 65536.0


def test_timed_block_ends_on_exit_but_not_on_error():
    # Mutants caught: __exit__ not ending an unfinished timer (t.seconds stays None), ending it again
    # after done() (a second clock read), or ending it when the block raised.
    with timing.timed(clock=iter([1.0, 2.0, 9.0]).__next__) as t:
        pass
    assert t.seconds == 1.0
    with timing.timed(clock=iter([1.0, 4.0, 9.0]).__next__) as t:
        assert t.done() == 3.0
    assert t.seconds == 3.0
    with pytest.raises(ValueError):
        with timing.timed(clock=iter([1.0, 2.0]).__next__) as t:
            raise ValueError("boom")
    assert t.seconds is None


def test_timed_never_imports_mlx():
    # Mutant caught: `import mlx.core` at the top of timing.py (or inside timed): the load generator
    # and block hashing, which time things but run no MLX, would load it.
    code = ("import sys\nfrom kvlab.primitives import timing\nt = timing.timed()\nt.done()\n"
            "print('mlx.core' in sys.modules, t.seconds >= 0.0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout == "False True\n"


def test_deadline():
    # Mutants caught: expiring at the deadline instead of after it (>= for >), a remaining() that
    # goes negative, a deadline counted from the wrong end (now - seconds).
    d = timing.deadline(30.0, clock=iter([100.0, 129.0, 129.0, 130.0, 130.0, 131.0, 131.0]).__next__)
    assert d.at == 130.0
    assert (d.expired(), d.remaining()) == (False, 1.0)
    assert (d.expired(), d.remaining()) == (False, 0.0)
    assert (d.expired(), d.remaining()) == (True, 0.0)
    d = timing.Deadline(2.5, clock=iter([0.0, 1.0]).__next__)
    assert repr(d) == "Deadline(2.5 s, 1.500 s left)"


def test_plain_clock():
    # Mutant caught: wall() returning the monotonic clock (stored timestamps near 0, not the epoch),
    # stamp() ignoring its format.
    assert timing.wall() > 1.7e9 and timing.wall_ns() > 1.7e18
    assert len(timing.stamp("%Y%m%d-%H%M%S")) == 15 and timing.stamp("x%%y") == "x%y"
    t0 = timing.now()
    assert timing.now() >= t0
