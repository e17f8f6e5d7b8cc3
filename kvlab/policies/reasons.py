"""Why a prompt token was not reused: the one vocabulary the simulator and the Engine share.

Every prompt token that is not reused gets exactly one reason. In kvlab's block simulator:

- ``partial_block``: the token lies after the last full block within the first n-1 tokens
  (vLLM hashes full blocks only and always recomputes the last token).
- ``over_capacity``: its block is beyond what the cache can hold at all (the request alone is
  larger than the cache: a hit needs every block before it resident too).
- ``evicted``: its block was cached and has been evicted (``evicted_by``: by which request's
  insertion).
- ``salt_or_extra_keys``: the same token ids were cached under a different salt or extra keys
  (images, LoRA), so the chained hashes differ.
- ``diverged``: the prompt differs from everything cached from here on: the first never-cached
  block of the prompt follows a prefix that was cached with a different continuation.
- ``first_seen``: never cached before, and not a divergence (a new prompt, or one that extends
  a cached prefix).

A block that is resident but after the first missing one (the leading-run rule) inherits the
reason of the nearest missing block before it. ``not_trimmable`` (a hybrid model's cache with no
checkpoint there) belongs to the Engine's stores; it does not arise in the block simulator.

Example:
    >>> MISS_REASONS[:2]
    ('first_seen', 'evicted')
"""

MISS_REASONS = ("first_seen", "evicted", "diverged", "partial_block", "salt_or_extra_keys",
                "over_capacity")
ENGINE_ONLY = ("not_trimmable",)
ALL_REASONS = MISS_REASONS + ENGINE_ONLY
