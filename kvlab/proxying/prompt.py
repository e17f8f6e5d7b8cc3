"""What a proxied request asks the model to read: its body turned into chat messages (or text) the
way the upstream renders it, so the proxy can tokenise the same prompt on the client side.

Routes: OpenAI chat (``messages``, ``tools``, ``chat_template_kwargs``), OpenAI completions
(``prompt``: text or token ids), Anthropic Messages (``system`` + ``messages`` through
kvlab.serving.anthropic's ``to_chat``, as ``kvlab serve`` renders them) and OpenAI Responses
(``instructions`` + ``input``). Content lists keep their text parts joined, as mlx-lm's server does.

Example:
    >>> p = prompt_of("/v1/messages", {"model": "m", "max_tokens": 8, "system": "Be brief.",
    ...                                "messages": [{"role": "user", "content": "Hi"}]})
    >>> p.kind, [m["role"] for m in p.messages]
    ('anthropic', ['system', 'user'])
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from ..serving.anthropic import MessagesError, to_chat

KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
         "/v1/messages": "anthropic", "/v1/responses": "responses"}


@dataclass(frozen=True)
class Prompt:
    """A request's prompt: chat ``messages`` (OpenAI form, system first) or ``text`` / ``ids`` for
    completions, the chat template's keyword arguments, and the parsed ``body``. ``messages``,
    ``text`` and ``ids`` are all None when the body could not be read (``problem`` says why)."""

    kind: str
    messages: tuple | None = None
    text: str | None = None
    ids: tuple | None = None
    template_kwargs: dict = field(default_factory=dict)
    body: dict | None = None
    problem: str = ""

    @property
    def readable(self) -> bool:
        return self.messages is not None or self.text is not None or self.ids is not None

    def structure(self) -> tuple[str, ...]:
        """One hash per rendered message (the template's tools folded into the first), or one for
        the whole text: what the proxy compares when it has no tokenizer."""
        if self.messages is not None:
            head = _digest(self.template_kwargs.get("tools"))
            return tuple(_digest([head, m]) if i == 0 else _digest(m) for i, m in enumerate(self.messages))
        if self.readable:
            return (_digest(self.text if self.text is not None else list(self.ids)),)
        return ()

    def __repr__(self) -> str:
        what = (f"{len(self.messages)} messages" if self.messages is not None else
                "text" if self.text is not None else f"{len(self.ids)} ids" if self.ids else self.problem)
        return f"Prompt({self.kind}, {what})"

    def _repr_html_(self) -> str:
        from ..primitives.display import summary_html

        return summary_html(repr(self), code=True)


def prompt_of(route: str, body) -> Prompt:
    """The prompt of a request to ``route`` with JSON ``body`` (module docstring).

    Example:
        >>> prompt_of("/v1/completions", {"prompt": "Once upon"}).text
        'Once upon'
    """
    kind = KINDS.get(route, "other")
    if not isinstance(body, dict):
        return Prompt(kind, problem="the body is not a JSON object")
    try:
        if kind == "chat":
            return _chat(body, kind)
        if kind == "anthropic":
            return _chat(to_chat(body), kind, body)
        if kind == "responses":
            return _responses(body)
        if kind == "completions":
            p = body.get("prompt")
            if isinstance(p, str):
                return Prompt(kind, text=p, body=body)
            if isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
                return Prompt(kind, ids=tuple(p), body=body)
            return Prompt(kind, body=body, problem="prompt is neither text nor a list of token ids")
    except (MessagesError, TypeError, KeyError, AttributeError, ValueError) as e:
        return Prompt(kind, body=body, problem=f"cannot read the request: {e}")
    return Prompt(kind, body=body, problem=f"no prompt on route {route}")


def _chat(chat: dict, kind: str, body: dict | None = None) -> Prompt:
    msgs = chat.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return Prompt(kind, body=body or chat, problem="messages is not a non-empty list")
    messages = tuple(_flat(m) for m in msgs)
    kwargs = dict(chat.get("chat_template_kwargs") or {})
    if chat.get("tools"):
        kwargs["tools"] = chat["tools"]
    return Prompt(kind, messages=messages, template_kwargs=kwargs, body=body or chat)


def _flat(m) -> dict:
    """A message with its content as one string (text parts joined, as mlx-lm's server does)."""
    if not isinstance(m, dict):
        raise ValueError(f"a message must be an object, got {m!r:.60}")
    out = dict(m)
    content = out.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):
        out["content"] = "".join(p.get("text", "") for p in content
                                 if isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text"))
    return out


def _responses(body: dict) -> Prompt:
    msgs = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    given = body.get("input")
    if isinstance(given, str):
        msgs.append({"role": "user", "content": given})
    elif isinstance(given, list):
        msgs += [_flat(item) for item in given if isinstance(item, dict) and "role" in item]
    if not msgs:
        return Prompt("responses", body=body, problem="no instructions or input to read")
    kwargs = {"tools": body["tools"]} if body.get("tools") else {}
    return Prompt("responses", messages=tuple(msgs), template_kwargs=kwargs, body=body)


def _digest(obj) -> str:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()
