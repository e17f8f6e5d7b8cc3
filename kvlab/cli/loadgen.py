"""`kvlab loadgen`: drive an OpenAI-compatible server with concurrent sessions and print vLLM-style
latency percentiles; `kvlab peer`: run a peer server (vllm-mlx, plain mlx_lm.server, mlx-vlm's
server with its APC) on loopback until Ctrl-C.

Example:
    $ kvlab peer vllm-mlx --mode paged --model tiny --port 8100 &
    $ kvlab loadgen http://127.0.0.1:8100 --workload shared_system_prompt --concurrency 4 \\
          --num-requests 16 --out runs/paged.parquet
    $ kvlab peer mlx-vlm --model tiny-vlm --apc checkpoint_interval_tokens=256 --port 8101 &
    $ kvlab load http://127.0.0.1:8101 --workload multimodal --traffic mixed --concurrency 1 \
          --num-requests 8
"""

from __future__ import annotations

import signal
import sys
import time

from ..errors import KvlabError
from .output import print_result

_WORKLOADS = ("multi_turn, agentic_loop, shared_system_prompt, prefix_repetition, fixed (exact input and "
              "output lengths for cross-tool runs), multimodal (text and image requests), or a trace .jsonl")
_WORKLOAD_FLAGS = ("turns", "input_len", "output_len", "system_tokens", "prefix_len", "suffix_len",
                   "num_prefixes", "time_scale", "block_tokens", "traffic", "distinct_images",
                   "image_size")


def register(sub) -> None:
    s = sub.add_parser("loadgen", aliases=["load"],
                       help="generate load on an OpenAI-compatible server (TTFT/TPOT/ITL/E2EL)")
    s.add_argument("url", help="the server, e.g. http://127.0.0.1:8080")
    s.add_argument("--workload", default="multi_turn", help=_WORKLOADS)
    arrive = s.add_mutually_exclusive_group()
    arrive.add_argument("--concurrency", type=int, default=None, help="sessions in flight")
    arrive.add_argument("--rate", type=float, default=None, help="Poisson session arrivals a second")
    cap = s.add_mutually_exclusive_group()
    cap.add_argument("--num-requests", type=int, default=None, help="stop after this many requests")
    cap.add_argument("--duration", type=float, default=None, help="send nothing after this many seconds")
    s.add_argument("--users", type=int, default=None, help="sessions to make (default: from the cap)")
    s.add_argument("--time-scale", type=float, default=None,
                   help="trace replay: multiply timestamps (default 1)")
    s.add_argument("--block-tokens", type=int, default=None,
                   help="trace replay: tokens per hash block (default the trace's 512; shrink for small models)")
    s.add_argument("--tokenizer", default=None,
                   help="the served model (a kvlab name or folder): needed for token-id workloads and traces")
    s.add_argument("--model", default=None, help="model name sent in requests (default: /v1/models)")
    s.add_argument("--api-key", default=None, help="bearer key (default $KVLAB_API_KEY / $OPENAI_API_KEY)")
    s.add_argument("--timeout", type=float, default=120.0, help="per-request timeout in seconds")
    # workload flags: each applies to the workloads kvlab.serving.workload_params lists, else refused
    s.add_argument("--turns", type=int, default=None, help="multi_turn / agentic_loop: turns a session")
    s.add_argument("--input-len", type=int, default=None,
                   help="fixed: prompt tokens, exact as the chat template renders them (needs --tokenizer)")
    s.add_argument("--output-len", "--max-tokens", dest="output_len", type=int, default=None,
                   help="every workload but traces: max_tokens of each request (default 128; agentic_loop 256)")
    s.add_argument("--system-tokens", type=int, default=None,
                   help="fixed: shared system prompt tokens, exact (default 0: none); chat workloads: about")
    s.add_argument("--prefix-len", type=int, default=None, help="prefix_repetition: prefix ids (default 256)")
    s.add_argument("--suffix-len", type=int, default=None, help="prefix_repetition: suffix ids (default 256)")
    s.add_argument("--num-prefixes", type=int, default=None, help="prefix_repetition: prefixes (default 1)")
    s.add_argument("--traffic", default=None, choices=("text", "mixed", "images"),
                   help="multimodal: text-only, mixed (every 2nd request an image; default) or image-only")
    s.add_argument("--distinct-images", type=int, default=None,
                   help="multimodal: images the image requests cycle through (default 2)")
    s.add_argument("--image-size", type=int, default=None, help="multimodal: image side in pixels (default 56)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--record-tokens", action="store_true",
                   help="non-streamed requests with logprobs: output ids and top-2 gaps, no TTFT")
    s.add_argument("--out", default=None, help="write the per-request frame as parquet")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.add_argument("--compare-aiperf", default=None, metavar="PATH",
                   help="AIPerf's profile_export_aiperf.json/.csv (or its folder) of the same run: "
                        "print both tools' figures side by side")
    s.set_defaults(func=load)

    p = sub.add_parser("peer", help="run a peer server (vllm-mlx, plain mlx_lm.server, mlx-vlm) until Ctrl-C; "
                                    "kvpress: --install only")
    p.add_argument("server", choices=("vllm-mlx", "mlx-lm", "mlx-vlm", "kvpress"))
    p.add_argument("--mode", default="batched", choices=("simple", "batched", "paged"),
                   help="vllm-mlx mode")
    p.add_argument("--model", default=None,
                   help="a kvlab model name or an mlx-lm folder (default smollm2); mlx-vlm: tiny-vlm[:<type>] "
                        "or an mlx-vlm folder (default tiny-vlm)")
    p.add_argument("--port", type=int, default=None, help="default: a free port")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="serve with the prefix cache off (mlx-vlm: APC disabled)")
    p.add_argument("--apc", action="append", default=[], metavar="NAME=VALUE",
                   help="mlx-vlm: an APC setting (e.g. checkpoint_interval_tokens=256, block_size=16); repeatable")
    p.add_argument("--apc-disk", action="store_true", help="mlx-vlm: keep APC's SSD tier (off by default)")
    p.add_argument("--install", action="store_true",
                   help="only create the peer's venv, then exit: vllm-mlx (.venv-peers) or kvpress "
                        "(.venv-kvpress, CPU torch)")
    p.set_defaults(func=peer)


