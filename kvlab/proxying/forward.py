"""The proxy's HTTP handler: forwards OpenAI and Anthropic routes to the upstream unchanged.

``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/messages``, ``/v1/responses`` and
``GET /v1/models``, ``/health`` go upstream with the same body bytes, query string and headers
(authorization, x-api-key, anthropic-version, anthropic-beta, content-type, ...; hop-by-hop
headers and ``accept-encoding`` are dropped, so the body the proxy reads is never compressed).
The upstream's status, headers and body come back unchanged; an SSE response (``text/event-stream``)
is relayed chunk by chunk as it arrives (HTTP/1.1 chunked to the client, one write per chunk read),
anything else is read whole and sent with its length. ``GET /kvlab/requests`` lists the rows
(kvlab.proxying.conversation); ``?since=N`` only those after the first N, for a client that polls.

The upstream is the proxy's ``choose(route, exchange)`` (a Proxy has one; a router,
kvlab.cluster.router, picks one per request and names it in the response's headers); one that
that cannot be reached goes to ``refused(...)``, which may name another to try (only when the
request was not sent: one the upstream received is never run twice).

Users (kvlab.proxying.users): with ``--users`` every route first identifies the caller by its key
(401 otherwise, in the route's error shape); the key is swapped for the user's upstream
credential, a ``cache_salt`` injected with ``--cache-salt`` (a client's own that is not a string:
400), and ``/kvlab/requests``, ``/metrics`` and the diagnostics answer from the user's own rows.

Bad input: an upstream that cannot be reached answers 502 with a JSON error naming its URL and the
cause (Anthropic's error shape on /v1/messages, OpenAI's elsewhere); a client that leaves
mid-response closes the upstream connection at once and its row says ``disconnected`` (a stream
cut by the proxy's own stop says ``stopped`` and is not recorded); unknown routes answer a JSON 404.

Example:
    >>> handler_class = bind_handler(proxy)   # a subclass whose ``px`` is the running Proxy
"""

from __future__ import annotations

import http.client
import json
import logging
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlsplit

from ..errors import DiagnosticsError, RequestError
from ..tenants import presented_key
from ..serving import prometheus
from . import diagnosing

log = logging.getLogger("kvlab.proxy")
POST_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
GET_ROUTES = ("/v1/models", "/health")
# not forwarded: hop-by-hop headers (RFC 9110 7.6.1), the proxy's own framing, and compression
DROP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                  "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length",
                  "accept-encoding", "expect"})
BUFFER = 65536


