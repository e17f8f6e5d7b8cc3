"""What PagedStore keeps of layers that are not full-attention KV, and where a hit may land.

Learned from vLLM's hybrid KV cache manager and SGLang's MambaRadixCache, done kvlab's way:

- full-attention KV: every block holds its tokens' keys and values (vLLM's FullAttentionManager);
- sliding window of W: a block's window KV is kept only while some checkpoint's window reaches it:
  a hit at position a needs the tokens [a - W, a), so blocks wholly older than that are released
  for that layer (vLLM frees them to null blocks in SlidingWindowManager.remove_skipped_blocks);
- recurrent state (ArraysCache, a CacheList's ArraysCache part): copied whole at a block end the
  prompt was snapshotted at (vLLM's Mamba "align" mode: state only at block boundaries; SGLang
  keeps it on tree nodes and matches the deepest node that has one).

A ``Checkpoint`` sits at the end of one block (keyed by that block's chained hash, so it can only
serve prompts whose every earlier token is the same) and holds what a hit there needs besides the
full-KV blocks: the recurrent states, and a reference on each block whose window KV it reaches.
A hit is the deepest checkpoint along the prompt's leading cached blocks: never a state taken
past where the prompt diverges.

Example:
    >>> reach(288, 32, 16)        # blocks whose window KV a hit at 288 needs (window 32)
    range(16, 18)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..primitives.cache_parts import Part, full_kv, window_kv
from ..primitives.display import summary_html
from ..primitives.units import fmt_bytes

COMPONENTS = ("full", "window", "recurrent")


@dataclass(eq=False)
class Checkpoint:
    """What a hit at ``position`` (the end of block ``block``) needs besides full-KV blocks:
    ``states`` (part index -> recurrent state copy) and ``window_blocks`` (hashes of the blocks
    whose window KV it holds a reference on)."""

    id: int
    block: bytes
    position: int
    states: dict[int, Any]
    nbytes: int
    window_blocks: tuple[bytes, ...]
    hits: int = 0

    def __repr__(self) -> str:
        return f"Checkpoint(at {self.position}, {len(self.states)} states, {fmt_bytes(self.nbytes)})"

    def _repr_html_(self) -> str:
        return summary_html(f"checkpoint {self.id}", f"at token {self.position}",
                            f"{len(self.states)} recurrent states", fmt_bytes(self.nbytes),
                            f"window reaches {len(self.window_blocks)} blocks", f"{self.hits} hits")


def reach(position: int, window: int, block_size: int) -> range:
    """Indices of the blocks holding any of the tokens [position - window, position)."""
    return range(max(0, position - window) // block_size, position // block_size)


def window_of(part: Part) -> int:
    return int(part.state[4])


def window_block(part: Part, j: int, block_size: int):
    """(keys, values) copies of block ``j``'s tokens from a window part's state, or None when the
    window no longer (or not yet) holds all of them."""
    keys, values, first = window_kv(part.state)
    end = first + (0 if keys is None else keys.shape[2])
    s, e = j * block_size, (j + 1) * block_size
    if keys is None or s < first or e > end:
        return None
    return full_kv((keys, values), s - first, e - first)


def obstacle(parts: tuple[Part, ...]) -> str:
    """Why these parts cannot be paged (a layer kind no block scheme here restores), or ''."""
    for p in parts:
        if p.kind in ("chunked", "unknown"):
            what = "chunked attention" if p.kind == "chunked" else "a cache kvlab does not know"
            return (f"PagedStore cannot page {p.label}: it is {what}, which cannot be cut into token "
                    "blocks exactly; use RadixStore")
        if p.kind == "window" and int(p.state[3]):
            return (f"PagedStore cannot page {p.label}: its sliding window keeps {int(p.state[3])} "
                    "sink tokens (keep > 0); use RadixStore")
    return ""


def needs(parts: tuple[Part, ...]) -> str:
    """What a hit needs a checkpoint for: the first window or recurrent part, named ('' if none)."""
    for p in parts:
        if p.kind == "recurrent":
            return f"the recurrent state of {p.label}"
        if p.kind == "window":
            return f"the sliding window of {window_of(p)} of {p.label}"
    return ""
