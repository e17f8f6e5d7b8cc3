"""KvlabHandler: mlx-lm's ``APIHandler`` extended by subclassing, never copied.

mlx-lm's routes (``/v1/chat/completions``, ``/chat/completions``, ``/v1/completions``,
``/health``) run its own code; ``GET /v1/models`` lists the one model served. Added: an API key
checked before every route (``Authorization: Bearer KEY`` or ``x-api-key: KEY``; 401 with a JSON
error otherwise),
``GET /kvlab/stats``, ``GET /kvlab/events?since=N``, ``GET /kvlab/requests?since=N`` (one row per
finished request: kvlab.serving.diagnosing), the providers' cache diagnostics on chat completions
and ``/v1/messages`` (a malformed diagnostics object is a 400), ``POST /v1/messages`` (Anthropic, see
kvlab.serving.anthropic), ``POST /v1/responses`` (OpenAI Responses, kvlab.serving.responses),
JSON 404s for unknown routes, a 400 for an empty or malformed message
list or an image kvlab will not serve (a web URL, an image to a text model: chat_checks),
kvlab's normalisation of messages (``--normalise``) and a 400 instead of mlx-lm's 404 when a
request is refused for what it asks (a prompt over the context). A request body is read once
here, checked, possibly rewritten, and handed to mlx-lm's ``do_POST`` as if it came off the wire.
A request that generation fails for (mlx-lm's thread died: kvlab.serving.generator) gets a 5xx
with the cause as a JSON error, never a dropped connection: before its headers are out as its
status, after them (a stream) as a final ``data: {"error": ...}`` event.

Tenants (kvlab.tenants, the server's ``tenancy``): the key identifies the caller and its tenant;
its requests are keyed in the tenant's namespace (a ``cache_salt`` in the body, vLLM's field,
subdivides it; one that is not a non-empty string is a 400), and every route that reports on the
cache answers from what its tenant may see: ``/kvlab/requests``, ``/kvlab/events``,
``/kvlab/stats``, the diagnostics, and ``/metrics`` (aggregates; per-tenant series for the admin).

Example:
    >>> handler_class = bind_handler(server)     # a subclass whose ``kv`` is the running server
"""

from __future__ import annotations

import io
import json
import logging
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlsplit

from mlx_lm.server import APIHandler

from ..errors import DiagnosticsError, GenerationError, RequestError
from ..tenants import client_salt, presented_key
from . import anthropic, chat_checks, prometheus, responses
from .response_writer import ResponsesWriter

log = logging.getLogger("kvlab.serving")
CHAT_ROUTES = ("/v1/chat/completions", "/chat/completions")
POST_ROUTES = (*CHAT_ROUTES, "/v1/completions", "/v1/messages", "/v1/responses")
GET_ROUTES = ("/v1/models", "/health", "/kvlab/stats", "/kvlab/events", "/kvlab/requests", "/metrics")


