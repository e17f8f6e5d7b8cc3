"""Which load-run parameter applies to which workload: a parameter given to a workload it does
nothing for is refused (a RequestError naming the parameter, the workload and the workloads it
applies to), never ignored. ``kvlab load`` checks its flags with the same table (``--output-len``
for ``output_len``).

| parameter | applies to |
|---|---|
| ``turns`` | multi_turn, agentic_loop |
| ``system_tokens`` | multi_turn, agentic_loop, shared_system_prompt, multimodal (about), fixed (exact) |
| ``output_len`` (alias ``max_tokens``) | every named workload |
| ``input_len`` | fixed |
| ``prefix_len``, ``suffix_len``, ``num_prefixes`` | prefix_repetition |
| ``time_scale``, ``block_tokens``, ``max_prompt_tokens`` | trace |

Other keywords go to the workload's generator if it takes them (``tools=``, ``user_tokens=``,
multimodal's ``traffic=``, ``distinct_images=``, ``image_size=``...).

Example:
    >>> workload_kwargs("multi_turn", {"output_len": 5})
    {'max_tokens': 5}
    >>> workload_kwargs("multi_turn", {"prefix_len": 64})
    Traceback (most recent call last):
    ...
    kvlab.errors.RequestError: prefix_len does not apply to the multi_turn workload; it applies to prefix_repetition. Drop it or choose one of those workloads
"""

from __future__ import annotations

import inspect
from pathlib import Path

from ..errors import RequestError
from .sessions import CHAT_SESSIONS, WORKLOADS

TRACE = "trace"
APPLIES = {
    "turns": ("multi_turn", "agentic_loop"),
    "system_tokens": ("multi_turn", "agentic_loop", "shared_system_prompt", "multimodal", "fixed"),
    "output_len": WORKLOADS,
    "input_len": ("fixed",),
    "prefix_len": ("prefix_repetition",),
    "suffix_len": ("prefix_repetition",),
    "num_prefixes": ("prefix_repetition",),
    "time_scale": (TRACE,),
    "block_tokens": (TRACE,),
    "max_prompt_tokens": (TRACE,),
}
SET_BY_THE_RUN = ("seed", "tokenizer", "num_users", "num_prompts", "num_requests")  # from users=, seed=


def kind_of(workload) -> str:
    """A workload name, ``"trace"`` (a Trace or a .jsonl/.json path) or ``"kv.Workload"``."""
    from ..experiments import traces

    if isinstance(workload, traces.Trace) or (isinstance(workload, (str, Path))
                                               and str(workload).endswith((".jsonl", ".json"))):
        return TRACE
    if isinstance(workload, str):
        if workload not in WORKLOADS:
            raise RequestError(f"unknown workload {workload!r}; use one of {', '.join(WORKLOADS)}, a "
                               "kv.Workload, or the path of a Mooncake trace (.jsonl)")
        return workload
    return "kv.Workload"


def workload_kwargs(workload, params: dict, spell=str) -> dict:
    """``params`` (the ones given: None values are dropped) checked against :data:`APPLIES` for
    ``workload`` and turned into its generator's keywords (``output_len`` is ``max_tokens`` for chat
    workloads). ``spell`` names a parameter in errors (the CLI passes its flag spelling).

    Example:
        >>> workload_kwargs("prefix_repetition", {"max_tokens": 16, "prefix_len": 64})
        {'prefix_len': 64, 'output_len': 16}
    """
    kind = kind_of(workload)
    given = {k: v for k, v in params.items() if v is not None}
    if "max_tokens" in given:
        if "output_len" in given:
            raise RequestError(f"{spell('output_len')} and {spell('max_tokens')} are the same thing; "
                               "give one")
        given["output_len"] = given.pop("max_tokens")
    for name in given:
        if name in APPLIES and kind not in APPLIES[name]:
            what = ("a kv.Workload (its requests are already made)" if kind == "kv.Workload"
                    else "a trace" if kind == TRACE else f"the {kind} workload")
            where = ", ".join("a trace (.jsonl)" if w == TRACE else w for w in APPLIES[name])
            raise RequestError(f"{spell(name)} does not apply to {what}; it applies to {where}. "
                               "Drop it or choose one of those workloads")
    if kind in (TRACE, "kv.Workload"):
        extra = sorted(set(given) - set(APPLIES))
        if extra:
            raise RequestError(f"{spell(extra[0])} does not apply to {'a trace' if kind == TRACE else 'a kv.Workload'}"
                               "; it takes no generator parameters")
        return given
    if kind == "fixed" and "input_len" not in given:
        raise RequestError(f"the fixed workload needs {spell('input_len')}: the prompt's tokens as the "
                           "chat template renders them")
    if "output_len" in given and kind in (*CHAT_SESSIONS, "shared_system_prompt", "multimodal"):
        given["max_tokens"] = given.pop("output_len")
    _check_generator_keywords(kind, given, spell)
    _check_system_floor(kind, given, spell)
    return given


def _check_generator_keywords(kind: str, given: dict, spell) -> None:
    from ..workloads import GENERATORS

    takes = [p for p in inspect.signature(GENERATORS[kind]).parameters if p not in SET_BY_THE_RUN]
    for name in given:
        if name in SET_BY_THE_RUN:
            raise RequestError(f"{spell(name)} is set by the load run for {kind}: pass users= (how many "
                               "sessions or requests) and seed= to the run instead")
        if name not in takes and name not in APPLIES:
            raise RequestError(f"{spell(name)} is not a parameter of the {kind} workload; it takes "
                               f"{', '.join(takes)}")


def _check_system_floor(kind: str, given: dict, spell) -> None:
    from ..workloads.generators import SYSTEM_ROLES
    from ..workloads.text import system_prompt_floor

    if kind not in SYSTEM_ROLES or "system_tokens" not in given:
        return
    tools = int(given.get("tools", 4))
    floor = system_prompt_floor(tools, SYSTEM_ROLES[kind])
    if given["system_tokens"] < floor:
        raise RequestError(
            f"{spell('system_tokens')} {given['system_tokens']} is below what {kind} can make: its "
            f"instructions and {tools} tool schemas alone are about {floor} tokens, so every smaller "
            f"value gives the same system prompt. Pass {spell('system_tokens')} >= {floor}, or use "
            "the fixed workload for a system prompt of exactly any length")
