"""mlx-vlm's own server as a peer, with its Automatic Prefix Caching (APC) on or off.

``start_mlx_vlm(model, apc=True, **settings)`` runs ``python -m mlx_vlm.server`` on 127.0.0.1 from
*kvlab's own* environment: mlx-vlm 0.7.10 is a kvlab dependency there, and it needs
``mlx>=0.32.4`` and ``transformers>=5.14`` (plus opencv, mlx-audio...), none of which vllm-mlx's
``.venv-peers`` has (that venv exists to pin mlx-lm 0.31.3 for vllm-mlx, and mlx-vlm 0.7.10 does
not use mlx-lm at all). APC is configured only through the environment (``APC_ENABLED``,
``APC_BLOCK_SIZE``, ``APC_CHECKPOINT_INTERVAL_TOKENS``...: ``mlx_vlm.apc.from_env``), so each
setting becomes its ``APC_*`` variable; after start the server's ``GET /v1/settings`` is read back
and every ``apc_*`` value it reports is recorded in ``server.settings["reported"]`` (the variables
set, in ``["env"]``). A setting the server does not report as asked fails the start.

Each run gets a fresh ``HOME`` and ``MLX_VLM_CACHE_HOME`` and, unless ``disk=True``, the SSD tier
off (``APC_DISK_ENABLED=0``): APC's disk tier would otherwise persist blocks across runs under
``~/.cache/mlx-vlm/apc`` and a "cold" run would start warm. ``apc=False`` is APC disabled.

Example:
    >>> with start_mlx_vlm("tiny-vlm", checkpoint_interval_tokens=256) as srv:
    ...     kv.generate_load(srv.url, "multimodal", concurrency=1, num_requests=6)
    ...     srv.cache_stats()["restored_tokens"]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

from .._blas import env_with_fast_blas
from .peer_venv import PeerError
from .peer_server import PeerServer, free_port, launch

# APC settings mlx-vlm 0.7.10 reads, by keyword (its server's names without ``apc_``); the first
# group is reported back by ``/v1/settings``, the second is read from the environment only
REPORTED = ("block_size", "num_blocks", "disk_max_gb", "memory_max_gb", "memory_reserve_gb",
            "disk_queue_max_gb", "disk_shard_max_blocks", "checkpoint_entries",
            "checkpoint_interval_tokens", "checkpoint_guard_tokens")
# mlx-vlm 0.7.10's defaults of the environment-only ones (read from mlx_vlm/apc.py and server/app.py)
ENV_ONLY_DEFAULTS = {"exact_min_tokens": 16, "hash": "fast", "default_tenant": None, "max_pool_tensors": 450000,
                     "layer_major_memory_min_tokens": 50000, "disk_min_free_ram_gb": 2.0}
ENV_ONLY = tuple(ENV_ONLY_DEFAULTS)
TINY_VLMS = ("qwen2_vl", "qwen3_5", "gemma4")  # the "tiny-vlm:<model_type>" kvlab builds


def vlm_folder(model) -> Path:
    """The mlx-vlm folder of ``model``: "tiny-vlm" (or "tiny", "tiny-vlm:qwen2_vl") -> the tiny
    random-weight qwen2_vl kvlab builds offline; a folder path as is; a loaded ``VLModel`` -> its
    folder.

    Example:
        >>> vlm_folder("tiny-vlm").name.startswith("tiny-qwen2vl-")
        True
    """
    from ..vlm import VLModel, ensure_tiny_arch, ensure_tiny_vlm

    if isinstance(model, VLModel):
        return Path(model.path)
    key = os.fspath(model)
    if key in ("tiny", "tiny-vlm") or key.startswith("tiny-vlm:"):
        kind = key.partition(":")[2] or "qwen2_vl"
        if kind not in TINY_VLMS:
            raise PeerError(f"{key!r}: kvlab builds no tiny {kind} VLM; pass one of "
                            f"tiny-vlm:{' tiny-vlm:'.join(TINY_VLMS)} or an mlx-vlm folder")
        return Path(ensure_tiny_vlm() if kind == "qwen2_vl" else ensure_tiny_arch(kind))
    path = Path(key).expanduser()
    if not (path / "config.json").is_file():
        raise PeerError(f"{key!r} is neither tiny-vlm[:<model_type>] nor an mlx-vlm folder with a "
                        "config.json; pass one of those")
    return path.resolve()


def apc_env(apc: bool, disk: bool, settings: dict) -> dict:
    """The ``APC_*`` variables for ``apc`` on/off, the disk tier and ``settings`` (keywords as
    :data:`REPORTED` and :data:`ENV_ONLY`; a bool is 1/0).

    Example:
        >>> apc_env(True, False, {"checkpoint_interval_tokens": 256})
        {'APC_ENABLED': '1', 'APC_DISK_ENABLED': '0', 'APC_CHECKPOINT_INTERVAL_TOKENS': '256'}
    """
    unknown = sorted(set(settings) - set(REPORTED) - set(ENV_ONLY))
    if unknown:
        raise PeerError(f"unknown mlx-vlm APC setting(s) {unknown}; use {', '.join(REPORTED + ENV_ONLY)} "
                        "(mlx-vlm's APC_* names, lower case, without APC_)")
    if settings and not apc:
        raise PeerError(f"APC settings {sorted(settings)} given with apc=False: APC is off, so they "
                        "would do nothing; drop them or start with apc=True")
    env = {"APC_ENABLED": "1" if apc else "0", "APC_DISK_ENABLED": "1" if disk else "0"}
    for k, v in settings.items():
        env[f"APC_{k.upper()}"] = str(int(v)) if isinstance(v, bool) else str(v)
    return env


def start_mlx_vlm(model="tiny-vlm", apc: bool = True, *, port: int | None = None, disk: bool = False,
                  max_tokens: int | None = None, extra_args=(), timeout: float = 180.0,
                  **settings) -> PeerServer:
    """Start mlx-vlm's server (``python -m mlx_vlm.server``, kvlab's environment) on loopback with
    APC on (``apc=False``: off) and ``settings`` as its ``APC_*`` variables; ``disk=True`` keeps
    APC's SSD tier (in the run's fresh cache home). ``server.settings`` holds the variables set
    (``env``), every ``apc_*`` value the server reports (``reported``) and every value in effect