class KvlabHandler(APIHandler):
    """mlx-lm's handler with kvlab's routes and checks (module docstring). ``kv`` is the Server."""

    kv = None
    timeout = 120  # seconds a silent client may hold a connection (socket reads and writes)

    def setup(self):
        super().setup()
        with self.kv._conn_lock:
            self.kv.connections.add(self.connection)  # so stop() can close idle keep-alives

    def finish(self):
        try:
            super().finish()
        finally:
            with self.kv._conn_lock:
                self.kv.connections.discard(self.connection)

    # -- routes -----------------------------------------------------------------------------------
    def do_GET(self):
        route = urlsplit(self.path).path
        if not self._authorised(route):
            return
        caller = self.kv_caller
        if route == "/metrics":  # behind the API key like every route: scrapers send it as a bearer token
            return prometheus.write(self, self.kv.metrics, admin=caller.admin)
        if route == "/kvlab/stats":
            return self._json(200, self.kv.stats(caller))
        if route in ("/kvlab/events", "/kvlab/requests"):
            query = parse_qs(urlsplit(self.path).query)
            try:
                since = int(query.get("since", ["0"])[0])
            except ValueError:
                what = "event" if route == "/kvlab/events" else "request row"
                return self._json(400, _error(f"since must be an integer {what} number"))
            if route == "/kvlab/requests":
                rows = self.kv.ledger.rows_since(since, caller)
                return self._json(200, {"requests": rows, "next": max(since, 0) + len(rows)})
            events = self.kv.events_log.since(since, caller)
            return self._json(200, {"events": events, "next": self.kv.events_log.next_seq})
        if route == "/v1/models":  # mlx-lm's lists the Hugging Face cache (none here) after its headers
            return self._json(200, {"object": "list", "data": [{"id": self.kv.model.name, "object": "model",
                                                                "created": self.created, "owned_by": "kvlab"}]})
        if route in GET_ROUTES:
            return super().do_GET()
        return self._json(404, _error(f"unknown route GET {route}; GET routes: {', '.join(GET_ROUTES)}",
                                      "not_found_error"))

    def do_POST(self):
        route = urlsplit(self.path).path
        if not self._authorised(route):
            return
        if route not in POST_ROUTES:
            return self._json(404, _error(f"unknown route POST {route}; POST routes: "
                                          f"{', '.join(POST_ROUTES)}", "not_found_error"))
        self.kv_rid = self.kv_request = None
        self.kv_anthropic = self.kv_diag = self.kv_live = None
        body = self._read_body()
        try:
            self.kv_space = self.kv.tenancy.namespace(self.kv_caller, client_salt(body))
        except RequestError as e:
            return self._refuse(route, str(e))
        if isinstance(body, dict):
            body.pop("cache_salt", None)  # read here; mlx-lm and the translators never see it
        try:
            if route == "/v1/messages":
                return self._messages(body)
            if route == "/v1/responses":
                return self._responses(body)
            if route in CHAT_ROUTES and isinstance(body, dict):
                problem = self._problem(body.get("messages"))
                if problem:
                    return self._json(400, _error(problem))
                try:
                    self.kv_diag = self.kv.diagnostics.request(body, "chat")
                except DiagnosticsError as e:
                    return self._json(400, _error(str(e)))
            if isinstance(body, dict):
                self._rewrite(body)
            self._forward(body, route)
        finally:
            if self.kv_rid is not None:
                self.kv.ledger.done(self.kv_rid, "disconnected")  # no-op if it finished

    # -- mlx-lm's request factories: open the request in the ledger -------------------------------
    def handle_chat_completions(self):
        request = super().handle_chat_completions()
        api = getattr(self.kv_anthropic, "api", "messages") if self.kv_anthropic else "chat"
        return self._open(request, api, request.messages)

    def handle_text_completions(self):
        request = super().handle_text_completions()
        return self._open(request, "completions", self.body.get("prompt"))

    def _open(self, request, api, messages):
        stream = self.kv_anthropic.stream if self.kv_anthropic is not None else self.stream
        response_id = self.kv_anthropic.id if self.kv_anthropic is not None else self.request_id
        rid = self.kv.ledger.open(api=api, stream=bool(stream), normalised=self.kv.normalise,
                                  messages=messages if self.kv.record_text else None, response_id=response_id,
                                  tenant=self.kv_caller.tenant)
        self.kv.adapter.assign(rid, self.kv_space)  # before mlx-lm's thread can look it up
        request.kvlab_rid, self.kv_rid, self.kv_request = rid, rid, request
        self.kv_live = self.kv.ledger.live(rid)
        return request

    # -- cache diagnostics: computed once, before the response's first byte ------------------------
    def generate_response(self, *args, **kwargs) -> dict:
        resp = super().generate_response(*args, **kwargs)
        if self.kv_anthropic is None and getattr(self, "kv_diag", None) is not None:
            resp.update(self.kv_diagnostics())  # the whole completion, or the first chunk
        return resp

    def kv_diagnostics(self) -> dict:
        """The diagnostics fields for this response, once (kvlab.serving.diagnosing)."""
        pending, self.kv_diag = self.kv_diag, None
        return self.kv.diagnostics.answer(pending, self.kv_live, self.kv_caller)

    # -- headers: kvlab's status for kvlab's refusals, deferred headers for /v1/messages -----------
    def handle_completion(self, request, stop_words):
        self.kv_headers_out = False
        try:
            return super().handle_completion(request, stop_words)
        except (BrokenPipeError, ConnectionResetError):
            raise  # the client left: nobody to answer
        except Exception as e:  # noqa: BLE001  generation failed after mlx-lm said 200
            self._failed(self.response_generator.kv_error(e))

    def _failed(self, err: Exception) -> None:
        status = err.status if isinstance(err, GenerationError) else 500
        log.warning("kvlab serve: request %s failed: %s", self.kv_rid, err)
        if self.kv_headers_out and self.kv_anthropic is None:
            data = json.dumps(_error(str(err), "server_error") | {"status": status})
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()
            return
        self._headers_buffer = []  # mlx-lm's 200 was buffered, never sent
        self.kv_request.kvlab_error = err
        self._set_completion_headers(status)
        self.end_headers()
        # the MessagesWriter reads mlx-lm's own error shape and answers in Anthropic's
        body = {"error": str(err)} if self.kv_anthropic is not None else _error(str(err), "server_error")
        self.wfile.write(json.dumps(body).encode())

    def _set_completion_headers(self, status_code: int = 200):
        err = getattr(self.kv_request, "kvlab_error", None) if getattr(self, "kv_request", None) else None
        if status_code == 404 and isinstance(err, RequestError):
            status_code = 400
        elif status_code in (200, 404) and isinstance(err, GenerationError):
            status_code = err.status
        if getattr(self, "kv_anthropic", None) is not None:
            self.kv_status = status_code
            return
        super()._set_completion_headers(status_code)

    def _set_stream_headers(self, status_code: int = 200):
        if getattr(self, "kv_anthropic", None) is not None:
            self.kv_status = status_code
            return
        super()._set_stream_headers(status_code)

    def end_headers(self):
        if getattr(self, "kv_anthropic", None) is not None and not getattr(self, "kv_sending", False):
            return  # the MessagesWriter sends Anthropic's headers itself
        self.kv_headers_out = True
        super().end_headers()

    def kv_send_headers(self, code: int, headers) -> None:
        self.kv_sending, wfile, self.wfile = True, self.wfile, self.kv_real_wfile
        try:
            self.send_response(code)
            for k, v in headers:
                self.send_header(k, v)
            self.end_headers()
        finally:
            self.kv_sending, self.wfile = False, wfile

    def kv_usage(self) -> tuple[int, int]:
        req = self.kv_request
        return getattr(req, "kvlab_prompt_tokens", 0), max(0, getattr(req, "kvlab_cached", 0))

    # -- internals --------------------------------------------------------------------------------
    def _authorised(self, route: str) -> bool:
        """Identify the caller (``kv_caller``, kvlab.tenants.Caller) by its key; False after a 401."""
        self.kv_caller = self.kv.tenancy.caller(presented_key(self.headers))  # constant time over every key
        if self.kv_caller is not None:
            return True
        msg = "missing or wrong API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
        body = anthropic.error_body(msg, "authentication_error") if route == "/v1/messages" else \
            _error(msg, "authentication_error")
        self._json(401, body)
        return False

    def _refuse(self, route: str, message: str) -> None:
        """A 400 in the route's own error shape."""
        if route == "/v1/messages":
            return self._json(400, anthropic.error_body(message))
        if route == "/v1/responses":
            return self._json(400, responses.error_body(message, param="cache_salt"))
        return self._json(400, _error(message))

    def _read_body(self):
        """The JSON body, read once (None if absent or not JSON: mlx-lm reports those itself)."""
        length = self.headers.get("Content-Length")
        try:
            n = int(length) if length is not None else None
        except ValueError:
            n = None
        self.kv_raw = self.rfile.read(n) if n is not None and n > 0 else b""
        try:
            return json.loads(self.kv_raw.decode()) if self.kv_raw else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None

    def _rewrite(self, body: dict) -> None:
        # kvlab serve serves one model under any name (agents send their own model names)
        body["model"] = "default_model"
        if self.kv.normalise and isinstance(body.get("messages"), list):
            from ..primitives.normalisation import normalise

            body["messages"] = normalise(body["messages"], self.kv.normalise_rules)

    def _forward(self, body, route: str) -> None:
        """Run mlx-lm's do_POST on ``body`` (or the raw bytes when they were not JSON)."""
        data = json.dumps(body).encode() if body is not None else self.kv_raw
        if self.headers.get("Content-Length") is not None:
            self.headers.replace_header("Content-Length", str(len(data)))
        rfile, path = self.rfile, self.path
        self.rfile, self.path = io.BytesIO(data), route
        try:
            super().do_POST()
        finally:
            self.rfile, self.path = rfile, path

    def _messages(self, body) -> None:
        if body is None:
            return self._json(400, anthropic.error_body("the request body must be JSON"))
        try:
            chat = anthropic.to_chat(body)
        except anthropic.MessagesError as e:
            return self._json(e.status, anthropic.error_body(str(e), e.kind))
        if problem := self._problem(chat["messages"]):
            return self._json(400, anthropic.error_body(problem))
        try:
            self.kv_diag = self.kv.diagnostics.request(body, "anthropic", self.headers)
        except DiagnosticsError as e:
            return self._json(400, anthropic.error_body(str(e)))
        self._rewrite(chat)
        writer = anthropic.MessagesWriter(self, stream=bool(body.get("stream")),
                                          model=str(body.get("model", "kvlab")))
        self._through(writer, chat)

    def _responses(self, body) -> None:
        """POST /v1/responses: translated to chat; a ResponsesWriter takes the writer slot that
        /v1/messages uses, and asks for the ``prompt_cache_diagnostics`` as the response starts
        (computed once: kvlab.serving.diagnosing; the request is remembered under its id then)."""
        if body is None:
            return self._json(400, responses.error_body("the request body must be JSON"))
        try:
            chat = responses.to_chat(body)
        except responses.ResponsesError as e:
            return self._json(e.status, responses.error_body(str(e), e.kind, e.param))
        try:
            self.kv_diag = self.kv.diagnostics.request(body, "responses")
        except DiagnosticsError as e:
            return self._json(400, responses.error_body(str(e), param="prompt_cache_options"))
        answered = {}

        def diagnostics():
            if "value" not in answered:
                answered["value"] = self.kv_diagnostics().get("prompt_cache_diagnostics")
            return answered["value"]

        self._rewrite(chat)
        writer = ResponsesWriter(self, body, diagnostics=diagnostics)
        self._through(writer, chat)

    def _through(self, writer, chat: dict) -> None:
        """Serve the translated ``chat`` request with ``writer`` in the wfile slot, which
        answers in its own API's shape; the real wfile is back afterwards, the writer closed."""
        self.kv_anthropic, self.kv_status, self.kv_real_wfile = writer, 200, self.wfile
        self.wfile = writer
        try:
            self._forward(chat, "/v1/chat/completions")
        finally:
            self.wfile = self.kv_real_wfile
            try:
                writer.close()
            finally:
                self.kv_anthropic = None

    def _problem(self, messages) -> str:
        """The 400 message for ``messages`` (kvlab.serving.chat_checks), "" if they may go on."""
        return chat_checks.problem(messages, self.kv.model.name, self.kv.model.kind == "vlm")

    def _json(self, code: int, obj) -> None:
        data = json.dumps(obj, default=str).encode()
        BaseHTTPRequestHandler.send_response(self, code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        BaseHTTPRequestHandler.end_headers(self)
        self.wfile.write(data)
        self.wfile.flush()

    def log_message(self, format, *args):  # noqa: A002  (BaseHTTPRequestHandler's signature)
        log.debug("%s - %s", self.address_string(), format % args)


def _error(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind}}


def bind_handler(server) -> type:
    """A KvlabHandler subclass bound to ``server`` (mlx-lm builds one handler per request)."""
    return type("BoundKvlabHandler", (KvlabHandler,), {"kv": server})
