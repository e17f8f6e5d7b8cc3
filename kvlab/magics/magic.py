"""The one ``@magics_class``: ``%kvlab COMMAND ...`` and ``%%kvlab chat``.

Each command is an argparse subparser (registered by the ``*_commands`` modules); the
``@magic_arguments`` declaration lists every option so that ``%kvlab?`` is the help.
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class, needs_local_scope
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split

from . import engine_commands, prompt_commands, store_commands
from .options import CommandParser, every_option
from .state import State

# the command groups; a new group is a module with register(subparsers), added here
GROUPS = (engine_commands, prompt_commands, store_commands)


def build_parser() -> tuple[CommandParser, dict[str, CommandParser]]:
    """The %kvlab parser and its subparsers by command name; each sets ``handler``.

    Example:
        >>> parser, commands = build_parser()
        >>> commands["diff"].parse_command(["a", "b", "--normalise"]).normalise
        True
    """
    top = CommandParser(prog="%kvlab")
    sub = top.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=CommandParser)
    for group in GROUPS:
        group.register(sub)
    return top, dict(sub.choices)


PARSER, COMMANDS = build_parser()


def parse_line(argv: list[str]):
    """``%kvlab`` arguments -> a namespace with ``command``, ``handler`` and the command's options."""
    if not argv:
        raise UsageError(f"%kvlab needs a command: {', '.join(COMMANDS)} (see %kvlab?)")
    if argv[0].startswith("-"):
        raise UsageError(f"%kvlab: the command comes first, then its options: %kvlab COMMAND [ARG ...] "
                         f"[--option ...] (got {argv[0]!r} first; commands: {', '.join(COMMANDS)})")
    if argv[0] not in COMMANDS:
        PARSER.parse_args(argv)  # argparse's own message: invalid choice, or a missing command
        raise UsageError(f"%kvlab: {argv[0]!r} is not a command; use one of {', '.join(COMMANDS)}")
    args = COMMANDS[argv[0]].parse_command(argv[1:])
    args.command = argv[0]
    return args


@magics_class
class KvlabMagics(Magics):
    """%kvlab / %%kvlab: look inside prefix caches from a notebook."""

    def __init__(self, shell=None):
        super().__init__(shell)
        self.state = State(shell)

    @needs_local_scope
    @line_cell_magic
    @magic_arguments()
    @argument("command", choices=tuple(COMMANDS), metavar="COMMAND", help="one of: " + ", ".join(COMMANDS))
    @argument("args", nargs="*", metavar="ARG",
              help="load: a model name or folder; tokens/split: EXPR; diff: EXPR_A EXPR_B; "
                   "run: a workload name or EXPR")
    @every_option()
    def kvlab(self, line="", cell=None, local_ns=None):
        """Prefix-cache experiments on the current model and engine.

        Commands:
          %kvlab load [MODEL] [--store radix|paged|system|mlx-lru|none] [--keying prompt|prompt+output]
                 MODEL: smollm2 (default), tiny, tiny-hybrid, a local mlx-lm folder, or the name
                 of a notebook variable holding a model from kv.load
          %kvlab tokens EXPR               the chat-template tokens of messages / text / ids
          %kvlab split EXPR [--at system|N] where a cached prefix may end, and whether it is clean
          %kvlab diff EXPR_A EXPR_B [--normalise]  the first token where two prompts differ
          %kvlab run WORKLOAD [--store S] [--turns N] [--users N] [--prompts N] [--seed N]
                 [--set NAME=VALUE ...] [--max-tokens N] [--normalise]
                 WORKLOAD: multi_turn, agentic_loop, shared_system_prompt, prefix_repetition,
                 multimodal_mix, or an EXPR giving a Workload or list of requests
          %kvlab tree                      the store's prefix tree
          %kvlab stats                     hit rates (per token and per request) and events
          %kvlab inspect                   kv.Inspector on the engine
          %%kvlab chat [--max-tokens N] [--last]
                 cell body: 'system: ...' / 'user: ...' / 'assistant: ...' lines; continuation
                 lines belong to the previous message; each user turn is one request

        EXPR is evaluated in the notebook's namespace: a name (``msgs``) or a quoted expression
        (``"[{'role': 'user', 'content': 'Hi'}]"``).
        """
        args = parse_line(arg_split(line, posix=True))
        if cell is not None and args.command != "chat":
            raise UsageError(f"%%kvlab is a cell magic only for 'chat' (got {args.command!r}); "
                             f"use the line magic %kvlab {args.command}")
        if args.command == "chat" and cell is None:
            raise UsageError("chat takes a conversation as a cell body: start the cell with %%kvlab chat")
        return args.handler(self.state, args, cell, local_ns)


def load_ipython_extension(ipython) -> None:
    """``%load_ext kvlab``."""
    ipython.register_magics(KvlabMagics(ipython))