(``in_effect``: those, the environment-only ones and the resolved byte budget). Stopped by pid.

    Example:
        >>> srv = start_mlx_vlm("tiny-vlm", block_size=16); srv.settings["reported"]["apc_block_size"]
        16
    """
    folder = vlm_folder(model)
    apc_vars = apc_env(apc, disk, settings)
    port = port or free_port()
    home = Path(tempfile.mkdtemp(prefix="kvlab-mlx-vlm-home-"))
    env = env_with_fast_blas()
    env = {k: v for k, v in env.items() if not k.startswith("APC_")}  # only what we set counts
    env.update(apc_vars, HOME=str(home), MLX_VLM_CACHE_HOME=str(home / "mlx-vlm"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    args = ["--model", str(folder), "--host", "127.0.0.1", "--port", str(port)]
    if max_tokens is not None:
        args += ["--max-tokens", str(int(max_tokens))]
    cmd = [sys.executable, "-m", "mlx_vlm.server", *args, *map(str, extra_args)]
    mode = "APC" if apc else "APC off"
    server = launch("mlx-vlm", mode, folder, port, cmd, env, home, timeout)
    try:
        reported = reported_settings(server.url)
        check_settings(reported, apc, disk, settings)
    except PeerError:
        server.stop()
        raise
    server.settings.update(env=apc_vars, reported=reported, in_effect=in_effect(reported, settings, server))
    return server


def in_effect(reported: dict, settings: dict, server: PeerServer) -> dict:
    """Every APC value the server runs with: what ``/v1/settings`` reports, the environment-only
    ones (as set, else mlx-vlm's default), and the byte budget it resolved (``memory_max_bytes``
    from ``/v1/cache/stats``: ``apc_memory_max_gb`` None means automatic)."""
    out = {k.removeprefix("apc_"): v for k, v in reported.items()}
    out.update({k: settings.get(k, d) for k, d in ENV_ONLY_DEFAULTS.items()})
    stats = server.cache_stats() or {}
    if stats.get("enabled"):
        out["memory_max_bytes"] = stats.get("memory_max_bytes")
    return out


def reported_settings(url: str) -> dict:
    """Every ``apc_*`` value mlx-vlm's ``GET /v1/settings`` reports as current."""
    try:
        with urllib.request.urlopen(f"{url}/v1/settings", timeout=10) as r:
            current = json.loads(r.read())["current"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PeerError(f"{url}/v1/settings did not report mlx-vlm's settings ({type(e).__name__}: {e}); "
                        "is this mlx-vlm 0.7.10's server?") from e
    return {k: v for k, v in current.items() if k.startswith("apc_")}


def check_settings(reported: dict, apc: bool, disk: bool, settings: dict) -> None:
    """A PeerError naming each setting the server does not run as asked."""
    wanted = {"apc_enabled": apc, "apc_disk_enabled": disk}
    wanted.update({f"apc_{k}": v for k, v in settings.items() if k in REPORTED})
    wrong = {k: (v, reported.get(k)) for k, v in wanted.items()
             if reported.get(k) is None or float(reported[k]) != float(v)}
    if wrong:
        what = "; ".join(f"{k}: asked {a!r}, reports {b!r}" for k, (a, b) in wrong.items())
        raise PeerError(f"mlx-vlm does not run the APC settings asked ({what}); its APC_* variables "
                        "did not reach it: check the environment passed to the server")
