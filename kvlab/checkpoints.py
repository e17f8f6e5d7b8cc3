"""Where the Engine snapshots a prompt while prefilling it: checkpoint policies.

A cache that cannot be cut back to any earlier position (recurrent, sliding-window, chunked layers:
``kvlab.primitives.layout``) is reusable only exactly where a snapshot was taken, so where the
snapshots are taken decides what the next request can reuse. Each policy maps a rendered prompt to
the positions (token counts) to snapshot, besides the final insert:

- ``message_ends``: the end of every message and n - 1 (kvlab's default for such caches);
- ``segment_ends``: what mlx-lm's server does: the end of the system segment (where the rendering
  of the system messages and an empty user turn leaves the prompt), the start of a thinking tail
  in the last 11 tokens, and n - 1 (the last token is its own segment);
- ``none``: no snapshot but the final insert.

n - 1 is what an identical request needs: its last token is always recomputed.

Example:
    >>> positions("message_ends", toks)
    (12, 30, 44)
"""

from __future__ import annotations

from .errors import KvlabError
from .primitives.tokens import Tokens, common_prefix_len, tokenise_text

POLICIES = ("message_ends", "segment_ends", "none")
THINK_TAIL = 11  # mlx-lm's server looks for a thinking tail in the last 11 tokens


def check_policy(name) -> str:
    if name not in POLICIES:
        raise KvlabError(f"unknown checkpoint policy {name!r}; use one of {', '.join(POLICIES)}")
    return name


def positions(policy: str, toks: Tokens, tokenizer=None) -> tuple[int, ...]:
    """The positions ``policy`` snapshots a prompt at, ascending, each in 1..n-1.
    ``segment_ends`` needs the tokenizer (it renders the system messages again, as mlx-lm does)."""
    n = len(toks.ids)
    if check_policy(policy) == "none":
        ends: set[int] = set()
    elif policy == "message_ends":
        ends = {s.token_end for s in toks.spans} | {n - 1}
    else:
        ends = set(_segment_ends(toks, tokenizer)) | {n - 1}
    return tuple(sorted(b for b in ends if 0 < b < n))


def _segment_ends(toks: Tokens, tokenizer) -> list[int]:
    """mlx-lm's server (``ResponseGenerator._tokenize``): a chat prompt ending in a user message is
    cut after its leading system messages and before a thinking tail; other prompts are not cut."""
    messages = toks.messages
    if not messages or messages[-1].get("role") != "user" or toks.images:
        return []
    if tokenizer is None:
        raise KvlabError("the segment_ends policy renders the system messages again: pass the tokenizer")
    ends = []
    n_system = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    if n_system:
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
