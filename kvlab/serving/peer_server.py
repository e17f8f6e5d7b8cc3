"""A peer server process: started on loopback in its own process group, ready once ``/health``
answers, stopped by process id (at the latest when Python exits). ``kvlab.serving.peers`` and
``kvlab.serving.peers_vlm`` start them.

Example:
    >>> srv = launch("mlx_lm.server", "lru", folder, free_port(), cmd, env, None, 120.0)
    >>> srv.stop(); srv.running
    False
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..primitives import timing
from ..primitives.display import summary_html
from .peer_venv import PeerError

_LIVE: dict[int, "PeerServer"] = {}
_CACHE_FETCH = re.compile(r"\[cache_fetch\] request=(\S+) (HIT|MISS) prompt_tokens=(\d+)(?: cached=(\d+))?")


@dataclass(eq=False)
class PeerServer:
    """A running peer server: ``url`` to send load to, ``stop()`` (also on ``with`` exit)."""

    name: str
    mode: str
    model_path: Path
    port: int
    process: subprocess.Popen
    log_path: Path
    home: Path | None = None
    args: tuple = ()
    settings: dict = field(default_factory=dict)  # what the server runs with, as it reports them
    stopped_log: str | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def log(self, tail: int | None = None) -> str:
        """The server's stdout and stderr so far (the last ``tail`` lines)."""
        text = self.stopped_log if self.stopped_log is not None else (
            self.log_path.read_text(errors="replace") if self.log_path.is_file() else "")
        return "\n".join(text.splitlines()[-tail:]) if tail else text

    def cache_stats(self) -> dict | None:
        """``GET /v1/cache/stats``: vllm-mlx's counters, or mlx-vlm's APC statistics (None for
        servers without the route)."""
        import json

        try:
            with urllib.request.urlopen(f"{self.url}/v1/cache/stats", timeout=10) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def cache_log(self) -> "pl.DataFrame":
        """vllm-mlx's per-request cache lookups from its log (batched mode's memory-aware cache
        logs ``[cache_fetch] ... HIT|MISS prompt_tokens=N cached=M``): one row a lookup, in order,
        with the tokens it *reported* cached.

        Example:
            >>> peer.cache_log().tail(3)["cached"].to_list()
            [1024, 1024, 1280]
        """
        import polars as pl

        rows = [{"request": m[1], "hit": m[2] == "HIT", "prompt_tokens": int(m[3]),
                 "cached": int(m[4]) if m[4] else 0} for m in _CACHE_FETCH.finditer(self.log())]
        return pl.DataFrame(rows, schema={"request": pl.String, "hit": pl.Boolean,
                                          "prompt_tokens": pl.Int64, "cached": pl.Int64})

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``timeout`` s; remove its HOME."""
        if self.running:
            for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        _LIVE.pop(self.process.pid, None)
        if self.stopped_log is None:
            self.stopped_log = self.log()
            shutil.rmtree(self.log_path.parent, ignore_errors=True)
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)

    def __enter__(self) -> "PeerServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"PeerServer({self.name} {self.mode} {self.model_path.name} at {self.url}, {state})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def live() -> list[PeerServer]:
    """The peer servers this process started and has not stopped yet."""
    return list(_LIVE.values())


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(name, mode, folder, port, cmd, env, home, timeout, *, health_key: str | None = None) -> PeerServer:
    """Start ``cmd`` in its own process group (stdout and stderr to a log) and wait until
    ``/health`` on 127.0.0.1:``port`` answers 200 (asked with ``Authorization: Bearer
    health_key`` when the server keys every route); a PeerError with the log's tail if it exits or
    times out first."""
    logdir = Path(tempfile.mkdtemp(prefix=f"kvlab-{name}-log-"))
    log_path = logdir / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    server = PeerServer(name, mode, Path(folder), port, proc, log_path, home, tuple(cmd))
    _LIVE[proc.pid] = server
    health = urllib.request.Request(f"{server.url}/health",
                                    headers={"Authorization": f"Bearer {health_key}"} if health_key else {})
    deadline = timing.deadline(timeout)
    while True:
        if not server.running:
            server.stop()
            raise PeerError(f"{name} exited with code {proc.returncode} before it served; "
                            f"its log ends:\n{server.log(tail=25)}")
        try:
            with urllib.request.urlopen(health, timeout=2) as r:
                if r.status == 200:
                    return server
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                server.stop()
                raise PeerError(f"{name} answered /health with {e.code}: it keys every route; pass one of "
                                f"its keys as health_key") from e
        except OSError:
            pass
        if deadline.expired():
            server.stop()
            raise PeerError(f"{name} did not answer /health within {timeout}s; its log ends:\n"
                            f"{server.log(tail=25)}")
        time.sleep(0.25)


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE.values()):
        server.stop(timeout=5.0)
