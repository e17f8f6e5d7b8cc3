"""The base of a writer that stands in for mlx-lm's handler output (``wfile``) while it serves a
translated request, and answers in another API's shape (Anthropic Messages, OpenAI Responses).

mlx-lm always streams the translated chat request; the writer reads its SSE events: a comment
(mlx-lm's prefill keepalive), a chat chunk, or ``[DONE]``. An error status keeps the body whole
(``error``) for the subclass to translate.
"""

from __future__ import annotations

import json


class ChatStreamWriter:
    """``write``/``flush`` as a file; subclasses set ``h`` (the handler: ``kv_status``,
    ``kv_real_wfile``), ``stream``, ``started``, ``error``, ``output_tokens`` and implement the
    hooks below: ``keepalive`` (a streamed answer's reply to mlx-lm's keepalive), the deltas,
    the finish reason, and ``done`` ([DONE])."""

    def write(self, data: bytes) -> int:
        if self.h.kv_status != 200:
            self.error += bytes(data)
            return len(data)
        for event in bytes(data).decode("utf-8").split("\n\n"):
            event = event.strip()
            if event.startswith(":"):  # mlx-lm's prefill keepalive: an SSE comment clients skip
                if self.stream:
                    self.keepalive(event)
            elif event.startswith("data: "):
                payload = event[len("data: "):]
                if payload == "[DONE]":
                    self.done()
                else:
                    self.chunk(json.loads(payload))
        return len(data)

    def flush(self) -> None:
        if self.started and self.stream:
            self.h.kv_real_wfile.flush()

    def chunk(self, chunk: dict) -> None:
        """One chat chunk: its usage into ``output_tokens``, each delta to the hooks."""
        if chunk.get("usage"):
            self.output_tokens = int(chunk["usage"].get("completion_tokens", 0))
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                self.reasoning(delta["reasoning"])
            if delta.get("content"):
                self.content(delta["content"])
            for call in delta.get("tool_calls") or []:
                self.tool_call(call)
            if choice.get("finish_reason"):
                self.finished_with(choice["finish_reason"])

    # -- what a subclass answers with -------------------------------------------------------------
    def keepalive(self, comment: str) -> None:
        raise NotImplementedError

    def reasoning(self, text: str) -> None:
        raise NotImplementedError

    def content(self, text: str) -> None:
        raise NotImplementedError

    def tool_call(self, call: dict) -> None:
        raise NotImplementedError

    def finished_with(self, finish_reason: str) -> None:
        raise NotImplementedError

    def done(self) -> None:
        raise NotImplementedError
