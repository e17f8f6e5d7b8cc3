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

from __future__ import annotations

import html
import inspect
import re
from dataclasses import dataclass, field
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class, needs_local_scope
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split

COMMANDS = ("load", "tokens", "split", "diff", "run", "tree", "stats", "chat", "inspect")
STORES = {"radix": "RadixStore", "paged": "PagedStore", "system": "SystemPromptStore",
          "mlx-lru": "MlxLmLRUStore", "none": None}
# workload size options -> the generator parameter each one sets
SIZE_OPTIONS = {"turns": ("turns",), "users": ("num_users",), "prompts": ("num_prompts", "num_requests"),
                "seed": ("seed",), "system_tokens": ("system_tokens",)}
ROLE_LINE = re.compile(r"^(system|user|assistant|tool|developer)\s*:[ \t]?(.*)$", re.IGNORECASE)
DEFAULT_MAX_TOKENS = 16


@dataclass
class State:
    """The shell's current model and engine (one each)."""

    model: Any = None
    engine: Any = None
    store_name: str = "radix"
    options: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------ output views

class _View:
    """Base of the magic outputs: one-line repr, multi-line text for papermill, HTML for Jupyter."""

    def text(self) -> str:
        raise NotImplementedError

    def short(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.short()

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(self.text())


@dataclass(eq=False, repr=False)
class Loaded(_View):
    """What ``%kvlab load`` made: ``.model`` and ``.engine``."""

    model: Any
    engine: Any

    def short(self) -> str:
        return f"Loaded({self.model!r})"

    def text(self) -> str:
        return f"kvlab: loaded {self.model!r}\nkvlab: engine {self.engine!r}"

    def _repr_html_(self) -> str:
        return (f"<div><b>kvlab</b> loaded{self.model._repr_html_()}"
                f"<div>engine: <code>{html.escape(repr(self.engine))}</code></div></div>")


def _table_text(frame, rows: int = 40) -> str:
    import polars as pl

    with pl.Config(tbl_rows=rows, tbl_cols=16, fmt_str_lengths=40, tbl_hide_dataframe_shape=True,
                   tbl_width_chars=200,
                   tbl_formatting="ASCII_MARKDOWN", tbl_hide_column_data_types=True):
        return str(frame)


def _stats_line(stats: dict) -> str:
    return (f"{stats['requests']} requests · token hit rate {stats['token_hit_rate']:.1%} "
            f"({stats['reused_tokens']}/{stats['prompt_tokens']} tokens) · request hit rate "
            f"{stats['request_hit_rate']:.1%} · {stats['entries']} entries, {stats['bytes'] / 2**20:.2f} MiB")


@dataclass(eq=False, repr=False)
class RunView(_View):
    """``%kvlab run``: one row per request (``.frame``) and the engine's stats afterwards."""

    workload: str
    frame: Any
    stats: dict
    engine: Any

    def short(self) -> str:
        return f"RunView({self.workload}: {self.frame.height} requests)"

    def text(self) -> str:
        return (f"kvlab run {self.workload} on {self.engine!r}\n{_table_text(self.frame)}\n"
                f"{_stats_line(self.stats)}")

    def _repr_html_(self) -> str:
        bars = "".join(
            f"<tr><td>{html.escape(str(r['name']))}</td><td>{r['reused_tokens']}/{r['prompt_tokens']}</td>"
            f"<td><div style='width:200px;height:8px;background:#eee'><div style='width:"
            f"{int(200 * r['reuse_ratio'])}px;height:8px;background:#2a7'></div></div></td>"
            f"<td>{html.escape(r['match'])}</td><td>{r['ttft_ms']:.1f} ms</td></tr>"
            for r in self.frame.iter_rows(named=True))
        return (f"<div><b>kvlab run</b> {html.escape(self.workload)} · "
                f"<code>{html.escape(repr(self.engine))}</code><table><tr><th>request</th>"
                f"<th>reused</th><th></th><th>match</th><th>TTFT</th></tr>{bars}</table>"
                f"<div>{html.escape(_stats_line(self.stats))}</div></div>")


@dataclass(eq=False, repr=False)
class StatsView(_View):
    """``%kvlab stats``: both hit-rate definitions, named, and the event counts."""

    stats: dict
    events: Any
    engine: Any

    def short(self) -> str:
        return f"StatsView({self.stats['requests']} requests)"

    def _counts(self):
        import polars as pl

        if self.events.height == 0:
            return pl.DataFrame({"event": [], "count": [], "tokens": []})
        return (self.events.group_by("event").agg(pl.len().alias("count"), pl.col("tokens").sum())
                .sort("event"))

    def text(self) -> str:
        lines = [f"kvlab stats: {self.engine!r}"]
        lines += [f"{k:>18}: {v:.4f}" if isinstance(v, float) else f"{k:>18}: {v}"
                  for k, v in self.stats.items()]
        lines.append("events:")
        lines.append(_table_text(self._counts()))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{v:.4f}</td></tr>"
                       if isinstance(v, float) else f"<tr><th style='text-align:left'>{k}</th><td>{v}</td></tr>"
                       for k, v in self.stats.items())
        return (f"<div><b>kvlab stats</b> <code>{html.escape(repr(self.engine))}</code>"
                f"<table>{rows}</table><b>events</b>{self._counts()._repr_html_()}</div>")


