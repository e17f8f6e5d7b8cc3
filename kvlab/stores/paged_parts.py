"""What PagedStore keeps of layers that are not full-attention KV, and where a hit may land.

Learned from vLLM's hybrid KV cache manager and SGLang's MambaRadixCache, done kvlab's way:

- full-attention KV: every block holds its tokens' keys and values (vLLM's FullAttentionManager);
- sliding window of W: a block's window KV is kept only while some checkpoint's window reaches it:
  a hit at position a needs the tokens [a - W, a), so blocks wholly older than that are released
  for that layer (vLLM frees them to null blocks in SlidingWindowManager.remove_skipped_blocks);
- chunked attention of C (ChunkedKVCache, Llama 4): held as a sliding window of C, its own state
  rebuilt at restore (``kvlab.primitives.cache_parts.chunked_state``): mlx-lm keeps at most the
  last C tokens and masks by absolute position, so [a - C, a) is all a hit at a needs;
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

import mlx.core as mx

from ..errors import SnapshotError
from ..primitives.cache_parts import (WINDOWED, Part, arrays_of, copy_of, full_kv, nbytes_of, window_kv,
                                      window_size, windowed_state)
from ..primitives.display import summary_html
from ..primitives.units import fmt_bytes

COMPONENTS = ("full", "window", "recurrent")  # chunked-attention KV counts as window KV
WINDOW_WORDS = {"window": "sliding window", "chunked": "chunked attention"}


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
    prompt_end: bool = False  # taken at the end of an offered prompt, not mid-prefill

    def __repr__(self) -> str:
        return f"Checkpoint(at {self.position}, {len(self.states)} states, {fmt_bytes(self.nbytes)})"

    def _repr_html_(self) -> str:
        return summary_html(f"checkpoint {self.id}", f"at token {self.position}",
                            f"{len(self.states)} recurrent states", fmt_bytes(self.nbytes),
                            f"window reaches {len(self.window_blocks)} blocks", f"{self.hits} hits")


def reach(position: int, window: int, block_size: int) -> range:
    """Indices of the blocks holding any of the tokens [position - window, position)."""
    return range(max(0, position - window) // block_size, position // block_size)


def window_block(part: Part, j: int, block_size: int):
    """(keys, values) copies of block ``j``'s tokens from a window part's state, or None when the
    window no longer (or not yet) holds all of them."""
    keys, values, first = window_kv(part.state)
    end = first + (0 if keys is None else keys.shape[2])
    s, e = j * block_size, (j + 1) * block_size
    if keys is None or s < first or e > end:
        return None
    return full_kv((keys, values), s - first, e - first)


def obstacle(parts: tuple[Part, ...], store: str = "PagedStore cannot page") -> str:
    """Why these parts cannot be kept in token blocks or slices (a layer kind no scheme here
    restores), or ''; ``store`` starts the sentence."""
    for p in parts:
        if p.kind == "unknown":
            return (f"{store} {p.label}: it is a cache kvlab does not know, which cannot be cut "
                    "into token blocks exactly; use RadixStore")
        if p.kind == "window" and int(p.state[3]):
            return (f"{store} {p.label}: its sliding window keeps {int(p.state[3])} "
                    "sink tokens (keep > 0); use RadixStore")
    return ""


def needs(parts: tuple[Part, ...]) -> str:
    """What a hit needs a checkpoint for: the first window or recurrent part, named ('' if none)."""
    for p in parts:
        if p.kind == "recurrent":
            return f"the recurrent state of {p.label}"
        if p.kind in WINDOW_WORDS:
            return f"the {WINDOW_WORDS[p.kind]} of {window_size(p)} of {p.label}"
    return ""


def join_window(hits, i: int, n: int, part: Part, block_size: int) -> tuple:
    """The RotatingKVCache (or ChunkedKVCache) state at ``n`` of window part ``i`` from the window
    KV of the blocks ``hits`` (the last ``min(n, window)`` tokens, in temporal order)."""
    window = window_size(part)
    lo = max(0, n - window)
    first = lo // block_size
    k, v = (mx.concatenate([b.window[i][a] for b in hits[first:]], axis=2)[..., lo - first * block_size:, :]
            for a in (0, 1))
    return windowed_state(part, k, v, n)


def join_full(parts: list[tuple], n: int) -> tuple:
    """One full-attention part's state from its blocks' KV (concatenated along tokens)."""
    quant = {tuple(p[2:]) for p in parts if len(p) > 2}
    if len(quant) > 1:
        raise SnapshotError(f"this PagedStore holds blocks quantized with different (group size, "
                            f"bits) {sorted(quant)}: use one PagedStore per KV format")
    if quant:
        # float blocks cached below quantized_kv_start: mlx quantizes each token's groups on
        # their own, so quantizing a block alone equals what mlx-lm's conversion would give
        group, bits = quant.pop()
        parts = [p if len(p) > 2 else tuple(mx.quantize(x, group_size=group, bits=bits) for x in p)
                 for p in parts]
        k, v = (tuple(mx.concatenate([p[j][a] for p in parts], axis=-2) for a in range(3)) for j in (0, 1))
        return (k, v, n, group, bits)
    return (mx.concatenate([p[0] for p in parts], axis=2), mx.concatenate([p[1] for p in parts], axis=2), n)


class CheckpointBook:
    """PagedStore's checkpoints and window KV (module docstring): kept on insert, released when
    no checkpoint's window reaches them, dropped with the block they end. With
    ``keep_superseded_windows`` False, a checkpoint a prefill took mid-prompt (an earlier message
    end) holding window KV is dropped as soon as a deeper one on the same path is kept (SGLang's
    SWA tombstones, vLLM freeing blocks that left the window); a checkpoint at the end of an
    offered prompt stays, since a regenerated reply or an edited next message resumes there. A
    sliding model then holds one window per cached prompt, and a prompt branching off at an
    earlier message end recomputes from the previous checkpoint that survived."""

    keep_superseded_windows = False

    def _checkpoint(self, held: list[Block], parts, offset: int, prompt_end: bool = False) -> None:
        """Keep a checkpoint at the end of the last block ``held`` when the snapshot can give one
        there: recurrent states only where they were taken (a block end), window KV of every
        block the window reaches. Window KV no checkpoint reaches is released."""
        k, b = len(held), self.block_size
        recurrent = [i for i, p in enumerate(parts) if p.kind == "recurrent"]
        last = held[-1]
        if last.hash in self._checkpoints:
            self._checkpoints[last.hash].prompt_end |= prompt_end
            return self._release(held)
        if recurrent and offset != k * b:
            return self._release(held)
        reached = set()
        for i, p in enumerate(parts):
            if p.kind not in WINDOWED:
                continue
            for j in reach(k * b, window_size(p), b):
                if i not in held[j].window:
                    kv = window_block(p, j, b)
                    if kv is None:  # the window this snapshot holds does not reach back far enough
                        return self._release(held)
                    self._add_window(held[j], i, kv)
                reached.add(j)
        states = {i: copy_of(parts[i].state) for i in recurrent}
        nbytes = nbytes_of(list(states.values()))
        cp = Checkpoint(next(self._ids), last.hash, k * b, states, nbytes,
                        tuple(held[j].hash for j in sorted(reached)), prompt_end=prompt_end)
        for j in reached:
            held[j].window_refs += 1
        self._checkpoints[last.hash] = cp
        self._bytes += nbytes
        self.log.add("checkpoint_stored", tokens=k * b, nbytes=nbytes, entry=last.hash.hex(),
                     kind="recurrent state" if states else next(WINDOW_WORDS[p.kind] for p in parts if p.kind in WINDOWED))
        if reached and not self.keep_superseded_windows:
            for block in held[:-1]:
                old = self._checkpoints.get(block.hash)
                if old is not None and old.window_blocks and not old.prompt_end:
                    self._drop_checkpoint(block.hash, f"superseded by the checkpoint at {k * b}")
        self._release(held)

    def _add_window(self, block: Block, i: int, kv) -> None:
        mx.eval(arrays_of(kv))
        nbytes = nbytes_of(kv)
        block.window[i] = kv
        block.nbytes += nbytes
        self._bytes += nbytes
        self.log.add("window_stored", tokens=self.block_size, nbytes=nbytes, entry=block.hash.hex(),
                     kind=f"{WINDOW_WORDS[self._parts[i].kind]} of {window_size(self._parts[i])}")

    def _release(self, blocks) -> None:
        """Drop the window KV of blocks no checkpoint's window reaches."""
        for block in blocks:
            if block.window and not block.window_refs:
                nbytes = nbytes_of(list(block.window.values()))
                block.window, block.nbytes = {}, block.nbytes - nbytes
                self._bytes -= nbytes
                self.log.add("window_released", tokens=self.block_size, nbytes=nbytes, entry=block.hash.hex(),
                             reason="older than every window a checkpoint needs")

    def _drop_checkpoint(self, h: bytes, reason: str) -> None:
        cp = self._checkpoints.pop(h, None)
        if cp is None:
            return
        self._bytes -= cp.nbytes
        reached = [self._blocks[w] for w in cp.window_blocks if w in self._blocks]
        for block in reached:
            block.window_refs -= 1
        self.log.add("checkpoint_removed", tokens=cp.position, nbytes=cp.nbytes, entry=h.hex(), reason=reason)
        self._release(reached)

    def components(self) -> dict:
        """Bytes held per component (``full`` KV blocks, ``window`` KV, ``recurrent`` state
        checkpoints), the checkpoint count, and per layer the window KV tokens held. ``nbytes``
        (their sum) stays the store's memory figure."""
        full = sum(nbytes_of(b.kv) for b in self._blocks.values())
        window = sum(nbytes_of(list(b.window.values())) for b in self._blocks.values())
        recurrent = sum(cp.nbytes for cp in self._checkpoints.values())
        tokens: dict[int, int] = {}
        for b in self._blocks.values():
            for i, (k, _) in b.window.items():
                layer = self._parts[i].layer
                tokens[layer] = tokens.get(layer, 0) + k.shape[2]
        return {**dict(zip(COMPONENTS, (full, window, recurrent))), "checkpoints": len(self._checkpoints),
                "window_tokens": tokens}



