"""Watching a response go by: the usage the upstream reported (prompt, cached and output tokens),
when the first output arrived and why generation stopped, read from a JSON body or from an SSE
stream fed chunk by chunk (chunks split events anywhere; the watcher keeps the partial tail).

Cached tokens are read where each API reports them: OpenAI chat and completions
``usage.prompt_tokens_details.cached_tokens`` (in a stream: the final usage chunk, sent when the
client asked for ``stream_options.include_usage``), Anthropic ``usage.cache_read_input_tokens``
(in a stream: ``message_start``, updated by ``message_delta``), OpenAI Responses
``usage.input_tokens_details.cached_tokens`` (in a stream: ``response.completed``).

Example:
    >>> w = Watch()
    >>> w.feed(b'data: {"choices":[{"delta":{"content":"Hi"}}]}\\n\\ndata: {"choices":[],"usage":'
    ...        b'{"prompt_tokens":9,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":4}}}\\n\\n')
    True
    >>> w.prompt_tokens, w.cached_tokens, w.output_tokens
    (9, 4, 1)
"""

from __future__ import annotations

import json


class Watch:
    """What one response reported (module docstring). ``feed`` returns True when the chunk held
    the response's first output (text, reasoning or a tool call)."""

    def __init__(self):
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.output_tokens: int | None = None
        self.finish_reason: str | None = None
        self.id: str | None = None
        self.events = 0
        self.outputs = 0  # events that carried output: the token count when usage is missing
        self._tail = b""

    # -- feeding ----------------------------------------------------------------------------------
    def feed(self, chunk: bytes) -> bool:
        """Read one chunk of an SSE stream; True if it held the first output."""
        before = self.outputs
        data = (self._tail + chunk).replace(b"\r\n", b"\n")
        *events, self._tail = data.split(b"\n\n")
        for event in events:
            self._event(event)
        return before == 0 and self.outputs > 0

    def body(self, data: bytes) -> None:
        """Read a whole (non-streaming) JSON response."""
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return
        if isinstance(obj, dict):
            self._object(obj)
            if any(_has_output(c) for c in obj.get("choices") or []) or obj.get("content") or obj.get("output"):
                self.outputs += 1

    def _event(self, event: bytes) -> None:
        lines = [ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
        if not lines:
            return  # a comment (keepalive) or an empty event
        payload = b"\n".join(lines)
        if payload == b"[DONE]":
            return
        self.events += 1
        try:
            obj = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            return
        if isinstance(obj, dict):
            self._object(obj)

    # -- one JSON object: a chunk, an event or a whole response -----------------------------------
    def _object(self, obj: dict) -> None:
        kind = obj.get("type")
        if kind == "message_start":
            obj = obj.get("message") or {}
        elif kind in ("response.completed", "response.incomplete", "response.created"):
            obj = obj.get("response") or {}
        elif kind == "message_delta":
            self.finish_reason = (obj.get("delta") or {}).get("stop_reason") or self.finish_reason
        elif kind == "content_block_delta" or (isinstance(kind, str) and kind.startswith("response.")
                                               and kind.endswith(".delta")):
            self.outputs += 1
        self.id = self.id or (obj.get("id") if isinstance(obj.get("id"), str) else None)
        for choice in obj.get("choices") or []:
            if _has_output(choice):
                self.outputs += 1
            if isinstance(choice, dict) and choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if obj.get("stop_reason"):
            self.finish_reason = obj["stop_reason"]
        if isinstance(obj.get("status"), str) and kind in ("response.completed", "response.incomplete"):
            self.finish_reason = obj["status"]
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self._usage(usage)

    def _usage(self, u: dict) -> None:
        if "prompt_tokens" in u or "completion_tokens" in u:  # OpenAI chat and completions
            self.prompt_tokens = _int(u.get("prompt_tokens"), self.prompt_tokens)
            self.output_tokens = _int(u.get("completion_tokens"), self.output_tokens)
            self.cached_tokens = _int((u.get("prompt_tokens_details") or {}).get("cached_tokens"),
                                      self.cached_tokens)
        elif "input_tokens_details" in u or "total_tokens" in u:  # OpenAI Responses
            self.prompt_tokens = _int(u.get("input_tokens"), self.prompt_tokens)
            self.output_tokens = _int(u.get("output_tokens"), self.output_tokens)
            self.cached_tokens = _int((u.get("input_tokens_details") or {}).get("cached_tokens"),
                                      self.cached_tokens)
        else:  # Anthropic: input_tokens excludes what was read from or written to the cache
            if "input_tokens" in u:
                parts = [u.get(k) or 0 for k in ("input_tokens", "cache_read_input_tokens",
                                                 "cache_creation_input_tokens")]
                self.prompt_tokens = sum(int(p) for p in parts)
            self.cached_tokens = _int(u.get("cache_read_input_tokens"), self.cached_tokens)
            self.output_tokens = _int(u.get("output_tokens"), self.output_tokens)

    def __repr__(self) -> str:
        return (f"Watch(prompt {self.prompt_tokens}, cached {self.cached_tokens}, "
                f"output {self.output_tokens}, {self.events} events)")

    def _repr_html_(self) -> str:
        from ..primitives.display import summary_html

        return summary_html(repr(self), code=True)


def _has_output(choice) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta") or choice.get("message") or {}
    return bool(choice.get("text") or delta.get("content") or delta.get("reasoning")
                or delta.get("reasoning_content") or delta.get("tool_calls"))


def _int(value, default):
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default
