"""`kvlab proxy`: forward OpenAI and Anthropic routes to any compatible server unchanged, record the
traffic in kvlab's trace format and list per request what it extends and reused (foreground;
Ctrl-C or SIGTERM stops it after every finished request is recorded).

Example:
    $ kvlab proxy --upstream http://127.0.0.1:8080 --port 8081 --record runs/agent.jsonl --model smollm2
"""

from __future__ import annotations

import sys

from .output import in_foreground


def register(sub) -> None:
    s = sub.add_parser("proxy", help="a recording proxy in front of any OpenAI/Anthropic-compatible server")
    s.add_argument("--upstream", required=True, metavar="URL",
                   help="the server's base URL, e.g. http://127.0.0.1:8080 (mlx_lm.server, vllm-mlx, kvlab serve)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    s.add_argument("--port", type=int, default=8081, help="port (0: a free one)")
    s.add_argument("--record", default=None, metavar="PATH", help="append one JSON line per finished request")
    s.add_argument("--record-text", action="store_true", help="also record token ids and messages")
    s.add_argument("--model", default=None, metavar="M",
                   help="tokenizer for token ids and hash ids: a kvlab model name (smollm2, tiny) or an "
                   "mlx-lm folder; without it prompts are compared message by message")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds to wait on the upstream")
    s.add_argument("--users", default=None, metavar="FILE",
                   help="one 'KEY USER [UPSTREAM_CREDENTIAL]' line per key: callers must present a key, "
                   "which is swapped for their upstream credential; rows and diagnostics per user")
    s.add_argument("--admin-key", default=None, metavar="KEY", help="the operator's key: reads every user's rows")
    s.add_argument("--cache-salt", action="store_true",
                   help="inject each user's cache_salt (vLLM's field) into request bodies, for upstreams "
                   "that take one (vLLM, kvlab serve): users then share no cache upstream")
    s.add_argument("--tenant-secret", default=None, metavar="PATH",
                   help="the secret user salts are keyed with (default $KVLAB_HOME/tenants/secret)")
    s.set_defaults(func=run)


def run(args) -> int:
    from ..proxying.server import Proxy

    px = Proxy(args.upstream, host=args.host, port=args.port, record=args.record,
               record_text=args.record_text, tokenizer=args.model, timeout=args.timeout, users=args.users,
               admin_key=args.admin_key, cache_salt=args.cache_salt, tenant_secret=args.tenant_secret).start()
    in_foreground(px, f"kvlab proxy: {px.url} -> {px.upstream}"
                  f"{' · tokenizer ' + str(args.model) if args.model else ' · no tokenizer (positions in messages)'}"
                  f"{' · recording ' + str(args.record) if args.record else ''}"
                  f"{' (no hash ids without --model)' if args.record and not args.model else ''}"
                  f" · requests at {px.url}/kvlab/requests · metrics at {px.url}/metrics"
                  f"{' · ' + repr(px.users) if px.users.active else ''}"
                  " · Ctrl-C to stop", px.wait_stopped)
    print(f"kvlab proxy: stopped after {len(px.requests)} requests", file=sys.stderr, flush=True)
    return 0
