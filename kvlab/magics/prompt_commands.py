"""``%kvlab tokens``, ``split`` and ``diff``: look at prompts on the current model's template."""

from __future__ import annotations

from IPython.core.error import UsageError

from .options import at_option, normalise_option
from .state import messages_of


def register(sub) -> None:
    p = sub.add_parser("tokens", operands="EXPR", help="the chat-template tokens of messages / text / ids")
    p.set_defaults(handler=tokens)
    p = sub.add_parser("split", operands="EXPR", help="where a cached prefix may end, and whether it is clean")
    at_option(p)
    p.set_defaults(handler=split)
    p = sub.add_parser("diff", operands="EXPR_A EXPR_B", help="the first token where two prompts differ")
    normalise_option(p)
    p.set_defaults(handler=diff)


def tokens(state, args, cell, local_ns):
    state.need_model()
    return state.tokens_of(state.evaluate(args.expr, local_ns))


def split(state, args, cell, local_ns):
    from ..primitives.boundary import split_at_boundary

    state.need_model()
    toks = state.tokens_of(state.evaluate(args.expr, local_ns))
    at = "system" if args.at is None else args.at
    if at != "system":
        try:
            at = int(at)
        except ValueError:
            raise UsageError(f"--at must be 'system' or a message index, got {args.at!r}") from None
    return split_at_boundary(toks, at=at)


def diff(state, args, cell, local_ns):
    from ..primitives.divergence import diverge
    from ..primitives.normalisation import normalise

    state.need_model()
    a, b = (messages_of(state.evaluate(x, local_ns)) for x in (args.expr_a, args.expr_b))
    if args.normalise:
        a, b = (normalise(x) if isinstance(x, (list, tuple)) and x and isinstance(x[0], dict) else x
                for x in (a, b))
    return diverge(state.tokens_of(a), state.tokens_of(b))
