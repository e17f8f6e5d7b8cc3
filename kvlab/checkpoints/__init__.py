"""Where the Engine snapshots a prompt while prefilling it: checkpoint policies as objects.

A cache that cannot be cut back to any earlier position (recurrent, sliding-window, chunked layers:
``kvlab.primitives.layout``) is reusable only exactly where a snapshot was taken, so where the
snapshots are taken decides what the next request can reuse. Each policy maps a rendered prompt to
the positions (token counts) to snapshot, besides the final insert; each is the scheme of a server:

- ``message_ends``: the end of every message and n - 1 (kvlab's default for such caches);
- ``segment_ends``: mlx-lm's server (end of the system segment, a thinking tail, n - 1);
- ``tail:N``: mlx-engine, the prompt minus its last N (11) tokens;
- ``every:N``: block-aligned every N tokens (oMLX, vLLM's hybrid "align" mode);
- ``last_message``: mlx-openai-server, where the last message starts;
- ``log_spaced``: n - 1, n - 2, n - 4, ... (dense near the tip, thinning behind it);
- ``cost_aware``: the highest expected prefill seconds saved per byte, learned from sightings;
- ``none``: no snapshot but the final insert;
- ``optimal``: the offline optimum for a workload at a byte budget (``plan_optimal``).

n - 1 is what an identical request needs: its last token is always recomputed.
``kvlab.experiments.checkpoint_study`` runs a workload per policy and measures them.

Example:
    >>> parse_policy("every:256")
    CheckpointPolicy(every:256: oMLX block snapshots, vLLM hybrid align mode)
    >>> positions("message_ends", toks)
    (12, 30, 44)
"""

from __future__ import annotations

from ..errors import KvlabError
from .costed import CostAware, NominalCost, Sightings, StateBytes
from .optimal import Optimal, plan_optimal, reachable
from .simple import (THINK_TAIL, CheckpointPolicy, Every, LastMessage, LogSpaced, MessageEnds,
                     NoCheckpoints, SegmentEnds, Tail, clip, segment_ends)

__all__ = ["POLICIES", "CheckpointPolicy", "block_checkpoint_interval", "CostAware", "Every", "LastMessage", "LogSpaced",
           "MessageEnds", "NoCheckpoints", "NominalCost", "Optimal", "SegmentEnds", "Sightings",
           "StateBytes", "THINK_TAIL", "Tail", "check_policy", "clip", "parse_policy", "plan_optimal",
           "positions", "prefill_stops", "reachable", "segment_ends"]

POLICIES = ("message_ends", "segment_ends", "none", "tail", "every", "last_message", "log_spaced",
            "cost_aware", "optimal")
_PLAIN = {"message_ends": MessageEnds, "segment_ends": SegmentEnds, "none": NoCheckpoints,
          "last_message": LastMessage, "log_spaced": LogSpaced, "cost_aware": CostAware}
_SIZED = {"tail": (Tail, "tail:11 (mlx-engine keeps the last 11 tokens)"),
          "every": (Every, "every:256 (a checkpoint every 256 tokens)")}


def parse_policy(spec) -> CheckpointPolicy:
    """A checkpoint policy from its spec (``"every:256"``, ``"tail"``, ``"cost_aware"``), a policy
    object (returned as is), or True/False (``message_ends`` / ``none``). Every call makes a new
    object: a learning policy starts with an empty memory."""
    if isinstance(spec, CheckpointPolicy):
        return spec
    if isinstance(spec, bool):
        return MessageEnds() if spec else NoCheckpoints()
    if not isinstance(spec, str):
        raise KvlabError(f"a checkpoint policy is a name such as 'every:256' or a policy object, "
                         f"got {type(spec).__name__} {spec!r}")
    name, sep, arg = spec.strip().partition(":")
    if name == "optimal":
        raise KvlabError("'optimal' sees the whole workload: build it with "
                         "kvlab.checkpoints.plan_optimal(token_ids_per_request, StateBytes.of(model), "
                         "budget) (`kvlab checkpoints` does)")
    if name in _PLAIN:
        if sep:
            raise KvlabError(f"checkpoint policy {name!r} takes no argument, got {spec!r}")
        return _PLAIN[name]()
    if name in _SIZED:
        cls, example = _SIZED[name]
        if not sep and name == "tail":
            return cls()
        if not arg.strip().isdigit() or int(arg) < 1:
            raise KvlabError(f"checkpoint policy {spec!r}: {name} needs a positive whole number of "
                             f"tokens after the colon, e.g. {example}")
        return cls(int(arg))
    raise KvlabError(f"unknown checkpoint policy {spec!r}; use one of message_ends, segment_ends, none, "
                     "tail:N, every:N, last_message, log_spaced, cost_aware (optimal: plan_optimal)")


def check_policy(spec) -> str:
    """The spec of a valid policy (KvlabError naming the valid ones otherwise)."""
    return parse_policy(spec).spec


def positions(policy, toks, tokenizer=None) -> tuple[int, ...]:
    """The positions ``policy`` (a spec or a policy object) snapshots a prompt at, ascending, each
    in 1..n-1. ``segment_ends`` needs the tokenizer (it renders the system messages again, as
    mlx-lm does)."""
    return parse_policy(policy).positions(toks, tokenizer)


def block_checkpoint_interval(capabilities, layout) -> int | None:
    """``checkpoint_every`` of a store that keeps recurrent state only at its block ends, for a
    model with recurrent layers; None when prompts need no block-end snapshots."""
    every = capabilities.checkpoint_every if capabilities is not None else None
    return every if every and "recurrent" in layout.kind_set else None


def prefill_stops(policy_positions, n: int, capabilities, layout) -> tuple[int, ...]:
    """Where a prompt of n tokens is snapshotted while it is prefilled, for a store of
    ``capabilities`` and a model of ``layout``: the policy's positions, except that a store keeping
    recurrent state only at its block ends (``checkpoint_every``) gets each moved down to the block
    end at or below it, plus a block end every ``checkpoint_every`` tokens (vLLM's hybrid "align"
    mode). The Engine and ``kvlab serve`` cut prompts here, so both make the same checkpoints.

    Example:
        >>> prefill_stops((345, 871), 872, paged_caps, qwen3_5_layout)  # block 16, every 256
        (256, 336, 512, 768, 864)
    """
    every = block_checkpoint_interval(capabilities, layout)
    if every is None:
        return clip(policy_positions, n)
    block = capabilities.block_size
    return clip({p // block * block for p in policy_positions} | set(range(every, n, every)), n)
