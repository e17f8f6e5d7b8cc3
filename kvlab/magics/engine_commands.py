"""``%kvlab load``, ``run`` and ``%%kvlab chat``: make the engine and send it requests."""

from __future__ import annotations

import inspect

from IPython.core.error import UsageError

from .options import dtype_option, engine_options, last_option, max_tokens_option, normalise_option, size_options
from .text import parse_chat
from .views import ChatView, Loaded, RunView, reasons_text

# workload size options -> the generator parameter each one sets (the first the generator has)
SIZE_OPTIONS = {"turns": ("turns",), "users": ("num_users",), "prompts": ("num_prompts", "num_requests"),
                "seed": ("seed",), "system_tokens": ("system_tokens",)}


def register(sub) -> None:
    p = sub.add_parser("load", operands="[MODEL]", help="a model and a fresh engine (replaces both)")
    engine_options(p)
    dtype_option(p)
    max_tokens_option(p)
    p.set_defaults(handler=load)
    p = sub.add_parser("run", operands="WORKLOAD", help="a workload through the engine, one row per request")
    engine_options(p)
    max_tokens_option(p)
    size_options(p)
    normalise_option(p)
    p.set_defaults(handler=run)
    p = sub.add_parser("chat", help="the cell's conversation, one request per user turn")
    max_tokens_option(p)
    last_option(p)
    p.set_defaults(handler=chat)


def load(state, args, cell, local_ns):
    from ..errors import KvlabError
    from ..models.loading import NAMES, Model
    from ..loader import load as load_model

    name = args.model or "smollm2"
    value = None
    if name.isidentifier() and name not in NAMES:
        value = (local_ns or {}).get(name, state.shell.user_ns.get(name) if state.shell else None)
    if isinstance(value, Model):  # `%kvlab load m`: adopt a model the notebook already loaded
        if args.dtype is not None and args.dtype != value.dtype:
            raise UsageError(f"{name} is already loaded as {value.dtype}; drop --dtype or load by name")
        model = value
    else:
        try:
            model = load_model(name, dtype=args.dtype)
        except KvlabError as e:  # unknown name, not a model folder, bad dtype
            raise UsageError(f"%kvlab load {name}: {e}") from None
    state.model = model
    state.options = {"max_tokens": args.max_tokens}
    state.store_name = "radix"
    return Loaded(model, state.make_engine(args))


def run(state, args, cell, local_ns):
    import polars as pl

    from ..diagnostics.dominant import dominant_miss, request_why
    from ..primitives.normalisation import normalise

    state.need_model()
    name, requests = workload_of(state, args, local_ns)
    if args.store is not None or args.keying is not None or args.budget_mb is not None or args.verify:
        engine = state.make_engine(args)
    else:
        engine = state.need_engine()
    max_tokens = state.max_tokens(args)
    rows, results, prompts = [], [], []
    for i, request in enumerate(requests):
        label = getattr(request, "name", "") or f"request-{i + 1}"
        if args.normalise:
            request = normalised(request, normalise)
        r = engine.run(request, max_tokens)
        results.append(r)
        prompts.append(engine.tokens_of(request)[0])
        rows.append({"request": r.request_id, "name": label, "prompt_tokens": r.prompt_tokens,
                     "reused_tokens": r.reused_tokens, "prefilled_tokens": r.prefilled_tokens,
                     "reuse_ratio": round(r.reuse_ratio, 4), "match": r.match,
                     "ttft_ms": round(r.ttft_s * 1e3, 2), "missed": reasons_text(r.miss_reasons),
                     "why": request_why(r)})
    # this run's requests only: an engine reused across runs keeps earlier results
    return RunView(name, pl.DataFrame(rows), engine.stats(), engine, dominant_miss(results, prompts))


def chat(state, args, cell, local_ns):
    engine = state.need_engine()
    messages = parse_chat(cell)
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise UsageError("the conversation has no 'user:' message, so there is nothing to answer")
    ends = [users[-1]] if args.last else users
    max_tokens = state.max_tokens(args)
    results = [engine.run(messages[: u + 1], max_tokens) for u in ends]
    return ChatView(messages, results)


def workload_of(state, args, local_ns):
    """``(name, requests)``: a generator by name with the size options, or a notebook EXPR."""
    from .. import workloads
    from ..errors import KvlabError
    from ..experiments.runner import parse_value

    spec = args.workload
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
            kwargs[name] = parse_value(raw)
        try:
            return key, gen(**kwargs)
        except (TypeError, KvlabError) as e:  # e.g. num_prompts < num_prefixes: an argument problem
            raise UsageError(f"{key}: {e}") from None
    if any(getattr(args, o) is not None for o in SIZE_OPTIONS) or args.set:
        raise UsageError(f"{spec!r} is not a workload name ({', '.join(workloads.GENERATORS)}); "
                         "size options only apply to those")
    value = state.evaluate(spec, local_ns)
    if isinstance(value, workloads.Workload):
        return value.name, value
    if isinstance(value, (list, tuple)) and value:
        if isinstance(value[0], dict):  # one conversation
            return spec, [value]
        return spec, list(value)
    raise UsageError(f"{spec!r} is neither a workload name ({', '.join(workloads.GENERATORS)}) "
                     f"nor a Workload / list of requests (got {type(value).__name__})")


def normalised(request, normalise):
    """``request`` with its messages normalised (a Request, or a bare conversation)."""
    from dataclasses import replace

    from ..request import Request

    if isinstance(request, Request) and request.messages is not None:
        return replace(request, messages=tuple(normalise(list(request.messages))))
    if isinstance(request, (list, tuple)) and request and isinstance(request[0], dict):
        return normalise(list(request))
    return request
