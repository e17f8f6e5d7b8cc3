"""IPython magics: ``%load_ext kvlab``, then ``%kvlab COMMAND ...`` and ``%%kvlab chat``.

The magics keep one current model and one Engine in the shell (``%kvlab load`` replaces both).
Every output has a text/plain and a text/html representation. ``%kvlab?`` shows the help.

Example:
    %load_ext kvlab
    %kvlab load tiny --store radix
    %kvlab tokens msgs
    %kvlab run multi_turn --turns 3
    %kvlab stats
"""

from .magic import COMMANDS, KvlabMagics, build_parser, load_ipython_extension
from .state import DEFAULT_MAX_TOKENS, State, state
from .text import parse_chat, tree_lines
from .views import ChatView, Loaded, RunView, StatsView, TreeView

__all__ = ["COMMANDS", "DEFAULT_MAX_TOKENS", "ChatView", "KvlabMagics", "Loaded", "RunView", "State",
           "StatsView", "TreeView", "build_parser", "load_ipython_extension", "parse_chat", "state",
           "tree_lines"]
