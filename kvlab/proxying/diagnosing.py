"""Cache diagnostics from the client side: what the proxy says about each request, and the
providers' diagnostics objects it adds to a response when the client asks for them.

Every row gets a ``diagnosis`` (``structural``): the request it extends compared with it by
kvlab.diagnostics (model, system, tools, settings, messages: Anthropic's type and OpenAI's
reason), plus the names of the fields that changed inside the system prompt (kvlab's volatile-
field rules: a billing header's ``cch``, a timestamp), so a row says *why* its prompt parted where
it did, beside the cached tokens the upstream reported.

A client asks as it would ask the provider: ``diagnostics: {"previous_message_id": ...}`` on
``/v1/messages`` (``null`` opts in on the first turn), ``prompt_cache_options:
{"comparison_response_id": ...}`` on ``/v1/chat/completions`` and ``/v1/responses``. The request
goes upstream unchanged; the object is computed against the earlier response of that id (its
request as this proxy saw it, kept in a ``FingerprintLog`` of the last ``history`` responses)
and put where the provider puts it: in a JSON response at the top level (``diagnostics`` /
``prompt_cache_diagnostics``); streaming, on Anthropic's ``message_start`` event (its
``message``), on the first chunk of a chat completion stream, on ``response.completed``'s
``response`` for the Responses API (where OpenAI's guide reads it). An id the proxy does not
know (another proxy's, or forgotten) answers the providers' not-found type. Anthropic's null (no
divergence) has no room for kvlab's detail: it then goes in a ``kvlab_diagnostics`` field beside.
An upstream that answers diagnostics itself (kvlab serve) has both fields replaced: the client
asked the proxy, which answers from what it saw.
``cached_tokens`` in the ``kvlab`` extension is what the upstream reported for this request,
when it is known where the object is written (Anthropic's message_start carries it; a chat
stream's first chunk does not: None there, see ``GET /kvlab/requests``).

Example:
    >>> asked("/v1/messages", b'{"diagnostics": {"previous_message_id": "msg_1"}}', {})
    Asked(anthropic, previous 'msg_1')
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from .. import diagnostics as dx
from ..errors import DiagnosticsError, KvlabError
from ..primitives.display import summary_html
from ..primitives.volatile import volatile_fields

log = logging.getLogger("kvlab.proxy")
APIS = {"/v1/messages": "anthropic", "/v1/chat/completions": "chat", "/v1/responses": "responses"}
FIELDS = {"anthropic": "diagnostics", "chat": "prompt_cache_diagnostics", "responses": "prompt_cache_diagnostics"}


@dataclass(frozen=True)
class Asked:
    """A client's request for diagnostics: the ``api`` it came on and the id it names (None:
    Anthropic's first-turn opt-in)."""

    api: str
    previous_id: str | None

    @property
    def provider(self) -> str:
        return "anthropic" if self.api == "anthropic" else "openai"

    def __repr__(self) -> str:
        return f"Asked({self.api}, previous {self.previous_id!r})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def asked(route: str, raw: bytes, headers) -> Asked | None:
    """What the request asks for, read from its body before it is forwarded; None when it asks
    nothing (or is not JSON: the upstream says what is wrong with it). A malformed diagnostics
    object raises ``DiagnosticsError`` (the proxy answers 400 and forwards nothing)."""
    api = APIS.get(route)
    if api is None or not raw:
        return None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if api == "anthropic":
        wants, previous = dx.anthropic_request(body, dict(headers or {}))
    else:
        wants, previous = dx.openai_request(body)
    return Asked(api, previous) if wants else None


def shape(ex):
    """The request's structure (kvlab.diagnostics.PromptShape), None when its body is unreadable."""
    api = APIS.get(ex.route)
    body = ex.prompt.body
    if api is None or not isinstance(body, dict):
        return None
    try:
        return dx.shape_of(body, api)
    except KvlabError:
        return None


def structural(previous, current) -> dict | None:
    """The row's diagnosis: ``current`` (an Exchange) against the earlier one it extends."""
    a, b = shape(previous), shape(current)
    if a is None or b is None:
        return None
    c = dx.compare(a, b)
    out = {"type": dx.anthropic_type(c), "openai_reason": dx.openai_reason(c), "changed": list(c.changed),
           "description": c.describe()}
    if "system_changed" in c.changed and a.system and b.system:
        try:
            out["volatile_fields"] = [f.name for f in volatile_fields([a.system, b.system])]
        except KvlabError:
            pass
    return out