@dataclass(eq=False, repr=False)
class TreeView(_View):
    """``%kvlab tree``: the store's radix tree (or its entries when it has no tree)."""

    store: Any
    lines: list
    frame: Any

    def short(self) -> str:
        return f"TreeView({self.store!r})"

    ROWS = 20

    def _note(self) -> str:
        if self.frame is None:
            return f"({type(self.store).__name__} keeps no tree: {self.store.entries} entries)"
        more = self.frame.height - self.ROWS
        return f"… {more} more rows" if more > 0 else ""

    def text(self) -> str:
        if self.lines:
            body = "\n".join(self.lines)
        elif self.frame is not None:
            body = _table_text(self.frame.head(self.ROWS))
        else:
            body = ""
        return "\n".join(x for x in (repr(self.store), body, self._note()) if x)

    def _repr_html_(self) -> str:
        tree = (f"<pre style='line-height:1.3'>{html.escape(chr(10).join(self.lines))}</pre>"
                if self.lines else "")
        table = (self.frame.head(self.ROWS)._repr_html_()
                 if self.frame is not None and self.frame.height else "")
        return (f"<div><b>{html.escape(repr(self.store))}</b>{tree}{table}"
                f"<div>{html.escape(self._note())}</div></div>")


@dataclass(eq=False, repr=False)
class ChatView(_View):
    """``%%kvlab chat``: one Result per user turn, with what each reused."""

    messages: list
    results: list

    def short(self) -> str:
        return f"ChatView({len(self.messages)} messages, {len(self.results)} requests)"

    @property
    def frame(self):
        import polars as pl

        return pl.DataFrame([{"turn": i + 1, "prompt_tokens": r.prompt_tokens, "reused_tokens": r.reused_tokens,
                              "match": r.match, "ttft_ms": round(r.ttft_s * 1e3, 2),
                              "reply": r.text[:60]} for i, r in enumerate(self.results)])

    def text(self) -> str:
        last = self.results[-1]
        return (f"kvlab chat: {len(self.messages)} messages, {len(self.results)} requests\n"
                f"{_table_text(self.frame)}\nreply: {last.text!r}")

    def _repr_html_(self) -> str:
        return ("<div><b>kvlab chat</b> " + f"{len(self.messages)} messages · {len(self.results)} requests"
                + "".join(r._repr_html_() for r in self.results) + "</div>")


# ------------------------------------------------------------------------------------------ magics

