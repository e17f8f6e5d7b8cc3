"""``kvlab cluster up`` / ``kv.cluster.up``: N ``kvlab serve`` processes, each publishing its store as
KV events on a port of its own, and a ``kvlab route`` process in front of them, all on loopback,
each in its own process group and stopped by its process id (at the latest when Python exits).
The instances start at once (they load the model side by side); the router starts once every
instance answers ``/health`` and is ready once it answers through to them.

Example:
    >>> with kv.cluster.up(2, "tiny", store="paged", policy="llmd_weighted") as c:
    ...     kv.generate_load(c.url, "multi_turn", concurrency=2, num_requests=8)
    ...     c.rows()[0]["upstream"]
    'http://127.0.0.1:...'
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import KvlabError
from ..primitives.display import summary_html, table_html
from ..serving.peer_server import PeerServer, free_port, launch
from ..serving.peers import start_kvlab_serve
from .realrun import settler
from .routers import check_router, check_view

ROOT = Path(__file__).resolve().parents[2]


@dataclass(eq=False)
class Cluster:
    """Running ``instances`` (PeerServers) behind a ``router`` (a PeerServer): send load to ``url``."""

    instances: list
    router: PeerServer
    policy: str
    view: str
    _settle: object = field(default_factory=settler, repr=False)

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def pids(self) -> list[int]:
        return [s.pid for s in self.instances] + [self.router.pid]

    def settle(self, upstream: str, i: int = 0) -> None:
        """Wait until the instance at ``upstream`` has stored the prompt + output of every request
        it answered: what a replay waits for before its next request
        (``realrun.run_through(cluster.url, texts, settle=cluster.settle)``)."""
        self._settle(upstream, i)

    def rows(self, sync: bool = True) -> list[dict]:
        """The router's ``GET /kvlab/route`` rows (``sync``: once its view holds every event)."""
        return self.route(sync)["rows"]

    def route(self, sync: bool = True) -> dict:
        """The router's whole ``GET /kvlab/route`` answer: rule, view, instances and rows."""
        with urllib.request.urlopen(f"{self.url}/kvlab/route{'?sync=1' if sync else ''}", timeout=60) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        """Stop the router, then every instance, each by its process id."""
        self.router.stop()
        for s in self.instances:
            s.stop()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        live = sum(s.running for s in self.instances)
        return (f"Cluster({self.url}: {self.policy}/{self.view} over {live} of {len(self.instances)} instances, "
                f"router {'pid ' + str(self.router.pid) if self.router.running else 'stopped'})")

    def _repr_html_(self) -> str:
        rows = [["router", self.router.url, self.router.pid, self.router.running]]
        rows += [[f"instance {i}", s.url, s.pid, s.running] for i, s in enumerate(self.instances)]
        return summary_html("kvlab Cluster", f"{self.policy} / {self.view}",
                            body=table_html(("role", "url", "pid", "running"), rows))


def up(instances: int = 2, model: str = "tiny", store: str = "paged", *, policy: str = "llmd_weighted",
       view: str = "precise", budget=None, block_size: int = 16, port: int | None = None,
       router_args=(), timeout: float = 180.0) -> Cluster:
    """Start ``instances`` ``kvlab serve --model model --store store --kv-events ...`` processes and
    ``kvlab route`` over them (``policy``, ``view``; ``port`` for the router, else a free one);
    ``router_args`` are more ``kvlab route`` flags. Everything started is stopped if one fails.
    """
    check_router(policy)
    check_view(view)
    if isinstance(instances, bool) or not isinstance(instances, int) or not 1 <= instances <= 64:
        raise KvlabError(f"instances must be an int from 1 to 64, got {instances!r}")
    started: list = []

    def one(_):
        srv = start_kvlab_serve(model, store, budget=budget, timeout=timeout, extra_args=(
            "--kv-events", f"tcp://127.0.0.1:{free_port()}", "--block-size", str(block_size)))
        started.append(srv)
        return srv

    try:
        with ThreadPoolExecutor(instances) as pool:
            servers = list(pool.map(one, range(instances)))
        router = start_kvlab_route([s.url for s in servers], policy, view, tokenizer=model,
                                   block_size=block_size, port=port, extra_args=router_args, timeout=timeout)
    except BaseException:
        for s in started:
            s.stop()
        raise
    return Cluster(servers, router, policy, view)


def start_kvlab_route(upstreams, policy: str, view: str, *, tokenizer=None, block_size: int = 16,
                      port: int | None = None, extra_args=(), timeout: float = 120.0) -> PeerServer:
    """``kvlab route`` over ``upstreams`` as a child process; ready once ``/health`` answers
    through it."""
    port = port or free_port()
    args = ["route", "--policy", policy, "--view", view, "--host", "127.0.0.1", "--port", str(port),
            "--block-size", str(block_size)]
    for u in upstreams:
        args += ["--upstream", u]
    if tokenizer is not None:
        args += ["--model", str(tokenizer)]
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "kvlab.cli", *args, *map(str, extra_args)]
    return launch("kvlab route", f"{policy}/{view}", ROOT, port, cmd, env, None, timeout)
