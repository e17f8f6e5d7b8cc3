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
    ``kv_real_wfile``), ``stream``, ``started``, ``error`` and implement ``keepalive()`` (a
    streamed answer's reply to mlx-lm's keepalive), ``chunk(obj)`` and ``done()``."""

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

    def keepalive(self, comment: str) -> None:
        raise NotImplementedError

    def chunk(self, obj: dict) -> None:
        raise NotImplementedError

    def done(self) -> None:
        raise NotImplementedError
