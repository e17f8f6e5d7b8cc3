"""Anthropic's Messages API (``POST /v1/messages``) on mlx-lm's chat path.

``to_chat(body)`` turns a Messages request into the OpenAI chat request mlx-lm's handler already
serves: ``system`` (a string or a list of text blocks, joined with newlines, so an agent's billing
header stays the first line of the system prompt) becomes the first message, text blocks become
text, image blocks of user turns (``source`` base64 or url) OpenAI ``image_url`` parts (data
URLs), ``tool_use`` / ``tool_result`` blocks become OpenAI tool calls and tool messages, ``tools``
become functions, ``stop_sequences`` become ``stop``. The chat request always streams with usage,
and a ``MessagesWriter`` stands in for the handler's output: it reads mlx-lm's chunks and writes
Anthropic's response, either one JSON message or the SSE events ``message_start``,
``content_block_start``, ``content_block_delta``, ``content_block_stop``, ``message_delta`` and
``message_stop`` (``ping`` for mlx-lm's prefill keepalives). Usage: ``input_tokens`` is the
prompt minus what the prompt cache served, ``cache_read_input_tokens`` what it served. A request
with a ``diagnostics`` object gets ``diagnostics`` (and kvlab's ``kvlab_diagnostics`` beside a
null) on the message, streamed on ``message_start``'s (kvlab.serving.diagnosing).

Example:
    >>> chat = to_chat({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
    >>> chat["messages"]
    [{'role': 'user', 'content': 'Hi'}]
"""

from __future__ import annotations

import json
import uuid

