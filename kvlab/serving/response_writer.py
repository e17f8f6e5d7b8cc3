"""ResponsesWriter: mlx-lm's chat chunks written as OpenAI's Responses API answer.

It stands in for the handler's ``wfile`` while mlx-lm serves a request that
kvlab.serving.responses translated, and writes the Response object (``id`` "resp_...",
``object`` "response", ``status``, ``output`` with a ``message`` item of ``output_text`` or
``function_call`` items, ``usage`` with ``input_tokens_details.cached_tokens`` = what kvlab's
prompt cache served), or, streaming, the SSE events ``response.created``,
``response.in_progress``, then per output item ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` (one per chunk),
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``
(function calls: ``response.function_call_arguments.delta`` / ``.done`` instead of the part
events; a thinking model's reasoning: a ``reasoning`` item with ``reasoning_text`` and
``response.reasoning_text.delta`` / ``.done``, its tokens not counted apart), and last
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut the answer, as
OpenAI does; ``response.failed`` when generation failed after the headers). Every
event has ``type`` and ``sequence_number``; names and nesting follow the openai library's types.

Cache diagnostics hook: ``ResponsesWriter(handler, body, diagnostics=f)``, ``f()`` -> a
``prompt_cache_diagnostics`` object (kvlab.diagnostics) or None. It is asked as the response
starts (``response.created`` / ``response.in_progress`` carry it if it is known by then) and as
it ends (top level of the final Response, streaming or not). ``writer.id`` is the response id a
later request names as ``prompt_cache_options.comparison_response_id``.

Example:
    >>> writer = ResponsesWriter(handler, {"input": "Hi", "stream": True})
    >>> handler.wfile = writer          # mlx-lm's chunks now become Responses events
"""

from __future__ import annotations

import json
import uuid

from ..primitives import timing
from ..primitives.display import summary_html
from .chat_stream import ChatStreamWriter
from .responses import error_body

ITEMS = {"text": "message", "reasoning": "reasoning"}  # the output item a kind of text goes into