def block_bytes(device, parts, block_size: int) -> int:
    """What one block's full-attention copies of ``parts`` hold on ``device`` (a ``kvlab.device.Device``)."""
    return sum(device.allocation_bytes(a.nbytes // max(a.shape[-2], 1) * block_size)
               for p in parts if p.kind == "full" for a in arrays_of(tuple(p.state[:2])))


def check_pool(store, per_block: int | None, buffers: int) -> None:
    """Refuse a paged ``store`` whose pool could keep more buffers than its device allows: as many
    blocks as ``num_blocks`` or the budget (blocks of ``per_block`` bytes; None: not known yet)
    has room for, ``buffers`` each (``kvlab.errors.BufferLimitError``)."""
    blocks = store.num_blocks
    if per_block is not None:
        by_budget = store.budget_bytes // max(per_block, 1)
        blocks = by_budget if blocks is None else min(blocks, by_budget)
    what = f"paged: {blocks:,} blocks of {store.block_size} tokens x {buffers} buffers (K and V per layer)"
    fix = (f"raise block_size (now {store.block_size}) or lower budget_bytes (now {store.budget_bytes:,})"
           + ("" if store.num_blocks is None else f" or num_blocks (now {store.num_blocks:,})"))
    store.device.check_buffers(blocks * buffers, what, fix)