def answer(fingerprints: dx.FingerprintLog, tracker, ex, question: Asked, cached_tokens: int | None) -> tuple:
    """(the provider's object, kvlab's detail to put beside a null) for ``ex``: ``dx.diagnose``
    against the remembered response, with ``cached_tokens`` (the upstream's report, None if not
    known yet) in the ``kvlab`` extension. A failure answers the providers' ``unavailable``: the
    response itself must get through."""
    try:
        return _answer(fingerprints, tracker, ex, question, cached_tokens)
    except Exception as e:  # noqa: BLE001
        log.warning("kvlab proxy: no diagnostics for request %s: %s", ex.id, e, exc_info=True)
        return (dx.anthropic_unavailable() if question.provider == "anthropic" else dx.openai_unavailable()), None


def _answer(fingerprints, tracker, ex, question, cached_tokens):
    current = shape(ex)
    if current is None:
        return (dx.anthropic_unavailable() if question.provider == "anthropic" else dx.openai_unavailable()), None
    tokens = tracker.tokens(ex) if tracker.tokenizer is not None else None
    return dx.answer(fingerprints, question.previous_id, current, tokens, cached_tokens=cached_tokens,
                     provider=question.provider)


def remember(fingerprints: dx.FingerprintLog, tracker, ex, response_id: str | None, owner=None) -> None:
    """Keep ``ex`` (shape and rendered tokens) under its response id, for later comparisons
    (``owner``: its user; another user's requests never find it)."""
    s = shape(ex)
    if response_id and s is not None:
        fingerprints.remember(response_id, s, tracker.tokens(ex) if tracker.tokenizer is not None else None,
                              owner=owner)


def put(api: str, target: dict, answered: tuple) -> None:
    """Write ``answer(...)``'s pair into a response object ``target`` where the provider puts it."""
    obj, beside = answered
    target[FIELDS[api]] = obj
    target.pop("kvlab_diagnostics", None)  # an upstream's own (kvlab serve's): the proxy answers instead
    if beside is not None:
        target["kvlab_diagnostics"] = beside


def json_object(data: bytes) -> dict | None:
    """``data`` parsed, if it is a JSON object; None for anything else (passed on as it came).

    Example:
        >>> json_object(b'{"a": 1}'), json_object(b"[1]"), json_object(b"not json")
        ({'a': 1}, None, None)
    """
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


def inject_body(api: str, data: bytes, make) -> bytes:
    """A JSON response with the object added at its top level; ``make(cached_tokens)`` computes
    it (``answer``'s pair) once the body's usage is read. A body that is not a JSON object is returned as it came."""
    body = json_object(data)
    if body is None:
        return data
    put(api, body, make(_cached(api, body)))
    return json.dumps(body).encode()


class StreamInjector:
    """Rewrites one SSE event of a stream (module docstring says which) and passes every other
    byte through as it comes: ``feed(chunk) -> bytes to send now``; ``flush()`` at the end."""

    def __init__(self, api: str, make):
        self.api, self.make = api, make
        self.done = False
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        if self.done:
            return chunk
        self._held += chunk
        out = b""
        while not self.done:
            end = self._held.find(b"\n\n")
            if end < 0:
                return out
            event, self._held = self._held[:end + 2], self._held[end + 2:]
            out += self._event(event)
        out, self._held = out + self._held, b""
        return out

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        return held

    def _event(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            try:
                data = json.loads(line[5:].strip())
            except (ValueError, UnicodeDecodeError):
                return event
            target = self._target(data)
            if target is None:
                return event
            put(self.api, target, self.make(_cached(self.api, target)))
            self.done = True
            lines[i] = b"data: " + json.dumps(data).encode()
            return b"\n".join(lines)
        return event

    def _target(self, data):
        if not isinstance(data, dict):
            return None
        if self.api == "anthropic":
            return data.get("message") if data.get("type") == "message_start" else None
        if self.api == "responses":
            return data.get("response") if data.get("type") == "response.completed" else None
        return data  # a chat stream: its first chunk

    def __repr__(self) -> str:
        return f"StreamInjector({self.api}, {'written' if self.done else 'waiting'})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)


def _cached(api: str, obj: dict) -> int | None:
    """The cached prompt tokens an upstream's response object reports, None if it says nothing."""
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    if api == "anthropic":
        n = usage.get("cache_read_input_tokens")
    else:
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        n = details.get("cached_tokens") if isinstance(details, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


__all__ = ["APIS", "Asked", "DiagnosticsError", "StreamInjector", "answer", "asked", "inject_body", "json_object", "put",
           "remember", "shape", "structural"]