@magics_class
class KvlabMagics(Magics):
    """%kvlab / %%kvlab: look inside prefix caches from a notebook."""

    def __init__(self, shell=None):
        super().__init__(shell)
        self.state = State()

    @needs_local_scope
    @line_cell_magic
    @magic_arguments()
    @argument("command", choices=COMMANDS, metavar="COMMAND",
              help="one of: " + ", ".join(COMMANDS))
    @argument("args", nargs="*", metavar="ARG",
              help="load: a model name or folder; tokens/split: EXPR; diff: EXPR_A EXPR_B; "
                   "run: a workload name or EXPR")
    @argument("--store", choices=tuple(STORES), default=None,
              help="load/run: the store (radix, paged, system, mlx-lm, none); run: a fresh engine")
    @argument("--keying", choices=("prompt", "prompt+output"), default=None,
              help="load/run: cache key of an insert (prompt only, or prompt + generated output)")
    @argument("--budget-mb", type=float, default=None, help="load/run: the store's memory budget in MiB")
    @argument("--verify", action="store_true", help="load/run: compare cached logits with a cold prefill")
    @argument("--dtype", default=None, help="load: float32, bfloat16 or float16")
    @argument("--max-tokens", type=int, default=None,
              help=f"run/chat: tokens to generate per request (default {DEFAULT_MAX_TOKENS})")
    @argument("--turns", type=int, default=None, help="run: turns (multi_turn, agentic_loop)")
    @argument("--users", type=int, default=None, help="run: users (shared_system_prompt)")
    @argument("--prompts", type=int, default=None, help="run: prompts (prefix_repetition, multimodal_mix)")
    @argument("--system-tokens", type=int, default=None, help="run: approximate system prompt tokens")
    @argument("--seed", type=int, default=None, help="run: the workload's seed")
    @argument("--set", action="append", default=[], metavar="NAME=VALUE",
              help="run: any other workload parameter (VALUE read as YAML); repeatable")
    @argument("--normalise", action="store_true",
              help="run/diff: strip volatile fields (kv.normalise, e.g. the billing header) first")
    @argument("--at", default=None, help="split: 'system' (default) or a message index")
    @argument("--last", action="store_true", help="chat: run only the whole conversation, not each turn")
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
          %kvlab tree                      the store's radix tree
          %kvlab stats                     hit rates (per token and per request) and events
          %kvlab inspect                   kv.Inspector on the engine
          %%kvlab chat [--max-tokens N] [--last]
                 cell body: 'system: ...' / 'user: ...' / 'assistant: ...' lines; continuation
                 lines belong to the previous message; each user turn is one request

        EXPR is evaluated in the notebook's namespace: a name (``msgs``) or a quoted expression
        (``"[{'role': 'user', 'content': 'Hi'}]"``).
        """
        argv = arg_split(line, posix=True)
        if not argv:
            raise UsageError(f"%kvlab needs a command: {', '.join(COMMANDS)} (see %kvlab?)")
        args = self.kvlab.parser.parse_intermixed_args(argv)
        if cell is not None and args.command != "chat":
            raise UsageError(f"%%kvlab is a cell magic only for 'chat' (got {args.command!r}); "
                             f"use the line magic %kvlab {args.command}")
        if args.command == "chat" and cell is None:
            raise UsageError("chat takes a conversation as a cell body: start the cell with %%kvlab chat")
        self._check_options(args)
        handler = getattr(self, f"_cmd_{args.command}")
        return handler(args, cell, local_ns)

    # -- argument handling ---------------------------------------------------------------------------
    _ALLOWED = {
        "load": {"store", "keying", "budget_mb", "verify", "dtype", "max_tokens"},
        "tokens": set(), "split": {"at"}, "diff": {"normalise"},
        "run": {"store", "keying", "budget_mb", "verify", "max_tokens", "turns", "users", "prompts",
                "system_tokens", "seed", "set", "normalise"},
        "tree": set(), "stats": set(), "inspect": set(), "chat": {"max_tokens", "last"},
    }
    _NARGS = {"load": (0, 1), "tokens": (1, 1), "split": (1, 1), "diff": (2, 2), "run": (1, 1),
              "tree": (0, 0), "stats": (0, 0), "inspect": (0, 0), "chat": (0, 0)}
    _DEFAULTS = {"store": None, "keying": None, "budget_mb": None, "verify": False, "dtype": None,
                 "max_tokens": None, "turns": None, "users": None, "prompts": None,
                 "system_tokens": None, "seed": None, "set": [], "normalise": False, "at": None,
                 "last": False}

    def _check_options(self, args) -> None:
        cmd = args.command
        given = [k for k, d in self._DEFAULTS.items() if getattr(args, k) != d]
        bad = [k for k in given if k not in self._ALLOWED[cmd]]
        if bad:
            opts = ", ".join("--" + k.replace("_", "-") for k in bad)
            ok = ", ".join("--" + k.replace("_", "-") for k in sorted(self._ALLOWED[cmd])) or "none"
            raise UsageError(f"%kvlab {cmd} does not take {opts} (its options: {ok}); see %kvlab?")
        lo, hi = self._NARGS[cmd]
        n = len(args.args)
        if not lo <= n <= hi:
            want = {(0, 0): "no arguments", (0, 1): "at most one argument", (1, 1): "one argument",
                    (2, 2): "two arguments"}[(lo, hi)]
            what = {"tokens": " (EXPR)", "split": " (EXPR)", "diff": " (EXPR_A EXPR_B)",
                    "run": " (a workload name or EXPR)", "load": " (MODEL)"}.get(cmd, "")
            got = f"{n}: {' '.join(args.args)}" if n else "none"
            raise UsageError(f"%kvlab {cmd} takes {want}{what}, got {got}. "
                             "Quote an expression that contains spaces.")
        for name in ("max_tokens", "turns", "users", "prompts", "system_tokens"):
            v = getattr(args, name)
            if v is not None and v < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
        if args.budget_mb is not None and args.budget_mb <= 0:
            raise UsageError(f"--budget-mb must be positive, got {args.budget_mb}")

    def _eval(self, expr: str, local_ns):
        ns = dict(self.shell.user_ns) if self.shell is not None else {}
        if local_ns:
            ns.update(local_ns)
        try:
            return eval(expr, ns)  # noqa: S307 - evaluating the user's own notebook expression
        except Exception as e:
            raise UsageError(f"cannot evaluate {expr!r} in the notebook namespace: "
                             f"{type(e).__name__}: {e}. Pass a variable name or a quoted Python "
                             "expression") from None

    def _need_model(self):
        if self.state.model is None:
            raise UsageError("no model loaded: run `%kvlab load tiny` (or `%kvlab load` for the "
                             "embedded SmolLM2) first")
        return self.state.model

    def _need_engine(self):
        self._need_model()
        return self.state.engine

    def _make_store(self, name: str, budget_mb):
        import kvlab

        cls_name = STORES[name]
        if cls_name is None:
            return None
        try:
            cls = getattr(kvlab, cls_name)
        except (AttributeError, ImportError) as e:
            raise UsageError(f"store {name!r} ({cls_name}) is not available in this kvlab: {e}") from None
        kwargs = {}
        if budget_mb is not None:
            params = inspect.signature(cls).parameters
            # RadixStore/PagedStore/SystemPromptStore take budget_bytes; mlx-lm's LRU max_bytes
            name_of = next((n for n in ("budget_bytes", "max_bytes") if n in params), None)
            if name_of is None:
                raise UsageError(f"store {name!r} has no memory budget option; drop --budget-mb")
            kwargs[name_of] = int(budget_mb * 2**20)
        return cls(**kwargs)

    def _make_engine(self, args):
        from .engine import Engine

        model = self._need_model()
        opts = dict(self.state.options)
        for k in ("keying", "budget_mb"):
            if getattr(args, k, None) is not None:
                opts[k] = getattr(args, k)
        if getattr(args, "verify", False):
            opts["verify"] = True
        store_name = args.store or self.state.store_name
        store = self._make_store(store_name, opts.get("budget_mb"))
        engine = Engine(model, store, keying=opts.get("keying") or "prompt",
                        verify=bool(opts.get("verify")),
                        max_tokens=opts.get("max_tokens") or DEFAULT_MAX_TOKENS)
        self.state.engine, self.state.store_name, self.state.options = engine, store_name, opts
        return engine

    @staticmethod
    def _messages_of(value):
        """Messages, text, ids or Tokens from whatever an EXPR gave (a Request unwraps)."""
        if hasattr(value, "messages") and hasattr(value, "ids") and not hasattr(value, "spans"):
            return list(value.messages) if value.messages is not None else list(value.ids)
        return value

    def _tokens(self, value):
        from .tokens import Tokens, tokenise

        value = self._messages_of(value)
        if isinstance(value, Tokens):
            return value
        if not isinstance(value, (str, list, tuple)):
            raise UsageError(f"expected messages (a list of {{'role', 'content'}} dicts), text, token "
                             f"ids or Tokens, got {type(value).__name__}")
        return tokenise(self._need_model(), list(value) if isinstance(value, tuple) else value)

    # -- commands ------------------------------------------------------------------------------------
    def _cmd_load(self, args, cell, local_ns):
        import kvlab

        from .models import NAMES, Model

        name = args.args[0] if args.args else "smollm2"
        value = None
        if name.isidentifier() and name not in NAMES:
            value = (local_ns or {}).get(name, self.shell.user_ns.get(name) if self.shell else None)
        if isinstance(value, Model):  # `%kvlab load m`: adopt a model the notebook already loaded
            if args.dtype is not None and args.dtype != value.dtype:
                raise UsageError(f"{name} is already loaded as {value.dtype}; drop --dtype or load by name")
            model = value
        else:
            try:
                model = kvlab.load(name, dtype=args.dtype)
            except kvlab.KvlabError as e:  # unknown name, not a model folder, bad dtype
                raise UsageError(f"%kvlab load {name}: {e}") from None
        self.state.model = model
        self.state.options = {"max_tokens": args.max_tokens}
        self.state.store_name = "radix"
        engine = self._make_engine(args)
        return Loaded(model, engine)

    def _cmd_tokens(self, args, cell, local_ns):
        self._need_model()
        return self._tokens(self._eval(args.args[0], local_ns))

    def _cmd_split(self, args, cell, local_ns):
        from .boundary import split_at_boundary

        self._need_model()
        toks = self._tokens(self._eval(args.args[0], local_ns))
        at = "system" if args.at is None else args.at
        if at != "system":
            try:
                at = int(at)
            except ValueError:
                raise UsageError(f"--at must be 'system' or a message index, got {args.at!r}") from None
        return split_at_boundary(toks, at=at)

    def _cmd_diff(self, args, cell, local_ns):
        from .divergence import diverge
        from .normalisation import normalise

        self._need_model()
        a, b = (self._messages_of(self._eval(x, local_ns)) for x in args.args)
        if args.normalise:
            a, b = (normalise(x) if isinstance(x, (list, tuple)) and x and isinstance(x[0], dict) else x
                    for x in (a, b))
        return diverge(self._tokens(a), self._tokens(b))

    def _workload(self, args, local_ns):
        from . import workloads

        spec = args.args[0]
        key = spec.replace("-", "_").removeprefix("kv.workloads.").removeprefix("workloads.")
        if key in workloads.GENERATORS:
            gen = workloads.GENERATORS[key]
            params = inspect.signature(gen).parameters
            kwargs = {}
            for opt, names in SIZE_OPTIONS.items():
                value = getattr(args, opt)
                if value is None:
                    continue
                target = next((n for n in names if n in params), None)
                if target is None:
                    raise UsageError(f"--{opt.replace('_', '-')} does not apply to {key} "
                                     f"(its parameters: {', '.join(params)})")
                kwargs[target] = value
            for item in args.set:
                name, sep, raw = item.partition("=")
                if not sep or not name.strip():
                    raise UsageError(f"--set takes NAME=VALUE, got {item!r}")
                name = name.strip()
                if name not in params:
                    raise UsageError(f"{key} has no parameter {name!r}; its parameters: {', '.join(params)}")
                from .runner import parse_value

                kwargs[name] = parse_value(raw)
            from .errors import KvlabError

            try:
                return key, gen(**kwargs)
            except (TypeError, KvlabError) as e:  # e.g. num_prompts < num_prefixes: an argument problem
                raise UsageError(f"{key}: {e}") from None
        if any(getattr(args, o) is not None for o in SIZE_OPTIONS) or args.set:
            raise UsageError(f"{spec!r} is not a workload name ({', '.join(workloads.GENERATORS)}); "
                             "size options only apply to those")
        value = self._eval(spec, local_ns)
        if isinstance(value, workloads.Workload):
            return value.name, value
        if isinstance(value, (list, tuple)) and value:
            if isinstance(value[0], dict):  # one conversation
                return spec, [value]
            return spec, list(value)
        raise UsageError(f"{spec!r} is neither a workload name ({', '.join(workloads.GENERATORS)}) "
                         f"nor a Workload / list of requests (got {type(value).__name__})")

    def _cmd_run(self, args, cell, local_ns):
        import polars as pl

        from .normalisation import normalise

        self._need_model()
        name, requests = self._workload(args, local_ns)
        if args.store is not None or args.keying is not None or args.budget_mb is not None or args.verify:
            engine = self._make_engine(args)
        else:
            engine = self._need_engine()
        max_tokens = args.max_tokens or self.state.options.get("max_tokens") or DEFAULT_MAX_TOKENS
        rows = []
        for i, request in enumerate(requests):
            label = getattr(request, "name", "") or f"request-{i + 1}"
            if args.normalise:
                request = self._normalised(request, normalise)
            r = engine.run(request, max_tokens)
            rows.append({"request": r.request_id, "name": label, "prompt_tokens": r.prompt_tokens,
                         "reused_tokens": r.reused_tokens, "prefilled_tokens": r.prefilled_tokens,
                         "reuse_ratio": round(r.reuse_ratio, 4), "match": r.match,
                         "ttft_ms": round(r.ttft_s * 1e3, 2)})
        return RunView(name, pl.DataFrame(rows), engine.stats(), engine)

    @staticmethod
    def _normalised(request, normalise):
        from dataclasses import replace

        if hasattr(request, "messages") and getattr(request, "messages", None) is not None:
            return replace(request, messages=tuple(normalise(list(request.messages))))
        if isinstance(request, (list, tuple)) and request and isinstance(request[0], dict):
            return normalise(list(request))
        return request

    def _cmd_tree(self, args, cell, local_ns):
        engine = self._need_engine()
        store = engine.store
        if store is None:
            raise UsageError("the engine has no store (--store none): there is no tree to show")
        frame = store.tree_frame() if hasattr(store, "tree_frame") else None
        if frame is None:  # no tree (paged blocks, one system entry, mlx-lm's LRU): its table
            table = next((getattr(store, n)() for n in ("blocks_frame", "entries_frame")
                          if hasattr(store, n)), None)
            return TreeView(store, [], table)
        entries = store.entries_frame() if hasattr(store, "entries_frame") else None
        return TreeView(store, _tree_lines(frame, self.state.model.tokenizer), entries)

    def _cmd_stats(self, args, cell, local_ns):
        engine = self._need_engine()
        return StatsView(engine.stats(), engine.events, engine)

    def _cmd_inspect(self, args, cell, local_ns):
        engine = self._need_engine()
        try:
            import kvlab

            inspector = kvlab.Inspector
        except (AttributeError, ImportError) as e:
            raise UsageError(f"kv.Inspector is not available here ({e}); "
                             "install kvlab[notebooks] for the widgets") from None
        return inspector(engine)

    def _cmd_chat(self, args, cell, local_ns):
        engine = self._need_engine()
        messages = parse_chat(cell)
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise UsageError("the conversation has no 'user:' message, so there is nothing to answer")
        ends = [users[-1]] if args.last else users
        max_tokens = args.max_tokens or self.state.options.get("max_tokens") or DEFAULT_MAX_TOKENS
        results = [engine.run(messages[: u + 1], max_tokens) for u in ends]
        return ChatView(messages, results)


def parse_chat(body: str) -> list[dict]:
    """``system: ...`` / ``user: ...`` lines -> messages; other lines continue the previous message.

    Example:
        >>> parse_chat("system: Be brief.\\nuser: Hi\\nthere")
        [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi\\nthere'}]
    """
    messages: list[dict] = []
    for n, line in enumerate((body or "").splitlines(), 1):
        m = ROLE_LINE.match(line)
        if m:
            messages.append({"role": m.group(1).lower(), "content": m.group(2)})
        elif messages:
            messages[-1]["content"] += "\n" + line
        elif line.strip():
            raise UsageError(f"chat line {n} ({line.strip()[:40]!r}) comes before any message: start "
                             "each message with 'system:', 'user:', 'assistant:' or 'tool:'")
    if not messages:
        raise UsageError("the chat cell is empty: write lines like 'system: Be brief.' and 'user: Hi'")
    for m in messages:
        m["content"] = m["content"].strip("\n")
    return messages


def _tree_lines(frame, tokenizer, preview: int = 10) -> list[str]:
    """An indented text rendering of RadixStore.tree_frame()."""
    children: dict = {}
    by_id = {}
    for row in frame.iter_rows(named=True):
        by_id[row["id"]] = row
        children.setdefault(row["parent"], []).append(row["id"])
    roots = children.get(None, [])
    lines: list[str] = []

    def label(row) -> str:
        if row["parent"] is None:
            return "root"
        ids = list(row["edge_ids"] or [])
        try:
            text = tokenizer.decode(ids[:preview]) if tokenizer is not None else ""
        except Exception:  # a tokenizer that cannot decode these ids: show the ids
            text = " ".join(map(str, ids[:preview]))
        more = "…" if len(ids) > preview else ""
        entry = (f" ● entry {row['entry']} ({row['entry_kind']}, {row['bytes'] / 1024:.0f} KiB)"
                 if row["entry"] is not None else "")
        return (f"[{row['start']}:{row['depth']}) {row['tokens']} tok, hits {row['hits']}{entry}  "
                f"{text[:60]!r}{more}")

    def walk(node_id, prefix: str, last: bool, top: bool) -> None:
        row = by_id[node_id]
        lines.append(label(row) if top else f"{prefix}{'└─ ' if last else '├─ '}{label(row)}")
        kids = children.get(node_id, [])
        nxt = "" if top else prefix + ("   " if last else "│  ")
        for j, kid in enumerate(kids):
            walk(kid, nxt, j == len(kids) - 1, False)

    for r in roots:
        walk(r, "", True, True)
    return lines


def state(shell=None) -> State:
    """The current model/engine of ``shell`` (default: the running IPython)."""
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    magics = shell.magics_manager.registry.get("KvlabMagics") if shell is not None else None
    if magics is None:
        raise UsageError("the kvlab magics are not loaded: run %load_ext kvlab")
    return magics.state


def load_ipython_extension(ipython) -> None:
    """``%load_ext kvlab``."""
    ipython.register_magics(KvlabMagics(ipython))
