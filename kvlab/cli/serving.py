"""`kvlab serve`: mlx-lm's own server with a kvlab store behind its prompt cache (foreground;
Ctrl-C or SIGTERM stops it after every finished request is recorded)."""

from __future__ import annotations

import sys

from .output import in_foreground


def register(sub) -> None:
    from ..models.dtypes import DTYPES
    from ..stores import STORE_NAMES

    s = sub.add_parser("serve", help="serve a model over HTTP (OpenAI + Anthropic routes) with a kvlab store")
    s.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, an mlx-lm folder, an "
                   "org/name repo id in the local Hugging Face cache, or a vision-language model: "
                   "tiny-vlm or an mlx-vlm folder (images in chat and messages; its requests are "
                   "served one at a time, not continuously batched)")
    s.add_argument("--dtype", default=None, choices=DTYPES,
                   help="run the model in this dtype (default: the folder's stored dtype)")
    s.add_argument("--store", default="radix", choices=list(STORE_NAMES),
                   help="prompt cache: a store as kv.make_store(name) builds it (mlx-lru: mlx-lm's "
                   "own LRUPromptCache) or none")
    s.add_argument("--budget", default=None, help="store budget in bytes, e.g. 1GiB")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    s.add_argument("--port", type=int, default=8080, help="port (0: a free one)")
    s.add_argument("--record", default=None, metavar="PATH", help="append one JSON line per finished request")
    s.add_argument("--record-text", action="store_true", help="also record token ids and message text")
    s.add_argument("--normalise", action="store_true",
                   help="apply kvlab's normalisation rules (the billing header) to messages")
    s.add_argument("--api-key", default=None, help="required key on every route (default $KVLAB_API_KEY): "
                   "one tenant, as before tenants")
    s.add_argument("--api-keys", default=None, metavar="FILE",
                   help="serve several tenants that cannot see each other's cache or metadata: one "
                   "'KEY TENANT' pair per line (several keys may share a tenant)")
    s.add_argument("--admin-key", default=None, metavar="KEY",
                   help="the operator's key: sees every tenant's requests, events, stats and metrics")
    s.add_argument("--tenant-secret", default=None, metavar="PATH",
                   help="the secret tenant salts are keyed with (default $KVLAB_HOME/tenants/secret, "
                   "created once; keep it to keep a disk tier's salted entries reachable)")
    s.add_argument("--public-prefix", action="append", default=[], metavar="FILE",
                   help="a system prompt (the file's text) every tenant shares; what follows it stays "
                   "salted (may repeat)")
    s.add_argument("--disk", default=None, metavar="PATH",
                   help="a disk tier behind the radix/paged store: a folder that survives restarts")
    s.add_argument("--disk-budget", default=None, help="disk tier budget, e.g. 20GiB (default: a "
                   "quarter of the free disk)")
    s.add_argument("--block-size", type=int, default=16, help="paged store block size / recorded hash blocks")
    s.add_argument("--max-tokens", type=int, default=512, help="default tokens to generate per request")
    s.add_argument("--checkpoints", type=_policy, default="segment_ends", metavar="POLICY",
                   help="where prefill stops to snapshot a prompt (caches that cannot be cut back are "
                   "reusable only there): segment_ends (default, mlx-lm's server), message_ends, "
                   "tail:N, every:N, last_message, log_spaced, cost_aware, none")
    s.add_argument("--kv-events", default=None, metavar="tcp://127.0.0.1:PORT",
                   help="publish the store as vLLM 0.10.2 KV events (ZMQ PUB, msgpack) on this address")
    s.add_argument("--press", default=None, metavar="NAME:RATIO",
                   help="compress each prompt's context (all but its last message) with a KV-cache press, "
                   "e.g. knorm:0.5; stored whole and reused on a whole-context hit; requests are then "
                   "served one at a time (/kvlab/stats says so)")
    s.set_defaults(func=serve)


def _policy(spec: str) -> str:
    import argparse

    from ..checkpoints import parse_policy
    from ..errors import KvlabError

    try:
        parse_policy(spec)
    except KvlabError as e:  # argparse prints it with the usage and exits 2
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def serve(args) -> int:
    from pathlib import Path

    from ..errors import KvlabError
    from ..serving.server import Server

    try:
        public = [Path(p).read_text(encoding="utf-8").strip() for p in args.public_prefix]
    except OSError as e:
        raise KvlabError(f"cannot read the public prefix {e.filename}: {e.strerror}") from e
    server = Server(args.model, args.store, dtype=args.dtype, budget=args.budget, host=args.host, port=args.port,
                    record=args.record, record_text=args.record_text, normalise=args.normalise,
                    api_key=args.api_key, block_size=args.block_size, max_tokens=args.max_tokens,
                    disk=args.disk, disk_budget=args.disk_budget, checkpoints=args.checkpoints,
                    api_keys=args.api_keys, admin_key=args.admin_key, tenant_secret=args.tenant_secret,
                    public_prefix=public, kv_events=args.kv_events, press=args.press)
    server.start()
    budget = server.budget_bytes if server.budget_bytes is not None else "unbounded"
    in_foreground(server, f"kvlab serve: {server.url} · model {server.model.name} in {server.model.dtype_label} · "
                  f"store {server.store_name} · "
                  f"budget {budget} B · checkpoints {server.checkpoints!r}{' · normalise' if server.normalise else ''}"
                  f"{' · recording ' + str(args.record) if args.record else ''}"
                  f"{' · disk tier ' + str(args.disk) if args.disk else ''} · metrics at {server.url}/metrics"
                  f"{' · tenants ' + ', '.join(server.tenancy.keyring.tenants) if args.api_keys else ''}"
                  f"{' · KV events ' + server.kv_events.endpoint if server.kv_events else ''}"
                  f"{' · press ' + server.press.key if server.press else ''}"
                  " · Ctrl-C to stop", server.wait)
    s = server.stats()
    print(f"kvlab serve: stopped after {s['requests']} requests, token hit {s['token_hit_rate']:.1%}, "
          f"request hit {s['request_hit_rate']:.1%}", file=sys.stderr, flush=True)
    if server.failure is not None:
        print(f"kvlab serve: {server.failure}", file=sys.stderr, flush=True)
        return 1
    return 0
