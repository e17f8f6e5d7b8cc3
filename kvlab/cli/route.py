"""`kvlab route` (a cache-aware router in front of several servers) and `kvlab cluster up` (N
`kvlab serve` instances publishing KV events, and the router in front), in the foreground until
Ctrl-C or SIGTERM; `kvlab cluster up` then stops every process it started by its id.

Example:
    $ kvlab route --upstream http://127.0.0.1:8080 --upstream http://127.0.0.1:8081 \\
          --policy llmd_weighted --view precise --model tiny --port 8090
    $ kvlab cluster up --instances 2 --model tiny --store paged --policy sglang_cache_aware
"""

from __future__ import annotations

import sys
import threading

from .output import in_foreground

POLICIES = "random, round_robin, least_loaded, power_of_two, session, sglang_cache_aware, ray_prefix_affinity, " \
           "aibrix_prefix, llmd_weighted, dynamo_cost, preble_e2, mooncake_ttft"


def register(sub) -> None:
    r = sub.add_parser("route", help="a cache-aware router in front of several OpenAI/Anthropic-compatible servers")
    r.add_argument("--upstream", action="append", required=True, metavar="URL",
                   help="a server's base URL; once per instance (kvlab serve, mlx_lm.server, ...)")
    _rule(r)
    r.add_argument("--model", default=None, metavar="M",
                   help="the servers' tokenizer (a kvlab model name or an mlx-lm folder): cache-aware rules "
                   "hash each request's token blocks")
    r.add_argument("--block-size", type=int, default=16, help="tokens per block, as the instances' KV events")
    r.add_argument("--kv-events", action="append", default=None, metavar="tcp://HOST:PORT",
                   help="an instance's KV-event endpoint, once per --upstream in the same order (default: "
                   "read from each kvlab serve's /kvlab/stats)")
    r.add_argument("--capacity-tokens", type=int, default=None,
                   help="tokens each instance caches (KV usage for llmd_weighted, the LRU of approximate views)")
    r.add_argument("--upstream-key", default=None, help="API key the router's own calls to the upstreams send")
    r.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    r.add_argument("--port", type=int, default=8090, help="port (0: a free one)")
    r.add_argument("--record", default=None, metavar="PATH", help="append one JSON line per finished request")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds to wait on an upstream")
    r.set_defaults(func=route)

    c = sub.add_parser("cluster", help="start N kvlab serve instances and a router in front (loopback)")
    csub = c.add_subparsers(dest="action", required=True)
    u = csub.add_parser("up", help="start them in the foreground; Ctrl-C stops every process by its id")
    u.add_argument("--instances", type=int, default=2, help="kvlab serve processes (default 2)")
    u.add_argument("--model", default="tiny", help="the model every instance serves (default tiny)")
    u.add_argument("--store", default="paged", help="each instance's store (default paged)")
    u.add_argument("--budget", default=None, help="each instance's store budget, e.g. 256MiB")
    _rule(u, default="llmd_weighted")
    u.add_argument("--block-size", type=int, default=16, help="tokens per block (events and router)")
    u.add_argument("--port", type=int, default=8090, help="the router's port (0: a free one)")
    u.set_defaults(func=cluster_up)


def _rule(p, default: str = "round_robin") -> None:
    p.add_argument("--policy", default=default, metavar="NAME", help=f"the routing rule: {POLICIES}")
    p.add_argument("--view", default="precise", metavar="V",
                   help="what a cache-aware rule reads: precise (KV events), approximate (its own record), "
                   "stale:D (events D seconds late)")


def route(args) -> int:
    from ..cluster.router import Router

    r = Router(args.upstream, args.policy, args.view, tokenizer=args.model, block_size=args.block_size,
               kv_events=args.kv_events, capacity_tokens=args.capacity_tokens, api_key=args.upstream_key,
               host=args.host, port=args.port, record=args.record, timeout=args.timeout).start()
    in_foreground(r, f"kvlab route: {r.url} -> {len(r.targets)} instances ({', '.join(t.url for t in r.targets)})"
                  f" · {args.policy}/{args.view} · rows at {r.url}/kvlab/route · Ctrl-C to stop", r.wait_stopped)
    print(f"kvlab route: stopped after {len(r.rows)} requests", file=sys.stderr, flush=True)
    return 0


def cluster_up(args) -> int:
    from ..cluster.launch import up

    c = up(args.instances, args.model, args.store, policy=args.policy, view=args.view, budget=args.budget,
           block_size=args.block_size, port=args.port)
    stopped = threading.Event()

    class _Stop:
        def stop(self):
            c.stop()
            stopped.set()

    pids = ", ".join(f"{s.url} (pid {s.pid})" for s in c.instances)
    in_foreground(_Stop(), f"kvlab cluster: router {c.url} (pid {c.router.pid}) · {args.policy}/{args.view} · "
                  f"instances {pids} · rows at {c.url}/kvlab/route · Ctrl-C stops them all", stopped.wait)
    print(f"kvlab cluster: stopped {len(c.pids)} processes", file=sys.stderr, flush=True)
    return 0
