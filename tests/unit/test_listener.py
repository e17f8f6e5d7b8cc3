"""kvlab.serving.listener: the HTTP listener kvlab serve and kvlab proxy share (no model).

Mutants caught: a bind failure passed through as a bare OSError (or a 0 port reported after
binding), close() that leaves the port bound, a second close() that raises, an IPv6 host
without brackets in the URL, a public address taken for loopback."""

import http.server
import logging
import socket

import httpx
import pytest

from kvlab.errors import KvlabError
from kvlab.serving.listener import Listener, is_loopback


class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"hello"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_listen_serve_close_frees_the_port():
    listener = Listener("127.0.0.1", 0, "kvlab test", logging.getLogger("test"))
    assert listener.state == "ready" and not listener.running
    listener.listen(Hello)
    assert listener.port > 0 and listener.running and listener.url == f"http://127.0.0.1:{listener.port}"
    assert httpx.get(listener.url, timeout=10).text == "hello"
    listener.close([])
    listener.close([])  # idempotent
    assert listener.state == "stopped" and not listener.thread.is_alive()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the client's side may be in TIME_WAIT
        s.bind(("127.0.0.1", listener.port))  # nothing listens there any more


def test_a_taken_port_is_a_kvlab_error_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(KvlabError, match=rf"cannot listen on 127.0.0.1:{port}: .*pick another --port"):
            Listener("127.0.0.1", port, "kvlab test", logging.getLogger("test")).listen(Hello)


def test_url_and_loopback():
    assert Listener("::1", 8080, "x", logging.getLogger("x")).url == "http://[::1]:8080"
    assert [is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost", "0.0.0.0", "192.168.1.2",
                                     "example.org")] == [True, True, True, True, False, False, False]