def load(args) -> int:
    """Run the load test; print the summary (aligned, or JSON) and where the frame went."""
    _check_aiperf(args)  # a bad export fails before the run, not after it
    from ..serving.loadgen import generate_load
    from ..serving.workload_params import workload_kwargs

    params = {name: getattr(args, name) for name in _WORKLOAD_FLAGS}
    workload_kwargs(args.workload, params, spell=lambda n: "--" + n.replace("_", "-"))  # flag names in errors
    r = generate_load(args.url, args.workload, concurrency=args.concurrency, rate=args.rate,
                  num_requests=args.num_requests, duration=args.duration, users=args.users,
                  tokenizer=args.tokenizer,
                  model=args.model, api_key=args.api_key, timeout=args.timeout, seed=args.seed,
                  record_tokens=args.record_tokens, progress=not args.no_progress, out=args.out,
                  **params)
    out = dict(r.summary)
    if args.out:
        out["frame"] = args.out
    if args.json:
        out["server_delta"] = r.server_delta()
        out.update(_explained(args, r))
        print_result(out, True)
        return 0
    print_result({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in out.items()}, False)
    _print_explained(_explained(args, r))
    failed = r.frame.filter(~r.frame["ok"])
    if failed.height:
        print(f"kvlab loadgen: {failed.height} request(s) failed; first: {failed['error'][0]}", file=sys.stderr)
    return 0 if not failed.height else 1


def _check_aiperf(args) -> None:
    if getattr(args, "compare_aiperf", None):
        from ..serving.aiperf import read_aiperf

        read_aiperf(args.compare_aiperf)