from ..errors import RequestError
from .chat_stream import ChatStreamWriter

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessagesError(RequestError):
    """A Messages request kvlab cannot serve; ``status`` and ``kind`` as Anthropic reports them."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def error_body(message: str, kind: str = "invalid_request_error") -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}


def _text(blocks, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise MessagesError(f"{where} must be a string or a list of content blocks")
    parts = []
    for b in blocks:
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise MessagesError(f"{where} may hold only text blocks ({{'type': 'text', 'text': ...}})")
        parts.append(b["text"])
    return "\n".join(parts)


def _message(m, i: int) -> list[dict]:
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise MessagesError(f"messages[{i}] must be an object with role 'user' or 'assistant'")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise MessagesError(f"messages[{i}].content must be a string or a list of content blocks")
    text, calls, results, parts = [], [], [], []  # parts: text and images in order, if any image
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            text.append(str(b.get("text", "")))
            parts.append({"type": "text", "text": text[-1]})
        elif kind == "image" and m["role"] == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(b.get("source"), i, j)}})
        elif kind == "tool_use" and m["role"] == "assistant":
            calls.append({"id": b.get("id", f"call_{j}"), "type": "function",
                          "function": {"name": b.get("name", ""), "arguments": json.dumps(b.get("input", {}))}})
        elif kind == "tool_result" and m["role"] == "user":
            body = b.get("content", "")
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id", ""),
                            "content": body if isinstance(body, str) else _text(body, "tool_result content")})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # chat templates drop earlier reasoning from the history anyway
        else:
            raise MessagesError(f"messages[{i}].content[{j}]: block type {kind!r} is not supported "
                                "by kvlab serve (text, image in user turns, tool_use, tool_result, thinking)")
    out = list(results)
    if len(parts) > len(text):  # images: a list of parts, as OpenAI's chat API takes them
        out.append({"role": m["role"], "content": parts})
    elif text or calls or not results:
        msg = {"role": m["role"], "content": "\n".join(text)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _image_url(source, i: int, j: int) -> str:
    """The URL an image block's ``source`` stands for: ``base64`` -> a data URL, ``url`` as given
    (a web URL is refused later, with the other image checks: kvlab never downloads)."""
    where = f"messages[{i}].content[{j}].source"
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and source["data"]:
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str) and source["url"]:
        return source["url"]
    raise MessagesError(f"{where} must be {{'type': 'base64', 'media_type': 'image/png', 'data': ...}} "
                        "or {'type': 'url', 'url': 'file:///path.png'}")


def to_chat(body) -> dict:
    """The OpenAI chat request (for mlx-lm's handler) equivalent to a Messages request; bad
    requests raise MessagesError saying what is wrong."""
    if not isinstance(body, dict):
        raise MessagesError("the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise MessagesError("messages must be a non-empty list of {'role', 'content'} objects")
    mt = body.get("max_tokens")
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise MessagesError(f"max_tokens must be an integer >= 1, got {mt!r}")
    chat = []
    if body.get("system") is not None:
        chat.append({"role": "system", "content": _text(body["system"], "system")})
    for i, m in enumerate(msgs):
        chat.extend(_message(m, i))
    out = {"model": body.get("model", "default_model"), "messages": chat, "max_tokens": mt,
           "stream": True, "stream_options": {"include_usage": True}}
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            out[key] = body[key]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise MessagesError("stop_sequences must be a list of strings")
        out["stop"] = stops
    if body.get("tools"):
        out["tools"] = [{"type": "function", "function": {
            "name": t.get("name", ""), "description": t.get("description", ""),
            "parameters": t.get("input_schema", {"type": "object"})}} for t in body["tools"]]
    return out


class MessagesWriter(ChatStreamWriter):
    """The handler's ``wfile`` while mlx-lm serves a translated Messages request (module docstring).

    ``handler`` provides ``kv_status`` (what mlx-lm set), ``kv_send_headers(code, headers)``,
    ``kv_real_wfile``, ``kv_usage()`` -> (prompt tokens, cached tokens) and ``kv_diagnostics()``
    -> the diagnostics fields to add to the message (read once, before its first byte)."""

    def __init__(self, handler, *, stream: bool, model: str):
        self.h, self.stream, self.model = handler, bool(stream), model
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.blocks: list[dict] = []
        self.open: str | None = None
        self.stop_reason = None
        self.output_tokens = 0
        self.started = self.finished = False
        self.error = b""
        self.extra: dict = {}  # the diagnostics fields, if the request asked

    # -- what mlx-lm writes -----------------------------------------------------------------------
    def keepalive(self, comment: str) -> None:
        self._start()
        self._send("ping", {"type": "ping"})

    def done(self) -> None:
        self._finish_message()

    def reasoning(self, text: str) -> None:
        self._delta("thinking", {"type": "thinking_delta", "thinking": text})

    def content(self, text: str) -> None:
        self._delta("text", {"type": "text_delta", "text": text})

    def tool_call(self, call: dict) -> None:
        self._tool(call)

    def finished_with(self, finish_reason: str) -> None:
        self.stop_reason = STOP_REASONS.get(finish_reason, "end_turn")

    # -- Anthropic's side -------------------------------------------------------------------------
    def _usage(self) -> dict:
        prompt, cached = self.h.kv_usage()
        return {"input_tokens": max(0, prompt - cached), "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0, "output_tokens": self.output_tokens}

    def _message(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.blocks, "stop_reason": self.stop_reason, "stop_sequence": None,
                "usage": self._usage(), **self.extra}

    def _start(self) -> None:
        if self.started:
            return
        self.started = True
        self.extra = self.h.kv_diagnostics()
        if self.stream:
            self.h.kv_send_headers(200, [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")])
            self._send("message_start", {"type": "message_start",
                                         "message": {**self._message(), "content": [], "stop_reason": None}})

    def _send(self, event: str, data: dict) -> None:
        self.h.kv_real_wfile.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())

    def _open_block(self, kind: str, block: dict) -> None:
        self._start()
        if self.open is not None:
            self._close_block()
        self.blocks.append(block)
        self.open = kind
        if self.stream:
            start = {**block, "text": ""} if kind == "text" else (
                {**block, "thinking": ""} if kind == "thinking" else {**block, "input": {}})
            self._send("content_block_start", {"type": "content_block_start",
                                               "index": len(self.blocks) - 1, "content_block": start})

    def _close_block(self) -> None:
        if self.open is not None and self.stream:
            self._send("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})
        self.open = None

    def _delta(self, kind: str, delta: dict) -> None:
        if self.open != kind:
            self._open_block(kind, {"type": kind, kind: ""})
        field = "text" if kind == "text" else "thinking"
        self.blocks[-1][field] += delta[field]
        if self.stream:
            self._send("content_block_delta", {"type": "content_block_delta",
                                               "index": len(self.blocks) - 1, "delta": delta})

    def _tool(self, call: dict) -> None:
        fn = call.get("function", {})
        args = fn.get("arguments", {})
        inp = json.loads(args) if isinstance(args, str) and args else (args or {})
        self._open_block("tool_use", {"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:20]}",
                                      "name": fn.get("name", ""), "input": inp})
        if self.stream:
            self._send("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                               "delta": {"type": "input_json_delta",
                                                         "partial_json": json.dumps(inp)}})
        self._close_block()

    def _finish_message(self) -> None:
        self._start()
        self._close_block()
        self.finished = True
        if self.stream:
            self._send("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": self.stop_reason or "end_turn",
                                                   "stop_sequence": None},
                                         "usage": {"output_tokens": self.output_tokens}})
            self._send("message_stop", {"type": "message_stop"})
            self.h.kv_real_wfile.flush()

    def close(self) -> None:
        """After mlx-lm's handler returns: send the whole message (non-streaming) or the error."""
        if self.h.kv_status != 200 or (not self.finished and not self.started):
            status = self.h.kv_status if self.h.kv_status != 200 else 500
            try:
                message = json.loads(self.error or b"{}").get("error", "") or "generation failed"
            except ValueError:
                message = self.error.decode(errors="replace") or "generation failed"
            body = json.dumps(error_body(str(message), "invalid_request_error" if status < 500
                                         else "api_error")).encode()
            self.h.kv_send_headers(status, [("Content-Type", "application/json"),
                                            ("Content-Length", str(len(body)))])
            self.h.kv_real_wfile.write(body)
        elif not self.stream:
            self.stop_reason = self.stop_reason or "end_turn"
            body = json.dumps(self._message()).encode()
            self.h.kv_send_headers(200, [("Content-Type", "application/json"),
                                         ("Content-Length", str(len(body)))])
            self.h.kv_real_wfile.write(body)
        self.h.kv_real_wfile.flush()