class ProxyHandler(BaseHTTPRequestHandler):
    """Forwards one client connection's requests (module docstring). ``px`` is the Proxy."""

    px = None
    protocol_version = "HTTP/1.1"  # keep-alive and chunked streams to the client
    timeout = 300  # seconds an idle client may hold a connection
    disable_nagle_algorithm = True  # each relayed chunk leaves at once, not after the client's ACK

    def setup(self):
        super().setup()
        self.px.track(self.connection, True)

    def finish(self):
        try:
            super().finish()
        finally:
            self.px.track(self.connection, False)

    # -- routes -----------------------------------------------------------------------------------
    def _identify(self, route: str) -> bool:
        """The caller (``caller``: a kvlab.tenants.Caller, None without users); False after a 401."""
        users = self.px.users
        found = users.caller(presented_key(self.headers))
        self.caller = found if users.active else None
        if found is not None:
            return True
        self._json(401, _error(route, "missing or wrong key for this proxy: send 'Authorization: Bearer KEY' "
                               "or 'x-api-key: KEY' with a key from its users file", "authentication_error"))
        return False

    def do_GET(self):
        route = urlsplit(self.path).path
        if not self._identify(route):
            return
        if route == "/kvlab/requests":
            since = parse_qs(urlsplit(self.path).query).get("since", ["0"])[0]
            if not since.isdigit():
                return self._json(400, _error(route, f"since must be a row count (an integer >= 0), got {since!r}"))
            if self.caller is None:
                return self._json(200, self.px.tracker.listing(int(since)))
            return self._json(200, self.px.requests_of(self.caller, int(since)))
        if route == "/metrics":  # the proxy's own, from its rows (an upstream's /metrics is not forwarded)
            return prometheus.write(self, self.px.metrics, admin=self.caller is None or self.caller.admin)
        if route in GET_ROUTES:
            return self._relay(route, None, None)
        own = self.px.answer_get(route, parse_qs(urlsplit(self.path).query))
        if own is not None:
            return self._json(*own)
        self._json(404, _error(route, f"unknown route GET {route}; the proxy forwards GET "
                               f"{', '.join(GET_ROUTES)} and answers GET /kvlab/requests", "not_found_error"))

    def do_POST(self):
        route = urlsplit(self.path).path
        raw = self._body()
        if raw is None or not self._identify(route):
            return
        if route not in POST_ROUTES:
            return self._json(404, _error(route, f"unknown route POST {route}; the proxy forwards POST "
                                          f"{', '.join(POST_ROUTES)}", "not_found_error"))
        try:
            question = diagnosing.asked(route, raw, self.headers) if self.px.answers_diagnostics else None
            if self.caller is not None:
                raw = self.px.users.body(raw, self.caller)  # the user's cache_salt, if injected
        except (DiagnosticsError, RequestError) as e:
            return self._json(400, _error(route, str(e)))
        self._relay(route, raw, self.px.tracker.open(route, raw, self.caller), question)

    def _other(self):
        self._body()
        route = urlsplit(self.path).path
        if not self._identify(route):
            return
        self._json(404, _error(route, f"no {self.command} route {route}; the proxy forwards POST "
                               f"{', '.join(POST_ROUTES)} and GET {', '.join(GET_ROUTES)}", "not_found_error"))

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _other

    # -- forwarding -------------------------------------------------------------------------------
    def _relay(self, route: str, raw: bytes | None, ex, question=None) -> None:
        self.target, tried = self.px.choose(route, ex), []
        while self.target is not None:
            conn, sent = self.px.connect(self.target), False
            try:
                conn.request(self.command, self.target.base_path + self.path, body=raw, headers=self._headers(raw))
                sent = True
                resp = conn.getresponse()
                break
            except (OSError, http.client.HTTPException) as e:
                self.px.release(conn)
                tried.append((self.target.url, _cause(e)))
                self.target = self.px.refused(self.target, ex, _cause(e), sent)
        else:
            msg = self.px.unreachable(tried)
            log.warning("kvlab proxy: %s", msg)
            if ex is not None:  # the row first: a client that has its answer finds the row
                self._finish(ex, status="upstream_unreachable", http_status=502, error=msg)
            self._json(502, _error(route, msg, "api_error"))
            return
        if ex is not None:
            ex.upstream = self.target.url
        try:
            answer = None
            if question is not None and resp.status == 200:
                prints = self.px.fingerprints
                seen = prints if self.caller is None else prints.seen_by(self.caller.sees)

                def answer(cached, ex=ex):
                    return diagnosing.answer(seen, self.px.tracker, ex, question, cached)
            if resp.status == 200 and "text/event-stream" in (resp.getheader("Content-Type") or ""):
                self._stream(resp, ex, diagnosing.StreamInjector(question.api, answer) if answer else None)
            else:
                self._whole(resp, route, ex, answer)
        finally:
            self.px.release(conn)

    def _whole(self, resp, route, ex, answer=None) -> None:
        try:
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            msg = f"the upstream {self.target.url} broke off its response: {_cause(e)}"
            if ex is not None:
                self._finish(ex, status="upstream_error", http_status=502, error=msg)
            self._json(502, _error(route, msg, "api_error"))
            return
        if ex is not None:
            ex.watch.body(data)
            if ex.watch.outputs:
                ex.output_seen()
            ok = resp.status < 400
            error = None if ok else data[:500].decode("utf-8", "replace")
            # the upstream ran the whole request: a client gone by now does not change its row
            self._finish(ex, status="ok" if ok else "error", http_status=resp.status, error=error)
        if answer is not None:
            data = diagnosing.inject_body(diagnosing.APIS[route], data, answer)
        try:
            self._head(resp, [("Content-Length", str(len(data)))])
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def _stream(self, resp, ex, injector=None) -> None:
        gone = broke = None
        chunked = self.request_version != "HTTP/1.0"  # an HTTP/1.0 client reads until the close
        self.close_connection = self.close_connection or not chunked
        try:
            self._head(resp, [("Transfer-Encoding", "chunked")] if chunked else [])
        except OSError as e:
            gone = e
        while gone is None:
            try:
                chunk = resp.read1(BUFFER)
            except (OSError, http.client.HTTPException) as e:
                broke = e
                break
            if not chunk:
                break
            if ex is not None and ex.watch.feed(chunk):
                ex.output_seen()
                self.px.metrics.output(ex.id)  # ITL at the proxy (kvlab.serving.prometheus)
            if injector is not None:
                chunk = injector.feed(chunk)  # holds bytes back until the event it rewrites is whole
            try:
                if chunk:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            except OSError as e:
                gone = e
        if gone is None and not self.px.running:
            broke = ConnectionAbortedError("the proxy stopped mid-response")  # stop() cut the upstream
        if gone is not None or broke is not None:
            self.close_connection = True
            resp.close()  # the client left (or the upstream broke): stop the upstream generating
        if ex is not None:
            status = ("disconnected" if gone is not None else "ok" if broke is None else
                      "stopped" if not self.px.running else "upstream_error")
            self._finish(ex, status=status, http_status=resp.status,
                         error=None if status == "ok" else _cause(gone or broke))
        rest = injector.flush() if injector is not None and gone is None else b""
        if gone is None and broke is None and (chunked or rest):
            try:  # the row exists before the client sees the end of the stream
                self.wfile.write((b"%x\r\n%s\r\n0\r\n\r\n" % (len(rest), rest) if rest else b"0\r\n\r\n")
                                 if chunked else rest)
            except OSError:
                self.close_connection = True
        # a broken stream ends without its last chunk: the client sees it was cut, not finished

    # -- internals --------------------------------------------------------------------------------
    def _finish(self, ex, **kw) -> None:
        try:
            self.px.finish(ex, **kw)
        except Exception:  # noqa: BLE001  a bug in tracking must never cost the client its response
            log.error("kvlab proxy: no row for request %s", ex.id, exc_info=True)

    def _headers(self, raw) -> dict:
        out = {k: v for k, v in self.headers.items() if k.lower() not in DROP}
        if self.caller is not None:
            out = self.px.users.headers(out, self.caller)  # the user's upstream credential, not its key
        if raw is not None:
            out["Content-Length"] = str(len(raw))
        return out

    def _head(self, resp, extra) -> None:
        self.send_response_only(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in DROP:
                self.send_header(k, v)
        for k, v in (*extra, *self.target.headers):
            self.send_header(k, v)
        self.end_headers()

    def _body(self) -> bytes | None:
        """The request body (b"" if none); None after answering 411 for a body without a length."""
        length = self.headers.get("Content-Length")
        if length is None:
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                self.close_connection = True
                self._json(411, _error(urlsplit(self.path).path, "send the request body with a "
                                       "Content-Length header (chunked request bodies are not forwarded)"))
                return None
            return b""
        try:
            return self.rfile.read(int(length))
        except ValueError:
            self.close_connection = True
            self._json(400, _error(urlsplit(self.path).path, f"bad Content-Length {length!r}"))
            return None

    def _json(self, code: int, obj) -> None:
        data = json.dumps(obj, default=str).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True

    def log_message(self, format, *args):  # noqa: A002  (BaseHTTPRequestHandler's signature)
        log.debug("%s - %s", self.address_string(), format % args)


def _error(route: str, message: str, kind: str = "invalid_request_error") -> dict:
    """An error body in the shape the route's clients parse: Anthropic's on /v1/messages."""
    if route.startswith("/v1/messages"):
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _cause(e: BaseException | None) -> str:
    if e is None:
        return ""
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError):
        return "timed out"
    text = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}"


def bind_handler(px) -> type:
    """A ProxyHandler subclass bound to the Proxy ``px`` (the server builds one per connection)."""
    return type("BoundProxyHandler", (ProxyHandler,), {"px": px})
