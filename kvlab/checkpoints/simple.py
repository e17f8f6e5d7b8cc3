"""The checkpoint policies that look at one prompt only, each the scheme of a server MLX users run.

Every policy is a frozen dataclass with ``name``, ``spec`` (what ``parse_policy`` reads back),
``positions(toks, tokenizer)`` (ascending, each in 1..n-1: n - 1 is the deepest a later request
can restore, its own last token being recomputed) and ``why_missed(toks, reused)`` (what the policy
itself did to make a request miss; empty for policies that do not learn).

Example:
    >>> Tail(11).positions(toks)          # a 40-token prompt
    (29,)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import KvlabError
from ..primitives.display import summary_html
from ..primitives.tokens import Tokens, common_prefix_len, tokenise_text

THINK_TAIL = 11  # mlx-lm's server looks for a thinking tail in the last 11 tokens


def clip(ends, n: int) -> tuple[int, ...]:
    """``ends`` as checkpoint positions of an n-token prompt: distinct, ascending, in 1..n-1."""
    return tuple(sorted({int(b) for b in ends if 0 < b < n}))


class CheckpointPolicy:
    """What every checkpoint policy has (the subclasses are frozen dataclasses)."""

    name = "policy"
    server = ""  # who ships this scheme

    @property
    def spec(self) -> str:
        """The string ``parse_policy`` turns back into this policy."""
        return self.name

    def positions(self, toks: Tokens, tokenizer=None) -> tuple[int, ...]:
        return clip(self.ends(toks, tokenizer), len(toks.ids))

    def ends(self, toks: Tokens, tokenizer) -> list[int]:
        raise NotImplementedError

    def why_missed(self, toks: Tokens, reused: int) -> str:
        """Why this policy (not the store) made a request miss tokens past ``reused``; empty when
        it has nothing to add. Call it before ``positions`` of the same request."""
        return ""

    def for_model(self, model) -> "CheckpointPolicy":
        """This policy, told what ``model``'s state costs (only the cost-aware one asks)."""
        return self

    def __repr__(self) -> str:
        return f"CheckpointPolicy({self.spec}: {self.server})"

    def _repr_html_(self) -> str:
        return summary_html("CheckpointPolicy", self.spec, self.server,
                            note=(type(self).__doc__ or "").strip().splitlines()[0])


@dataclass(frozen=True, repr=False)
class NoCheckpoints(CheckpointPolicy):
    """No snapshot while prefilling: only the final insert (the usual dense-attention server)."""

    name = "none"
    server = "every server for full-attention models (the final insert only)"

    def ends(self, toks, tokenizer):
        return []


@dataclass(frozen=True, repr=False)
class MessageEnds(CheckpointPolicy):
    """The end of every message and n - 1: kvlab's default for caches that cannot be cut back."""

    name = "message_ends"
    server = "kvlab's default"

    def ends(self, toks, tokenizer):
        return [s.token_end for s in toks.spans] + [len(toks.ids) - 1]


@dataclass(frozen=True, repr=False)
class SegmentEnds(CheckpointPolicy):
    """mlx-lm's server: the end of the system segment, the start of a thinking tail in the last 11
    tokens, and n - 1 (the last token is its own segment). Needs the tokenizer: it renders the
    system messages again, as mlx-lm does."""

    name = "segment_ends"
    server = "mlx-lm's server (ResponseGenerator._tokenize)"

    def ends(self, toks, tokenizer):
        return segment_ends(toks, tokenizer) + [len(toks.ids) - 1]


class Sized(CheckpointPolicy):
    """A policy with a size in tokens, spelt ``name:n``."""

    n: int = 0

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.n}"


@dataclass(frozen=True, repr=False)
class Tail(Sized):
    """One checkpoint ``n`` tokens before the end of the prompt: mlx-engine keeps the last 11
    tokens out of its cache so that a template's changing tail is recomputed."""

    n: int = 11
    name = "tail"
    server = "mlx-engine (LM Studio): the prompt minus its last 11 tokens"

    def ends(self, toks, tokenizer):
        return [len(toks.ids) - self.n]


@dataclass(frozen=True, repr=False)
class Every(Sized):
    """Block-aligned checkpoints every ``n`` tokens (n, 2n, ...): oMLX's block snapshots (every
    2048/4096 tokens) and vLLM's hybrid "align" mode (recurrent state at block boundaries)."""

    n: int = 256
    name = "every"
    server = "oMLX block snapshots, vLLM hybrid align mode"

    def ends(self, toks, tokenizer):
        return list(range(self.n, len(toks.ids), self.n))


@dataclass(frozen=True, repr=False)
class LastMessage(CheckpointPolicy):
    """One checkpoint where the last message starts: mlx-openai-server caches the conversation
    before the newest message, so the next turn finds everything before it."""

    name = "last_message"
    server = "mlx-openai-server"

    def ends(self, toks, tokenizer):
        return [toks.spans[-1].token_start] if toks.spans else []


@dataclass(frozen=True, repr=False)
class LogSpaced(CheckpointPolicy):
    """Dense near the tip, thinning behind it: n - 1, n - 2, n - 4, n - 8, ... (n - 2^k for every k
    with n - 2^k >= 1), about log2(n) checkpoints; a later request that diverges d tokens before
    the tip loses fewer than d tokens. llama.cpp's context checkpoints are of this family (a few
    recent ones kept)."""

    name = "log_spaced"
    server = "llama.cpp context checkpoints (recent ones kept)"

    def ends(self, toks, tokenizer):
        n, out, step = len(toks.ids), [], 1
        while n - step >= 1:
            out.append(n - step)
            step *= 2
        return out


def segment_ends(toks: Tokens, tokenizer) -> list[int]:
    """mlx-lm's server (``ResponseGenerator._tokenize``): a chat prompt ending in a user message is
    cut after its leading system messages and before a thinking tail; other prompts are not cut.
    A VLM request (kvlab serve's own loop: mlx-lm's server takes no images) is cut the same way
    unless an image sits in the system messages, which the text rendering cannot place."""
    messages = toks.messages
    if not messages or messages[-1].get("role") != "user":
        return []
    if tokenizer is None:
        raise KvlabError("the segment_ends policy renders the system messages again: pass the tokenizer")
    ends = []
    n_system = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    if n_system and not any(im.message_index < n_system for im in toks.images):
        rendered = tokenise_text(tokenizer, list(messages[:n_system]) + [{"role": "user", "content": ""}],
                                 add_generation_prompt=False, **dict(toks.template_kwargs)).ids
        sys_end = common_prefix_len(rendered, toks.ids)
        if 0 < sys_end < len(toks.ids) and sys_end < len(rendered):
            ends.append(sys_end)
    if getattr(tokenizer, "has_thinking", False):
        think = tokenizer.rfind_think_start(list(toks.ids), start=len(toks.ids) - THINK_TAIL)
        if think >= 0:
            ends.append(think)
    return ends
