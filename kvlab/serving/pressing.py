"""What kvlab's server does with a press (``kvlab serve --press NAME:RATIO``, ``kvlab.compressing``):
the adapter's side of it, kept apart from the adapter's plain prompt-cache calls.

A fresh prompt's context (the prompt before its last message, message spans recovered from ChatML
markers) is looked up whole in the request's namespace through the reuse core, else compressed
now and offered whole; mlx-lm then runs the rest on the compressed cache. mlx-lm's own inserts
(segment ends, prompt + output) hold compressed rows under plain ids and are refused, with an
event saying so. mlx-lm counts the context as cached tokens either way: the lookup's ``press_tokens``
lets the generator correct that to what was reused (``kvlab.serving.generator``).

Example:
    >>> adapter = StoreAdapter(kv.make_store("radix"), m, ServerEvents(), press=kv.press("knorm", 0.5))
    >>> cache, rest = adapter.fetch_nearest_cache(None, ids)      # compressed context, the question
"""

from __future__ import annotations

from ..compressing import compress_context, context_end_of, press_key
from ..primitives.tokens import from_ids


class Pressing:
    """The press side of ``StoreAdapter`` (module docstring); ``press`` None: no press."""

    press = None

    def compressed(self, rid, ids) -> tuple[list, list]:
        """(compressed cache, ids still to run): the context restored whole, or compressed now and
        offered (a request no tenant owns: compressed, never looked up or stored)."""
        toks = from_ids(ids, self.model.tokenizer, chatml_spans=True)
        end = context_end_of(toks)
        key = self.key_for(rid, toks)
        cache, reused = None, 0
        if key is not None:
            key = press_key(key, self.press, end)
            cache, reused = self.lookup(rid, toks, key, limit=end, whole=True)
        if reused != end:
            cache = compress_context(self.model, ids, end, self.press, {}).cache
            if self.press.reusable and key is not None:
                self.offer(rid, toks, key.prefix(end), cache, ids[:end], cache_type="user", kind="compressed")
        if rid is not None and rid in self.requests:
            self.requests[rid]["press_tokens"] = end  # mlx-lm counts them as cached; they were not
        return cache, ids[end:]

    def compressed_offer(self, rid, tokens, cache_type: str) -> None:
        """mlx-lm's own insert of a compressed cache: refused (its context was offered whole when it
        was compressed); a request's last one still releases it."""
        self.events.add("offer_refused", request=rid, tokens=len(tokens), segment=cache_type,
                        detail=f"compressed by {self.press.key}: only the compressed context is stored")
        if cache_type == "assistant":
            self.finishing_rid = self.finishing_space = None
            self.final_offered(rid)
