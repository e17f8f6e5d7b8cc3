"""Serving a vision-language model: each request runs alone on mlx-lm's generation thread.

A VLM request cannot join mlx-lm's ``BatchGenerator``: the model is bound per request
(``vlm.for_request(tokens)`` embeds that request's image features and M-RoPE positions). So a
served VLM is never batchable (``KvlabModelProvider``), mlx-lm's loop hands every request to its
sequential path, and ``KvlabResponseGenerator._serve_single`` gives it to :class:`VLMRequests`,
which does what mlx-lm's ``_serve_single`` does, with kvlab's pieces (``kvlab.serving.sequential``):

- the messages (OpenAI ``image_url`` parts: ``data:`` URLs, ``file://`` URLs and local paths; an
  Anthropic image block arrives translated to one) are tokenised by ``vlm.tokenise`` (images
  expanded to their placeholders, each keyed by the sha256 of its decoded pixels);
- the key is ``kv.cache_key(tokens)``, exactly the Engine's: ids plus each image's pixel hash over
  its placeholder span (and, on a server of tenants, the request's tenant salt: kvlab.tenants), so a text-only request reuses a shared system prompt, an image request
  reuses past an image only for the same pixels (vllm-mlx#718), and no answer changes;
- lookup and offers go through the StoreAdapter, i.e. the reuse core the Engine runs: restore,
  prefill to the checkpoint positions of ``--checkpoints`` (offering a snapshot at each; none inside
  an image whose tokens see each other), the rest of the prompt but its last token through kvlab's
  prefill (such an image runs in one chunk: mlx-lm's chunks could cut it), then mlx-lm's own
  ``stream_generate`` over the bound model from the last prompt token, then prompt + output is
  offered;
- the ledger, events and diagnostics see the same queue items a text request produces.

VLM requests are therefore not continuously batched: they are served one after another in
arrival order. Bad input (an unreadable image, an http URL, a prompt over the context) raises
RequestError, which the handler answers with 400.

Example:
    >>> with kv.serve("tiny-vlm", "radix") as server:   # OpenAI and Anthropic routes with images
    ...     server.model.kind
    'vlm'
"""

from __future__ import annotations

from ..errors import KvlabError, RequestError
from ..keys import cache_key
from .sequential import SequentialRequests


class VLMRequests(SequentialRequests):
    """Runs VLM requests one at a time through the StoreAdapter (module docstring)."""

    def __init__(self, model, adapter, ledger, checkpoints=None, *, prefill_step_size: int = 2048):
        super().__init__(model, adapter, ledger, checkpoints, prefill_step_size=prefill_step_size)
        self.images = 0

    # -- one request ------------------------------------------------------------------------------
    def tokens(self, request, args):
        """The request's Tokens (images hashed and expanded); RequestError for what cannot be read."""
        template = dict(args.chat_template_kwargs or {})
        try:
            if request.request_type == "chat":
                if request.tools:
                    template["tools"] = request.tools
                return self.model.tokenise([dict(m) for m in request.messages], **template)
            return self.model.tokenise(request.prompt)
        except KvlabError as e:
            raise RequestError(f"{self.model.name} cannot serve this request: {e}") from e
        except Exception as e:  # noqa: BLE001  the chat template refused what the client sent
            raise RequestError(f"the request cannot be rendered by {self.model.name}'s chat template: "
                               f"{type(e).__name__}: {e}") from e

    def prepare(self, rid, request, args):
        toks = self.tokens(request, args)
        prompt = list(toks.ids)
        limit = self.model.context_length
        if limit and len(prompt) + args.max_tokens > limit:
            raise RequestError(f"prompt of {len(prompt)} tokens ({len(toks.images)} images) + max_tokens "
                               f"{args.max_tokens} exceeds the model's context of {limit} tokens; send "
                               "fewer or smaller images, a shorter prompt or a lower max_tokens")
        images = cache_key(toks).extra_keys  # the Engine's key: the images' pixel hashes over their placeholders
        self.ledger.tokenized(rid, prompt, images=images)
        self.adapter.begin(rid, prompt, [prompt])
        key = self.adapter.key_for(rid, toks)  # and the request's tenant's salt
        if key is None:
            raise RequestError("a request no tenant owns cannot be keyed; it was not served")
        self.images += len(toks.images)
        return toks, key, self.model.tokenizer.response_initial_state or "normal"

    def looked_up(self, rid, toks, reused: int) -> None:
        self.adapter.note(rid, image_miss(toks, reused, self.adapter.found(rid)))

    def __repr__(self) -> str:
        return f"VLMRequests({self.model.name}: {self.served} served, {self.images} images, one at a time)"


def image_miss(toks, reused: int, lookup: dict) -> str:
    """Why an image request's reuse stopped at an image: the first image not covered by the reused
    tokens, when the store held the same ids under other image keys (its pixels differ).

    Example:
        >>> image_miss(toks, 20, {"miss_reasons": {"salt_or_extra_keys": 30}})
        'image 0 (tokens 21:27, message 1) differs from the cached one ...'
    """
    if not (lookup.get("miss_reasons") or {}).get("salt_or_extra_keys"):
        return ""
    for i, im in enumerate(toks.images):
        if im.token_end > reused:
            return (f"image {i} (tokens {im.token_start}:{im.token_end}, message {im.message_index}) "
                    f"differs from the cached one at these positions (pixel sha256 {im.hash[:12]}...): "
                    "the same token ids with other pixels, so the KV from its first placeholder on "
                    "is not reused")
    return ""
