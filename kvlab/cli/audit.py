"""`kvlab audit`: Gu et al.'s prompt-cache audit against a server (or a kvlab proxy in front of
one): is its cache shared, at which level, and does its metadata tell (kvlab.audit).

Example:
    $ kvlab audit http://127.0.0.1:8080 --victim-key ka --attacker-key kb --profile fast --json
"""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    from ..audit import LEVELS, PROFILES

    s = sub.add_parser("audit", help="is a server's prompt cache shared across keys or tenants? (timing + metadata)")
    s.add_argument("url", help="the server's base URL (any OpenAI-compatible server, or a kvlab proxy)")
    s.add_argument("--victim-key", default=None, help="the victim's API key")
    s.add_argument("--attacker-key", default=None,
                   help="the attacker's API key (for the same-tenant and cross-tenant levels)")
    s.add_argument("--level", action="append", choices=list(LEVELS), default=None,
                   help="what the attacker's key is to the victim's (may repeat; default: same-key, "
                   "and cross-tenant when the keys differ)")
    s.add_argument("--profile", default="fast", choices=list(PROFILES),
                   help="fast (2000 letters, 30+30 samples: detects D+ >= 0.73) or faithful (the paper's: "
                   "5000 letters, 250+250, fractions 1 and 0.95, victim x1/x5/x25)")
    s.add_argument("--model", default=None, help="the model name to request (default: the server's first)")
    s.add_argument("--seed", type=int, default=None,
                   help="seed of the random prompts and the sample order (default: a new one each run, "
                   "printed with the report; a rerun with an old seed finds its misses cached)")
    s.add_argument("--json", action="store_true", help="the report as one JSON object")
    s.set_defaults(func=run)


def run(args) -> int:
    from ..audit import audit

    def say(msg):
        print(f"kvlab audit: {msg}", file=sys.stderr, flush=True)

    report = audit(args.url, args.victim_key, args.attacker_key, levels=args.level, profile=args.profile,
                   seed=args.seed, model=args.model, progress=None if args.json else say)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return 0
    print(f"{report.target} · profile {report.profile!r} · seed {report.seed}")
    for lv in report.levels:
        row = lv.to_json()
        print(f"  {lv.level:>12}: {lv.verdict:<12} D+ {row['ks_d']:.2f}  p {row['p']:.2g}"
              f"  hit {row['hit_median_s'] * 1e3:.1f} ms  miss {row['miss_median_s'] * 1e3:.1f} ms"
              f"  ({lv.measure}, {lv.fraction:.0%} shared, victim x{lv.repeats}, "
              f"{row['samples']} samples)  metadata {'leaks' if lv.metadata_leak else 'silent'}"
              f"{': ' + ', '.join(lv.metadata) if lv.metadata else ''}")
    print(f"  smallest shared length the timing test could detect: {report.smallest_detectable_tokens} tokens")
    return 0
