"""The shell's current model and engine, and how commands reach the notebook's namespace."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from IPython.core.error import UsageError

from ..primitives.display import summary_html

DEFAULT_MAX_TOKENS = 16


@dataclass(eq=False)
class State:
    """One model and one Engine per shell (``%kvlab load`` replaces both), and the options the
    engine was made with; commands evaluate their EXPR arguments in ``shell``'s namespace.

    Example:
        >>> kv.magics.state().engine
        Engine(tiny, store=radix, keying=prompt: 0 requests, ...)
    """

    shell: Any = None
    model: Any = None
    engine: Any = None
    store_name: str = "radix"
    options: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"State(model={self.model!r}, engine={self.engine!r})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)

    def evaluate(self, expr: str, local_ns=None):
        """``expr`` evaluated in the notebook's namespace (a name, or a quoted expression)."""
        ns = dict(self.shell.user_ns) if self.shell is not None else {}
        if local_ns:
            ns.update(local_ns)
        try:
            return eval(expr, ns)  # noqa: S307 - evaluating the user's own notebook expression
        except Exception as e:
            raise UsageError(f"cannot evaluate {expr!r} in the notebook namespace: "
                             f"{type(e).__name__}: {e}. Pass a variable name or a quoted Python "
                             "expression") from None

    def need_model(self):
        if self.model is None:
            raise UsageError("no model loaded: run `%kvlab load tiny` (or `%kvlab load` for the "
                             "embedded SmolLM2) first")
        return self.model

    def need_engine(self):
        self.need_model()
        return self.engine

    def make_engine(self, args):
        """A fresh Engine on the current model: ``args``' store options over the remembered ones."""
        from ..engine import Engine
        from ..errors import KvlabError
        from ..stores import make_store

        model = self.need_model()
        opts = dict(self.options)
        for k in ("keying", "budget_mb"):
            if getattr(args, k, None) is not None:
                opts[k] = getattr(args, k)
        if getattr(args, "verify", False):
            opts["verify"] = True
        store_name = getattr(args, "store", None) or self.store_name
        budget = opts.get("budget_mb")
        try:
            store = make_store(store_name, budget_bytes=None if budget is None else int(budget * 2**20))
        except KvlabError as e:
            raise UsageError(f"store {store_name!r}: {e}") from None
        engine = Engine(model, store, keying=opts.get("keying") or "prompt",
                        verify=bool(opts.get("verify")),
                        max_tokens=opts.get("max_tokens") or DEFAULT_MAX_TOKENS)
        self.engine, self.store_name, self.options = engine, store_name, opts
        return engine

    def max_tokens(self, args) -> int:
        """Tokens to generate: ``--max-tokens``, else the one given to ``load``, else the default."""
        return args.max_tokens or self.options.get("max_tokens") or DEFAULT_MAX_TOKENS

    def tokens_of(self, value):
        """Tokens of messages, text, ids (or a Request's) on the current model."""
        from ..primitives.tokens import Tokens, as_tokens

        value = messages_of(value)
        if isinstance(value, Tokens):
            return value
        if not isinstance(value, (str, list, tuple)):
            raise UsageError(f"expected messages (a list of {{'role', 'content'}} dicts), text, token "
                             f"ids or Tokens, got {type(value).__name__}")
        return as_tokens(value, self.need_model(), name="EXPR")


def messages_of(value):
    """Messages, text, ids or Tokens from whatever an EXPR gave (a Request unwraps)."""
    from ..request import Request

    if isinstance(value, Request):
        return list(value.messages) if value.messages is not None else list(value.ids)
    return value


def state(shell=None) -> State:
    """The current model/engine of ``shell`` (default: the running IPython).

    Example:
        >>> kv.magics.state().model
        Model('tiny', qwen3, ...)
    """
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    magics = shell.magics_manager.registry.get("KvlabMagics") if shell is not None else None
    if magics is None:
        raise UsageError("the kvlab magics are not loaded: run %load_ext kvlab")
    return magics.state
