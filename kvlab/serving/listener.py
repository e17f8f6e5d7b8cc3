"""One HTTP listener in a background thread, as ``kvlab serve`` and ``kvlab proxy`` run theirs:
bound on a host and port (0: a free one), a warning when the host is not loopback, and a stop
that cuts open connections and joins every handler thread, so the port is free afterwards.

Example:
    >>> import logging, http.server
    >>> listener = Listener("127.0.0.1", 0, "kvlab example", logging.getLogger("example"))
    >>> listener.listen(http.server.BaseHTTPRequestHandler).url
    'http://127.0.0.1:...'
    >>> listener.close([])
    >>> listener.running, listener.state
    (False, 'stopped')
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from http.server import ThreadingHTTPServer

from ..errors import KvlabError


class Listener:
    """``listen(handler)`` binds and serves; ``close(sockets)`` stops (idempotent); ``url`` and
    ``running`` describe it. ``name`` names the thread and the log lines."""

    def __init__(self, host: str, port: int, name: str, log: logging.Logger):
        self.host, self.port, self.name, self.log = host, int(port), name, log
        self.httpd: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None
        self.stopped = threading.Event()
        self.closed = False

    def listen(self, handler, *, exposed: str = "") -> "Listener":
        """Bind ``handler`` (a request handler class or factory) and serve in a thread; a bind
        failure is a KvlabError naming the address. ``exposed``: what the non-loopback warning adds."""
        log, name = self.log, self.name

        class Quiet(ThreadingHTTPServer):
            daemon_threads = False  # handler threads are joined by server_close: a clean stop
            request_queue_size = 128  # listen backlog: bursts of clients connect at once
            block_on_close = True

            def handle_error(self, request, client_address):
                # a client that leaves mid-stream is routine for a server; keep the traceback for debugging
                log.debug("%s: connection from %s ended with an error", name, client_address, exc_info=True)

        try:
            Quiet.address_family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0][0]
            self.httpd = Quiet((self.host, self.port), handler)
        except OSError as e:
            raise KvlabError(f"cannot listen on {self.host}:{self.port}: {e.strerror}; pick another "
                             "--port (0 picks a free one)") from e
        self.port = self.httpd.server_address[1]
        if not is_loopback(self.host):
            log.warning("%s listens on %s: anyone who can reach this address can use it%s", name, self.host, exposed)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                       name=f"{name.replace(' ', '-')}-{self.port}", daemon=True)
        self.thread.start()
        return self

    def shutdown(self) -> bool:
        """Stop accepting (first half of a stop); False if it was not running."""
        if self.httpd is None or self.stopped.is_set():
            return False
        self.stopped.set()
        self.httpd.shutdown()
        return True

    def close(self, sockets) -> None:
        """Cut ``sockets`` (open client or upstream connections), then join every handler thread.
        Idempotent."""
        if self.httpd is None or self.closed:
            return
        self.closed = True
        self.shutdown()
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.httpd.server_close()  # joins the handler threads
        self.thread.join()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self.httpd is not None and not self.stopped.is_set()

    @property
    def state(self) -> str:
        return "running" if self.running else "stopped" if self.stopped.is_set() else "ready"

    def __repr__(self) -> str:
        return f"Listener({self.url} {self.state})"


class Listening:
    """What a class serving through ``self.listener`` shows (its ``start`` and ``stop`` do the
    work): ``host``, ``port`` (the bound one once started), ``url``, ``running``, and use as a
    context manager that starts and stops it."""

    listener: Listener

    @property
    def host(self) -> str:
        return self.listener.host

    @property
    def port(self) -> int:
        return self.listener.port

    @property
    def url(self) -> str:
        return self.listener.url

    @property
    def running(self) -> bool:
        return self.listener.running

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1).

    Example:
        >>> is_loopback("127.0.0.1"), is_loopback("0.0.0.0")
        (True, False)
    """
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
