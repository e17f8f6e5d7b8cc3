"""Peer servers kvlab compares against, started and stopped as child processes on loopback:
vllm-mlx 0.6.0 (the seeds' server; it pins mlx-lm below 0.32, so it lives in its own virtual
environment ``.venv-peers``), plain ``mlx_lm.server`` (from kvlab's own environment, with no
kvlab code inside it) and mlx-vlm's own server with its Automatic Prefix Caching
(``start_mlx_vlm``, in :mod:`kvlab.serving.peers_vlm`).

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

import os
import subprocess  # noqa: F401  (kept: callers patch peers.subprocess.run around ensure_peers_venv)
import sys
import tempfile
from pathlib import Path

from .._blas import env_with_fast_blas
from ..loader import model_folder
# the process (PeerServer, launch) and the peers' venv live in their own modules; names kept here
from .peer_server import PeerServer, free_port, launch, live  # noqa: F401  (their home is peer_server)
from .peer_venv import (VLLM_MLX, PeerError, ensure_peers_venv, peer_mlx_lm_requirement,  # noqa: F401
                        peers_venv)

MODES = {"simple": (), "batched": ("--continuous-batching",),
         "paged": ("--continuous-batching", "--use-paged-cache")}


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
                      dtype: str | None = None, extra_args=(), health_key: str | None = None,
                      timeout: float = 120.0) -> PeerServer:
    """Start ``kvlab serve`` as a child process, like the peers, so a benchmark's client never
    shares a process (and its GIL) with the server it measures. It runs ``dtype``, else the dtype
    of ``model`` when that is a loaded kvlab model, else the folder's stored dtype. A server
    started with ``--api-key``/``--api-keys`` in ``extra_args`` keys every route, ``/health``
    included: pass one of its keys as ``health_key``.

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
    return launch("kvlab serve", store, Path(name), port, cmd, env, None, timeout, health_key=health_key)


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


def refuse_a_cast(model, peer: str) -> None:
    """A loaded kvlab model cast away from its folder's dtype cannot be compared with ``peer``,
    which loads the folder as stored (``kvlab.models.dtypes.require_stored_dtype``)."""
    from ..models.dtypes import require_stored_dtype  # imports mlx: only when a peer starts
    from ..models.loading import Model

    if isinstance(model, Model):
        require_stored_dtype(model, peer)


def start_mlx_vlm(model="tiny-vlm", apc: bool = True, **kw) -> PeerServer:
    """mlx-vlm's own server with its Automatic Prefix Caching on (``apc=False``: off); keywords
    and why it runs in kvlab's environment: :func:`kvlab.serving.peers_vlm.start_mlx_vlm`.

    Example:
        >>> with start_mlx_vlm("tiny-vlm", checkpoint_interval_tokens=256) as srv:
        ...     srv.settings["reported"]["apc_checkpoint_interval_tokens"]
        256
    """
    from .peers_vlm import start_mlx_vlm as start

    return start(model, apc, **kw)
