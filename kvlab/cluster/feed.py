"""A router's subscription to its instances' KV events (vLLM 0.10.2's format, kvlab.primitives.
kv_events): one ZMQ SUB socket per instance, read on one thread; each batch goes to
``on_batch(instance, events)`` in the order it was sent.

``seen[i]`` is the last sequence number read from instance i; ``wait(i, seq)`` blocks until it
reaches ``seq`` (how a router makes sure its view holds what an instance published before a
response ended). A sequence number that skips is counted in ``gaps[i]`` and logged: batches were
lost (a subscriber that joined late, or a restarted instance) and the view may miss blocks.

Example:
    >>> feed = EventFeed(["tcp://127.0.0.1:5557", None], lambda i, events: print(i, events))
    >>> feed.wait(0, 3, timeout=5.0)
    True
    >>> feed.close()
"""

from __future__ import annotations

import html
import logging
import threading

from ..primitives import kv_events as fmt

log = logging.getLogger("kvlab.route")


class EventFeed:
    """SUB sockets to ``endpoints`` (None: an instance without events), read on a thread."""

    def __init__(self, endpoints: list, on_batch, name: str = "kvlab-route-events"):
        import zmq

        self._zmq = zmq
        self.endpoints = list(endpoints)
        self.on_batch = on_batch
        self.seen = [-1] * len(self.endpoints)
        self.gaps = [0] * len(self.endpoints)
        self.errors: list[str | None] = [None] * len(self.endpoints)
        self._socks = {}
        ctx = zmq.Context.instance()
        for i, ep in enumerate(self.endpoints):
            if ep is None:
                continue
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(ep)
            sock.setsockopt_string(zmq.SUBSCRIBE, "")
            self._socks[sock] = i
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        for sock in self._socks:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                i = self._socks[sock]
                _, seq_bytes, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                try:
                    _, events = fmt.decode_batch(payload)
                    self.on_batch(i, events)
                except Exception as e:  # noqa: BLE001  one bad batch must not stop the feed; it is said
                    self.errors[i] = f"batch {seq} from {self.endpoints[i]}: {e}"
                    log.error("kvlab route: KV events of instance %d: %s", i, self.errors[i])
                with self._cv:
                    if seq != self.seen[i] + 1:
                        self.gaps[i] += 1
                        log.warning("kvlab route: instance %d's KV events jumped from batch %d to %d: its view "
                                    "may miss blocks", i, self.seen[i], seq)
                    self.seen[i] = seq
                    self._cv.notify_all()

    def wait(self, i: int, seq: int, timeout: float = 5.0) -> bool:
        """Block until batch ``seq`` of instance ``i`` was read (True), or ``timeout`` s pass (False)."""
        with self._cv:
            return self._cv.wait_for(lambda: self.seen[i] >= seq, timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self._socks:
            sock.close(linger=0)

    def __repr__(self) -> str:
        live = sum(ep is not None for ep in self.endpoints)
        return f"EventFeed({live} of {len(self.endpoints)} instances, last batches {self.seen}, gaps {self.gaps})"

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"