def _explained(args, r) -> dict:
    """What each printed figure means and, with --compare-aiperf, both tools' figures."""
    from ..serving.metrics import legend

    out = {"definitions": legend(r.summary)}
    if getattr(args, "compare_aiperf", None):
        from ..serving.aiperf import compare

        out["aiperf_comparison"] = compare(r, args.compare_aiperf).to_dicts()
    return out


def _print_explained(extra: dict) -> None:
    print("definitions:\n" + "\n".join(f"  {line}" for line in extra["definitions"]))
    rows = extra.get("aiperf_comparison")
    if rows:
        print("kvlab vs AIPerf (same definitions; kvlab's units; diff = aiperf - kvlab):")
        print(f"  {'figure':<19} {'stat':<5} {'kvlab':>10} {'aiperf':>10} {'diff':>9}  aiperf metric")
        for x in rows:
            cells = [f"{x[k]:.4g}" if x[k] is not None else "-" for k in ("kvlab", "aiperf", "diff")]
            print(f"  {x['figure']:<19} {x['stat']:<5} {cells[0]:>10} {cells[1]:>10} {cells[2]:>9}  "
                  f"{x['aiperf_metric']} ({x['unit']})")


def peer(args) -> int:
    """Start the peer server, print its URL, and stop it (by process id) on Ctrl-C or SIGTERM."""
    from ..serving import peers

    if args.server == "kvpress":
        if not args.install:
            raise KvlabError("kvpress is not a server: `kvlab peer kvpress --install` makes its venv; "
                             "its presses run from Python (kvlab.presses.kvpress_peer)")
        from ..presses import kvpress_peer

        print(f"kvlab: {kvpress_peer.KVPRESS} ready in {kvpress_peer.ensure_kvpress_venv(quiet=False)}")
        return 0
    if args.install:
        if args.server != "vllm-mlx":
            raise KvlabError("--install applies to vllm-mlx and kvpress (mlx_lm.server and mlx-vlm run "
                             "from kvlab's own env)")
        print(f"kvlab: vllm-mlx ready in {peers.ensure_peers_venv(quiet=False)}")
        return 0
    if args.apc and args.server != "mlx-vlm":
        raise KvlabError("--apc applies to mlx-vlm only (its Automatic Prefix Caching settings)")

    def _term(signum, frame):
        raise KeyboardInterrupt

    # SIGTERM while the server is still starting must stop it too: handled from here on
    previous = signal.signal(signal.SIGTERM, _term)
    try:
        server = _start(args)
        print(f"kvlab: {server!r}\nkvlab: serving at {server.url} (Ctrl-C stops it)", flush=True)
        while server.running:
            time.sleep(0.5)
        print(f"kvlab: the server exited; its log ends:\n{server.log(tail=20)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for server in peers.live():  # this command's one server, started or half-started
            server.stop()
        signal.signal(signal.SIGTERM, previous)


def _start(args):
    from ..serving import peers

    if args.server == "mlx-vlm":
        from ..serving.peers_vlm import start_mlx_vlm

        server = start_mlx_vlm(args.model or "tiny-vlm", not args.no_prefix_cache, port=args.port,
                               disk=args.apc_disk, **_apc_settings(args.apc))
        print(f"kvlab: APC settings {server.settings.get('reported', {})}", flush=True)
        return server
    if args.server == "vllm-mlx":
        return peers.start_vllm_mlx(args.model or "smollm2", args.mode, port=args.port,
                                    prefix_cache=not args.no_prefix_cache)
    return peers.start_mlx_lm(args.model or "smollm2", port=args.port,
                              prompt_cache_size=0 if args.no_prefix_cache else 10)


def _apc_settings(pairs) -> dict:
    """``--apc NAME=VALUE`` flags as keywords (numbers as numbers)."""
    out = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name:
            raise KvlabError(f"--apc {pair!r}: write NAME=VALUE, e.g. --apc checkpoint_interval_tokens=256")
        try:
            out[name] = int(value)
        except ValueError:
            try:
                out[name] = float(value)
            except ValueError:
                out[name] = value
    return out
