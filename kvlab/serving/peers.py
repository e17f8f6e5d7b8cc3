"""Peer servers kvlab compares against, started and stopped as child processes on loopback:
vllm-mlx 0.6.0 (the seeds' server; it pins mlx-lm below 0.32, so it lives in its own virtual
environment ``.venv-peers``) and plain ``mlx_lm.server`` (from kvlab's own environment, with no
kvlab code inside it).

vllm-mlx modes: ``simple`` (one request at a time, queued; its prefix cache is mlx-lm's
LRUPromptCache trie), ``batched`` (continuous batching with its memory-aware prefix cache) and
``paged`` (continuous batching with the paged block cache). Each run gets a fresh ``HOME``,
because vllm-mlx saves its prefix cache under ``$HOME/.cache/vllm-mlx`` on shutdown and reloads
it on start. Servers stop by process id (their own process group), at the latest when Python
exits.

Example:
    >>> with start_vllm_mlx("tiny", "paged") as peer:
    ...     r = kv.generate_load(peer.url, "shared_system_prompt", concurrency=4, num_requests=8)
    ...     peer.cache_stats()["engine_cache"]
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .._blas import env_with_fast_blas
from ..errors import KvlabError
from ..primitives import timing
from ..primitives.display import summary_html
# the peers' venv (vllm-mlx pins mlx-lm below 0.32) lives in its own module; names kept here
from .peer_venv import (VLLM_MLX, PeerError, ensure_peers_venv, peer_mlx_lm_requirement,  # noqa: F401
                        peers_venv)

MODES = {"simple": (), "batched": ("--continuous-batching",),
         "paged": ("--continuous-batching", "--use-paged-cache")}
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


def start_vllm_mlx(model="tiny", mode: str = "batched", *, port: int | None = None,
                   prefix_cache: bool = True, cache_memory_mb: int | None = None,
                   extra_args=(), timeout: float = 240.0) -> PeerServer:
    """Start vllm-mlx on a kvlab model (a name such as "tiny" or "smollm2", a kvlab model or an
    mlx-lm folder) in ``mode`` (simple, batched, paged), on loopback; ``prefix_cache=False`` runs
    it with its prefix cache off. Installs the peers' venv first if needed.

    Example:
        >>> peer = start_vllm_mlx("tiny", "batched"); peer.url
        'http://127.0.0.1:41877'
    """
    if mode not in MODES:
        raise PeerError(f"unknown vllm-mlx mode {mode!r}; use one of {', '.join(MODES)}")
    refuse_a_cast(model, "vllm-mlx")
    venv = ensure_peers_venv()
    folder = model_folder(model)
    port = port or free_port()
    home = Path(tempfile.mkdtemp(prefix="kvlab-vllm-mlx-home-"))
    args = ["serve", str(folder), "--host", "127.0.0.1", "--port", str(port), *MODES[mode]]
    if not prefix_cache:
        args.append("--disable-prefix-cache")
    elif mode == "simple":
        args.append("--prefix-trie-cache")
    if cache_memory_mb is not None:
        args += ["--cache-memory-mb", str(int(cache_memory_mb))]
    env = env_with_fast_blas()
    # concurrent requests to simple mode wait for the lock instead of getting 503s
    env.update(HOME=str(home), HF_HUB_OFFLINE="1", VLLM_MLX_SIMPLE_ENGINE_LOCK_ADMISSION="wait")
    cmd = [str(venv / "bin" / "vllm-mlx"), *args, *map(str, extra_args)]
    return launch("vllm-mlx", mode if prefix_cache else f"{mode}, no prefix cache", folder, port,
                   cmd, env, home, timeout)


def start_mlx_lm(model="tiny", *, port: int | None = None, prompt_cache_size: int = 10,
                 prompt_cache_bytes: int | None = None, extra_args=(),
                 timeout: float = 120.0) -> PeerServer:
    """Start plain ``mlx_lm.server`` (mlx-lm's own LRUPromptCache, no kvlab code) on a kvlab model
    on loopback; ``prompt_cache_size=0`` turns its prompt cache off.

    Example:
        >>> with start_mlx_lm("tiny") as srv:
        ...     kv.generate_load(srv.url, "multi_turn", concurrency=2, num_requests=6)
    """
    refuse_a_cast(model, "mlx_lm.server")
    folder = model_folder(model)
    port = port or free_port()
    args = ["--model", str(folder), "--host", "127.0.0.1", "--port", str(port),
            "--prompt-cache-size", str(int(prompt_cache_size))]
    if prompt_cache_bytes is not None:
        args += ["--prompt-cache-bytes", str(int(prompt_cache_bytes))]
    from ..models.loading import kvlab_home

    # an empty Hugging Face cache: /v1/models then lists the model folder (with none, mlx_lm.server
    # fails to scan it after sending its headers, and the list comes back empty)
    hub = kvlab_home() / "peers" / "empty-hf-hub"
    hub.mkdir(parents=True, exist_ok=True)
    env = env_with_fast_blas()
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub))
    cmd = [sys.executable, "-m", "mlx_lm.server", *args, *map(str, extra_args)]
    mode = "lru" if prompt_cache_size > 0 else "no prompt cache"
    return launch("mlx_lm.server", mode, folder, port, cmd, env, None, timeout)


def start_kvlab_serve(model="tiny", store: str = "radix", *, budget=None, port: int | None = None,
                      dtype: str | None = None, extra_args=(), timeout: float = 120.0) -> PeerServer:
    """Start ``kvlab serve`` as a child process, like the peers, so a benchmark's client never
    shares a process (and its GIL) with the server it measures. It runs ``dtype``, else the dtype
    of ``model`` when that is a loaded kvlab model, else the folder's stored dtype.

    Example:
        >>> with start_kvlab_serve("tiny", "paged", budget="64MiB") as srv:
        ...     kv.generate_load(srv.url, "multi_turn", concurrency=2, num_requests=6)
    """
    name = model if isinstance(model, str) and not Path(model).is_dir() else str(model_folder(model))
    port = port or free_port()
    args = ["serve", "--model", name, "--store", store, "--host", "127.0.0.1", "--port", str(port)]
    if budget is not None:
        args += ["--budget", str(budget)]
    dtype = dtype or getattr(model, "dtype", None)
    if dtype:
        args += ["--dtype", dtype]
    env = env_with_fast_blas()
    root = str(Path(__file__).resolve().parents[2])  # the child imports this same kvlab
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "kvlab.cli", *args, *map(str, extra_args)]
    return launch("kvlab serve", store, Path(name), port, cmd, env, None, timeout)


def start_kvlab_proxy(upstream: str, *, tokenizer=None, port: int | None = None,
                      timeout: float = 120.0) -> PeerServer:
    """Start ``kvlab proxy --upstream URL`` as a child process (``tokenizer``: a kvlab model name
    or folder, for token-level rows); ready once the upstream answers ``/health`` through it.

    Example:
        >>> with start_mlx_lm(m) as up, start_kvlab_proxy(up.url, tokenizer="smollm2") as px: ...
    """
    port = port or free_port()
    args = ["proxy", "--upstream", upstream, "--host", "127.0.0.1", "--port", str(port)]
    if tokenizer is not None:
        args += ["--model", str(tokenizer)]
    env = os.environ.copy()
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "kvlab.cli", *args]
    return launch("kvlab proxy", upstream, Path(root), port, cmd, env, None, timeout)


def live() -> list[PeerServer]:
    """The peer servers this process started and has not stopped yet."""
    return list(_LIVE.values())


def refuse_a_cast(model, peer: str) -> None:
    """A loaded kvlab model cast away from its folder's dtype cannot be compared with ``peer``,
    which loads the folder as stored (``kvlab.models.dtypes.require_stored_dtype``)."""
    from ..models.dtypes import require_stored_dtype  # imports mlx: only when a peer starts
    from ..models.loading import Model

    if isinstance(model, Model):
        require_stored_dtype(model, peer)


def model_folder(model) -> Path:
    """The mlx-lm folder of a kvlab model name, a loaded kvlab model, or a folder path."""
    if hasattr(model, "path"):
        return Path(model.path)
    p = Path(os.fspath(model)).expanduser()
    if p.is_dir():
        return p.resolve()
    from ..models.loading import load

    return Path(load(os.fspath(model)).path)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(name, mode, folder, port, cmd, env, home, timeout) -> PeerServer:
    """Start ``cmd`` in its own process group (stdout and stderr to a log) and wait until
    ``/health`` on 127.0.0.1:``port`` answers 200; a PeerError with the log's tail if it exits or
    times out first."""
    logdir = Path(tempfile.mkdtemp(prefix=f"kvlab-{name}-log-"))
    log_path = logdir / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    server = PeerServer(name, mode, Path(folder), port, proc, log_path, home, tuple(cmd))
    _LIVE[proc.pid] = server
    deadline = timing.deadline(timeout)
    while True:
        if not server.running:
            server.stop()
            raise PeerError(f"{name} exited with code {proc.returncode} before it served; "
                            f"its log ends:\n{server.log(tail=25)}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as r:
                if r.status == 200:
                    return server
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
