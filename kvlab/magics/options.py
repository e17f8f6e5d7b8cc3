"""The %kvlab options, each declared once: a command adds the ones it takes to its subparser, and
the ``%kvlab?`` help lists them all. Every argparse error is a UsageError in kvlab's words."""

from __future__ import annotations

import argparse

from IPython.core.error import UsageError
from IPython.core.magic_arguments import ArgDecorator

_COUNTS = ("no", "one", "two", "three")


class CommandParser(argparse.ArgumentParser):
    """One %kvlab command: ``operands`` names its positional arguments ("EXPR_A EXPR_B"; "[MODEL]"
    is optional); each lands on ``args`` under its lower-case name.

    Example:
        >>> p = CommandParser(prog="%kvlab diff", operands="EXPR_A EXPR_B")
        >>> p.parse_command(["a", "b"]).expr_b
        'b'
    """

    def __init__(self, *args, operands: str = "", **kwargs):
        kwargs.setdefault("add_help", False)
        super().__init__(*args, **kwargs)
        self.operands = tuple(operands.split())
        self.option_names: list[str] = []
        self.add_argument("operands", nargs="*", help=argparse.SUPPRESS)

    def add_argument(self, *names, **kwargs):
        action = super().add_argument(*names, **kwargs)
        self.option_names.extend(action.option_strings[:1])
        return action

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}")

    def parse_command(self, argv: list[str]) -> argparse.Namespace:
        """Options and operands in any order; unknown options and wrong counts say what fits."""
        args, extra = self.parse_known_intermixed_args(argv)
        if extra:
            ok = ", ".join(sorted(self.option_names)) or "none"
            raise UsageError(f"{self.prog} does not take {', '.join(extra)} (its options: {ok}); "
                             "see %kvlab?")
        got, names = args.operands, [n.strip("[]") for n in self.operands]
        hi, lo = len(names), sum(1 for n in self.operands if not n.startswith("["))
        if not lo <= len(got) <= hi:
            want = (f"at most {_COUNTS[hi]} argument" if lo < hi else
                    f"{_COUNTS[hi]} argument{'s' if hi != 1 else ''}")
            what = f" ({' '.join(names)})" if names else ""
            given = f"{len(got)}: {' '.join(got)}" if got else "none"
            raise UsageError(f"{self.prog} takes {want}{what}, got {given}. "
                             "Quote an expression that contains spaces.")
        for i, name in enumerate(names):
            setattr(args, name.lower(), got[i] if i < len(got) else None)
        del args.operands
        return args


class Positive(argparse.Action):
    """Store a number > 0, else a UsageError naming the option (``--turns must be a positive ...``)."""

    def __call__(self, parser, namespace, value, option_string=None):
        if value <= 0:
            what = "a positive integer" if self.type is int else "positive"
            raise UsageError(f"{self.option_strings[0]} must be {what}, got {value}")
        setattr(namespace, self.dest, value)


def engine_options(p) -> None:
    from ..stores import STORE_NAMES

    p.add_argument("--store", choices=STORE_NAMES, default=None,
                   help="load/run: the store (radix, paged, system, mlx-lru, none); run: a fresh engine")
    p.add_argument("--keying", choices=("prompt", "prompt+output"), default=None,
                   help="load/run: cache key of an insert (prompt only, or prompt + generated output)")
    p.add_argument("--budget-mb", type=float, action=Positive, default=None,
                   help="load/run: the store's memory budget in MiB")
    p.add_argument("--verify", action="store_true", help="load/run: compare cached logits with a cold prefill")


def dtype_option(p) -> None:
    p.add_argument("--dtype", default=None, help="load: float32, bfloat16 or float16")


def max_tokens_option(p) -> None:
    from .state import DEFAULT_MAX_TOKENS

    p.add_argument("--max-tokens", type=int, action=Positive, default=None,
                   help=f"run/chat: tokens to generate per request (default {DEFAULT_MAX_TOKENS})")


def size_options(p) -> None:
    p.add_argument("--turns", type=int, action=Positive, default=None,
                   help="run: turns (multi_turn, agentic_loop)")
    p.add_argument("--users", type=int, action=Positive, default=None, help="run: users (shared_system_prompt)")
    p.add_argument("--prompts", type=int, action=Positive, default=None,
                   help="run: prompts (prefix_repetition, multimodal_mix)")
    p.add_argument("--system-tokens", type=int, action=Positive, default=None,
                   help="run: approximate system prompt tokens")
    p.add_argument("--seed", type=int, default=None, help="run: the workload's seed")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="run: any other workload parameter (VALUE read as YAML); repeatable")


def normalise_option(p) -> None:
    p.add_argument("--normalise", action="store_true",
                   help="run/diff: strip volatile fields (kv.normalise, e.g. the billing header) first")


def at_option(p) -> None:
    p.add_argument("--at", default=None, help="split: 'system' (default) or a message index")


def last_option(p) -> None:
    p.add_argument("--last", action="store_true", help="chat: run only the whole conversation, not each turn")


# every option, in the order %kvlab? lists them
OPTIONS = (engine_options, dtype_option, max_tokens_option, size_options, normalise_option, at_option,
           last_option)


class every_option(ArgDecorator):
    """A magic_arguments decorator adding every %kvlab option, so ``%kvlab?`` documents them."""

    def add_to_parser(self, parser, group):
        for add in OPTIONS:
            add(parser)
