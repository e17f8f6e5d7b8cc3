"""CacheKey: everything a cached KV depends on, built in one place and read by every store.

KV of a prompt's first ``n`` tokens is reusable for another prompt only when both share those
ids *and* the same namespace up to ``n``: the salt (tenant isolation) and the extra keys whose
spans start before ``n`` (an image's content hash over its placeholder tokens, a LoRA id). The
stores see that one rule through four views of the same key: per-token ``symbols`` (radix
trees), chained ``block_hashes`` (paged), a ``digest`` of a prefix (single-entry stores) and
``namespace_at`` (mlx-lm's model key).

Example:
    >>> msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    >>> k = cache_key(kv.tokenise(m, msgs), salt="alice")
    >>> k
    CacheKey(17 ids, salt='alice')
    >>> k.prefix(10).namespace_at(10)
    ('alice', ())
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from .primitives.blocks import block_hashes
from .errors import TokenIdError
from .primitives.tokens import Tokens
from .primitives.display import summary_html


@dataclass(frozen=True)
class CacheKey:
    """Token ids, extra keys as sorted ``(token_start, token_end, key)`` spans, and a salt."""

    ids: tuple[int, ...]
    extra_keys: tuple[tuple[int, int, str], ...] = ()
    salt: str | None = None

    def prefix(self, n: int) -> "CacheKey":
        """The key of the first n tokens (extra-key spans that start before n are kept)."""
        return CacheKey(self.ids[:n], tuple(s for s in self.extra_keys if s[0] < n), self.salt)

    def namespace_at(self, n: int) -> tuple:
        """Everything besides ids that decides whether KV of the first n tokens is reusable."""
        return (self.salt, tuple(s for s in self.extra_keys if s[0] < n))

    def symbols(self) -> tuple:
        """One symbol per token: the id, or ``(id, tag)`` from the first position whose namespace
        differs from the empty one, the tag a digest of the salt and the extra keys seen so far.
        Two keys share a symbol prefix exactly as far as their KV is interchangeable."""
        marks = list(self.extra_keys)
        if not marks and self.salt is None:
            return self.ids
        seen = [] if self.salt is None else [f"salt:{self.salt}"]
        tag = _tag(seen) if seen else None
        out, j = [], 0
        for i, t in enumerate(self.ids):
            while j < len(marks) and marks[j][0] <= i:
                seen.append(str(marks[j][2]))
                tag = _tag(seen)
                j += 1
            out.append(t if tag is None else (t, tag))
        return tuple(out)

    def block_hashes(self, block_size: int, n: int | None = None, *, algo: str = "xxh3_128") -> list[bytes]:
        """vLLM's chained hashes of the full blocks of the first ``n`` tokens (all by default):
        an extra key joins every block its span overlaps; the salt joins block 0."""
        ids = self.ids if n is None else self.ids[:n]
        return block_hashes(ids, block_size, extra_keys=self.extra_keys or None, salt=self.salt,
                            algo=algo)

    def digest(self, n: int | None = None) -> str:
        """xxh3_128 hex of the first ``n`` ids and their namespace: equal digests, reusable KV."""
        n = len(self.ids) if n is None else n
        h = xxhash.xxh3_128()
        h.update(repr((self.ids[:n], self.namespace_at(n))).encode())
        return h.hexdigest()

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        extra = f", {len(self.extra_keys)} extra keys" if self.extra_keys else ""
        salt = f", salt={self.salt!r}" if self.salt else ""
        return f"CacheKey({len(self.ids)} ids{extra}{salt})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def cache_key(tokens: Tokens, *, extra_keys=(), salt: str | None = None,
              image_keys: bool = True) -> CacheKey:
    """The key of a rendered prompt: its ids, its images' content hashes over their placeholder
    spans (unless ``image_keys=False``, to show what keying by ids alone does), any further
    ``extra_keys`` spans and the salt.

    Example:
        >>> cache_key(kv.tokenise(m, "hello"), salt="bob").salt
        'bob'
    """
    spans = list(extra_keys)
    if image_keys:
        spans += [(im.token_start, im.token_end, im.hash) for im in tokens.images]
    checked = []
    for s in spans:
        if not (isinstance(s, (tuple, list)) and len(s) == 3 and isinstance(s[0], int)
                and isinstance(s[1], int) and 0 <= s[0] < s[1]):
            raise TokenIdError(f"extra key {s!r:.60} must be (token_start, token_end, key) with "
                               "0 <= token_start < token_end")
        checked.append((int(s[0]), int(s[1]), str(s[2])))
    if salt is not None and not isinstance(salt, str):
        raise TokenIdError(f"salt must be a str or None, got {type(salt).__name__}")
    return CacheKey(tuple(tokens.ids), tuple(sorted(checked)), salt)


def _tag(seen: list[str]) -> str:
    return xxhash.xxh3_64_hexdigest("|".join(seen).encode())