class ResponsesWriter(ChatStreamWriter):
    """The handler's ``wfile`` while mlx-lm serves a translated Responses request (module docstring).

    ``handler`` provides ``kv_status`` (what mlx-lm set), ``kv_send_headers(code, headers)``,
    ``kv_real_wfile`` and ``kv_usage()`` -> (prompt tokens, cached tokens); ``body`` is the
    Responses request (echoed fields); ``diagnostics()`` -> the ``prompt_cache_diagnostics``
    object or None (the hook for kvlab.diagnostics).

    Example:
        >>> writer = ResponsesWriter(handler, body, diagnostics=lambda: {"type": "cache_hit"})
        >>> writer.id.startswith("resp_")
        True
    """

    api = "responses"  # the ledger's name for requests this writer answers

    def __init__(self, handler, body: dict, *, diagnostics=None):
        self.h, self.body, self.diagnostics, self.stream = handler, body, diagnostics, bool(body.get("stream"))
        self.id, self.created_at = f"resp_{uuid.uuid4().hex}", int(timing.wall())
        self.output: list[dict] = []
        self.text: dict | None = None  # the message item receiving text, while open
        self.finish_reason, self.output_tokens, self.seq, self.error = None, 0, 0, b""
        self.started = self.finished = False

    def __repr__(self) -> str:
        return f"ResponsesWriter({self.id}, {len(self.output)} output items, {self.status()})"

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)

    # -- what mlx-lm writes -----------------------------------------------------------------------
    def keepalive(self, comment: str) -> None:
        self._start()
        self.h.kv_real_wfile.write(f"{comment}\n\n".encode())

    def done(self) -> None:
        self._finish()

    def reasoning(self, text: str) -> None:
        self._delta(text, "reasoning")

    def content(self, text: str) -> None:
        self._delta(text)

    def tool_call(self, call: dict) -> None:
        self._call(call)

    def finished_with(self, finish_reason: str) -> None:
        self.finish_reason = finish_reason

    # -- OpenAI's side ----------------------------------------------------------------------------
    def status(self) -> str:
        return "in_progress" if not self.finished else "incomplete" if self.finish_reason == "length" else "completed"

    def response(self) -> dict:
        """The Response object as it stands (final once the writer has finished)."""
        b, status = self.body, self.status()
        prompt, cached = self.h.kv_usage()
        out = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
               "model": str(b.get("model", "kvlab")), "output": self.output, "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
               "metadata": b.get("metadata") or {}, "parallel_tool_calls": True, "previous_response_id": None,
               "temperature": b.get("temperature"), "top_p": b.get("top_p"), "tool_choice": "auto",
               "tools": b.get("tools") or [], "text": {"format": {"type": "text"}}, "usage": None}
        if self.finished:
            # cache_write_tokens is OpenAI's explicit-caching count: kvlab serve has none to report
            out["usage"] = {"input_tokens": prompt,
                            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                            "output_tokens": self.output_tokens,
                            "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": prompt + self.output_tokens}
        found = self.diagnostics() if self.diagnostics is not None else None
        if found is not None:
            out["prompt_cache_diagnostics"] = found
        return out

    def _send(self, kind: str, **fields) -> None:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        self.h.kv_real_wfile.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())

    def _start(self) -> None:
        if self.started:
            return
        self.started = True
        if self.stream:
            self.h.kv_send_headers(200, [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")])
            self._send("response.created", response=self.response())
            self._send("response.in_progress", response=self.response())

    def _add(self, item: dict) -> int:
        self._start()
        self._close_text()
        self.output.append(item)
        if self.stream:
            self._send("response.output_item.added", output_index=len(self.output) - 1,
                       item=dict(item, content=[]) if item["type"] != "function_call" else item)
        return len(self.output) - 1

    def _open_part(self, kind: str) -> None:
        if kind == "text":
            part = {"type": "output_text", "text": "", "annotations": []}
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "in_progress"}
        else:
            part = {"type": "reasoning_text", "text": ""}
            item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [], "status": "in_progress"}
        i = self._add(item)
        self.text, item["content"] = item, [part]
        if self.stream:
            self._send("response.content_part.added", item_id=item["id"], output_index=i, content_index=0, part=part)

    def _delta(self, text: str, kind: str = "text") -> None:
        if self.text is None or self.text["type"] != ITEMS[kind]:
            self._open_part(kind)
        self.text["content"][0]["text"] += text
        if self.stream:
            extra = {"logprobs": []} if kind == "text" else {}
            self._send("response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta",
                       item_id=self.text["id"], output_index=len(self.output) - 1, content_index=0, delta=text, **extra)

    def _close_text(self) -> None:
        item, self.text = self.text, None
        if item is None:
            return
        item["status"] = "incomplete" if self.finished and self.finish_reason == "length" else "completed"
        if self.stream:
            i, part = self.output.index(item), item["content"][0]
            done, extra = ("response.output_text.done", {"logprobs": []}) if item["type"] == "message" else \
                ("response.reasoning_text.done", {})
            self._send(done, item_id=item["id"], output_index=i, content_index=0, text=part["text"], **extra)
            self._send("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)
            self._send("response.output_item.done", output_index=i, item=item)

    def _call(self, call: dict) -> None:
        fn = call.get("function", {})
        args = args if isinstance(args := fn.get("arguments", ""), str) else json.dumps(args)
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                "call_id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}", "name": fn.get("name", ""),
                "arguments": ""}
        i = self._add(item)
        item["arguments"], item["status"] = args, "completed"
        if self.stream:
            self._send("response.function_call_arguments.delta", item_id=item["id"], output_index=i, delta=args)
            self._send("response.function_call_arguments.done", item_id=item["id"], output_index=i, arguments=args)
            self._send("response.output_item.done", output_index=i, item=item)

    def _finish(self) -> None:
        self._start()
        if not self.output:
            self._open_part("text")  # an empty answer is still one message, as OpenAI returns it
        self.finished = True
        self._close_text()
        if self.stream:
            final = self.response()
            self._send(f"response.{final['status']}", response=final)
            self.h.kv_real_wfile.flush()

    def close(self) -> None:
        """After mlx-lm's handler returns: send the whole response (non-streaming) or the error."""
        if self.h.kv_status != 200 or not self.finished:
            status = self.h.kv_status if self.h.kv_status != 200 else 500
            try:
                message = json.loads(self.error or b"{}").get("error", "") or "generation failed"
            except ValueError:
                message = self.error.decode(errors="replace") or "generation failed"
            if self.started and self.stream:  # headers are out: the stream ends with a failed response
                code = "server_error" if status >= 500 else "invalid_prompt"
                self._send("response.failed", response=dict(self.response(), status="failed",
                                                             error={"code": code, "message": str(message)}))
            else:
                self._send_json(status, error_body(str(message), "server_error" if status >= 500
                                                   else "invalid_request_error"))
        elif not self.stream:
            self._send_json(200, self.response())
        self.h.kv_real_wfile.flush()

    def _send_json(self, status: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.h.kv_send_headers(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        self.h.kv_real_wfile.write(body)
