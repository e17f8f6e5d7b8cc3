"""Where `kvlab serve` snapshots a prompt while prefilling it: a checkpoint policy as mlx-lm segments.

mlx-lm's server prefills a prompt segment by segment (``ResponseGenerator._tokenize`` cuts it after
the system messages and before a thinking tail; ``BatchGenerator.insert_segments`` splits off the
last token) and hands the cache to the prompt cache's ``insert_cache`` at the end of every segment
but the last. So a checkpoint policy needs no second prefill loop: ``ServedCheckpoints.split``
recuts the prompt at the positions the policy names, plus the block ends of a store that keeps
recurrent state there (``Capabilities.checkpoint_every``), the same positions ``kv.Engine`` uses
for the same request (``Engine._prefill``). ``segment_ends`` with no block ends is mlx-lm's own cut
and is left exactly as mlx-lm made it. mlx-lm's sequential path (a cache without ``merge``: chunked
attention; a seed; requests with images) prefills in one piece and inserts only prompt + output:
kvlab serves those requests itself (``kvlab.serving.sequential``), stopping at ``positions``.

Example:
    >>> plan = ServedCheckpoints("message_ends", model, store)
    >>> plan.split(model.tokenise(messages), prompt, segments, types)
    ([[...], [...], [...]], ['system', 'user', 'user'])
"""

from __future__ import annotations

from ..checkpoints import block_checkpoint_interval, parse_policy, prefill_stops
from ..primitives.display import summary_html


class ServedCheckpoints:
    """A checkpoint policy (any spec ``kvlab.checkpoints.parse_policy`` reads) for a served model
    and store: which positions to snapshot and the mlx-lm segments that make it do so."""

    def __init__(self, policy, model, store):
        self.policy = parse_policy(policy).for_model(model)
        self.model = model
        self.caps = store.capabilities if store is not None else None
        self.every = block_checkpoint_interval(self.caps, model.layout)
        self.active = store is not None and self.policy.name != "none"

    @property
    def spec(self) -> str:
        return self.policy.spec

    @property
    def is_mlx_default(self) -> bool:
        """mlx-lm's own segmentation: nothing to recut."""
        return self.policy.name == "segment_ends" and self.every is None

    def positions(self, toks) -> tuple[int, ...]:
        """Where a prompt is snapshotted while prefilling (the Engine's positions, same order)."""
        if not self.active:
            return ()
        return prefill_stops(self.policy.positions(toks, self.model.tokenizer), len(toks.ids), self.caps,
                             self.model.layout)

    def split(self, toks, prompt, segments, types) -> tuple[list, list]:
        """mlx-lm's ``(segments, segment_types)`` recut at ``positions(toks)``. A segment ending
        where mlx-lm's system segment ends keeps the type ``system``; the others are ``user`` (a
        prompt checkpoint). One type per cut: mlx-lm inserts at the end of a segment only while
        types remain, so no insert is made at n - 1 unless it is a cut."""
        if self.is_mlx_default:
            return segments, types
        cuts = self.positions(toks)
        system_end = len(segments[0]) if types and types[0] == "system" else None
        bounds = (0, *cuts, len(prompt))
        out = [list(prompt[a:b]) for a, b in zip(bounds, bounds[1:])]
        return out, ["system" if c == system_end else "user" for c in cuts]

    def __repr__(self) -> str:
        blocks = f" + block ends every {self.every}" if self.every else ""
        return f"ServedCheckpoints({self.spec}{blocks})"

    def _repr_html_(self) -> str:
        return summary_html("ServedCheckpoints", self.spec,
                            f"block ends every {self.every}" if self.every else "")


def request_tokens(model, request, prompt):
    """The request's prompt as ``kv.Tokens`` with its messages (a policy such as ``segment_ends``
    renders them again), as the Engine tokenises it; the bare ids with ChatML message spans when
    kvlab's rendering is not exactly mlx-lm's (tools, a completion prompt)."""
    from ..primitives.tokens import from_ids

    messages = getattr(request, "messages", None) if request.request_type == "chat" else None
    if messages:
        try:
            toks = model.tokenise([dict(m) for m in messages])
            if toks.ids == tuple(prompt):
                return toks
        except Exception:  # noqa: BLE001  content kvlab's text path does not render: use the ids
            pass
    return from_ids(prompt, model.tokenizer, chatml_spans=True)
