"""`kvlab press`: one KV-cache press at one ratio on one model: bytes kept, teacher-forced quality,
task accuracy beside the uncompressed baseline's, compression and decode times
(``kvlab.presses.battery``; ``--json`` prints exactly its keys)."""

from __future__ import annotations


def register(sub) -> None:
    from ..presses.battery import TASKS

    s = sub.add_parser("press", help="measure a KV-cache press: memory, quality, accuracy and speed")
    s.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, tiny:<model_type> or an mlx-lm folder")
    s.add_argument("--press", required=True, help="a press name (kvlab.presses.names(): knorm, snapkv, ...)")
    s.add_argument("--ratio", type=float, required=True, help="fraction of the cache removed, in [0, 1)")
    s.add_argument("--task", default="all", choices=TASKS,
                   help="kl: teacher-forced divergence only; needle / vt: task accuracy only; all (default)")
    s.add_argument("--tokens", type=int, default=1024, help="context length in tokens (default 1024)")
    s.add_argument("--n", type=int, default=6, help="tasks of each kind (default 6)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens timed for decode tokens/s")
    s.add_argument("--json", action="store_true", help="one JSON object with the battery's keys")
    s.set_defaults(func=press)


def press(args) -> int:
    from ..models.loading import load
    from ..presses import press as make
    from ..presses.battery import run
    from .output import print_result

    p = make(args.press, args.ratio)
    record = run(load(args.model), p, task=args.task, tokens=args.tokens, n=args.n, seed=args.seed,
                 decode=args.decode_tokens)
    print_result(record, args.json)
    return 0
