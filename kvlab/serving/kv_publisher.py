"""``kvlab serve --kv-events tcp://127.0.0.1:PORT``: the server's store, published as vLLM 0.10.2 KV
events (kvlab.primitives.kv_events) on a ZMQ PUB socket, so a router (``kvlab route``, llm-d,
Dynamo) can see what each instance holds.

The source is the reuse core's store events, handed over after each drain with the key that
caused them (StoreAdapter.listeners). Every store is published as a *block view*: the chained
block hashes (``CacheKey.block_hashes``, block size ``block_size``; on a server of tenants the
key's keyed tenant salt is in them, kvlab.tenants) of the full blocks it can serve from the start
of a prompt. What each store publishes:

- ``paged``: its own blocks, one to one: a ``block_stored`` row is a BlockStored (parent and token
  ids from the inserting key's chain), a ``block_removed`` row a BlockRemoved (vLLM's order).
- ``radix``, ``system``, ``mlx-lru``, ``disk`` and a tiered store's RAM tier: whole-prefix entries;
  an ``insert`` of T tokens under key K covers K's full blocks within its first T tokens, an
  ``evict`` uncovers them; a block is published while at least one resident entry covers it
  (rows of a disk tier are not published: a hit there is a reload, not a resident block).
- ``shared-radix``: nodes hold edges, not prefixes: after a drain that changed the tree, its
  ``tree_frame`` is walked and a block is covered when the node holding its last token is
  resident (cost: one walk of the tree per changing request).

A drain's changes go out as one KVEventBatch: removals, then stores in prefix order (a block's
parent before it). The socket binds the address given (port 0: a free one, see ``endpoint``);
subscribers connect. Sequence numbers start at 0; no replay socket. The socket is an XPUB (to a
SUB it is vLLM's PUB): it counts the subscriptions it has seen (``info()["subscribed"]``), so a
router can wait until its subscription is in before it sends traffic (a SUB that joins late misses
what was published before).

Example:
    >>> with kv.serve("tiny", "paged", kv_events="tcp://127.0.0.1:0") as server:
    ...     server.kv_events.endpoint
    'tcp://127.0.0.1:...'
"""

from __future__ import annotations

import html
import logging
import threading

from ..errors import KvlabError
from ..keys import CacheKey
from ..primitives import kv_events as fmt
from ..primitives import timing

log = logging.getLogger("kvlab.serving")
ENTRY_INSERTS, ENTRY_REMOVES = ("insert", "persist"), ("evict",)


class KVEventPublisher:
    """The block view of one store, published on ``endpoint`` (module docstring)."""

    def __init__(self, endpoint: str, store, block_size: int = 16, topic: str = ""):
        import zmq

        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            raise KvlabError(f"--kv-events takes a ZMQ address such as tcp://127.0.0.1:5557, got {endpoint!r}")
        self.store, self.block_size, self.topic = store, int(block_size), topic
        self.mode = self._mode(store)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only the first
        self.subscribed = 0
        addr = endpoint[:-2] + ":*" if endpoint.endswith(":0") else endpoint
        try:
            self._pub.bind(addr)
        except zmq.ZMQError as e:
            self._pub.close()
            raise KvlabError(f"--kv-events {endpoint}: cannot bind ({e}); pick a free port or :0") from e
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0
        self._lock = threading.Lock()
        self._refs: dict[bytes, int] = {}        # block -> resident entries covering it
        self._entries: dict[str, list] = {}      # entry -> the blocks it covers
        self._info: dict[bytes, tuple] = {}      # block -> (parent, token ids, position)
        self.published: set[bytes] = set()       # what subscribers were told is resident

    @staticmethod
    def _mode(store) -> str:
        if store is None:
            return "none"
        name = getattr(store, "name", "")
        if name == "shared-radix":
            return "tree"
        if name == "paged" or getattr(getattr(store, "ram", None), "name", "") == "paged":
            return "blocks"
        return "entries"

    # -- what StoreAdapter calls after each drain ------------------------------------------------
    def on_drain(self, rid, key: CacheKey | None, events, offered: bool = True) -> None:
        if self.mode == "none" or not events:
            return
        with self._lock:
            before = set(self.published)
            if self.mode == "blocks":
                self._blocks(key, events)
            elif self.mode == "entries":
                self._entries_of(key, events)
            elif any(e.event in ("insert", "evict") for e in events):
                self._tree()
            self._send(before)

    def _chain(self, key: CacheKey | None, n: int | None = None) -> list[bytes]:
        return [] if key is None else key.block_hashes(self.block_size, n)

    def _remember(self, key: CacheKey, hashes: list[bytes]) -> None:
        bs = self.block_size
        for i, h in enumerate(hashes):
            if h not in self._info:
                self._info[h] = (hashes[i - 1] if i else None, tuple(key.ids[i * bs:(i + 1) * bs]), i)

    def _blocks(self, key, events) -> None:
        chain = None
        for e in events:
            if e.tier == "disk":
                continue
            if e.event == "block_stored":
                chain = chain if chain is not None else self._chain(key)
                self._remember(key, chain)
                self.published.add(bytes.fromhex(e.entry))
            elif e.event == "block_removed":
                self.published.discard(bytes.fromhex(e.entry))

    def _entries_of(self, key, events) -> None:
        for e in events:
            if e.tier == "disk" or e.entry is None:
                continue
            if e.event in ENTRY_REMOVES or (e.event in ENTRY_INSERTS and key is not None):
                for h in self._entries.pop(e.entry, ()):  # an entry inserted again covers its new extent
                    self._refs[h] -= 1
                    if not self._refs[h]:
                        del self._refs[h]
            if e.event in ENTRY_INSERTS and key is not None:
                hashes = self._chain(key, min(e.tokens, len(key.ids)))
                self._remember(key, hashes)
                self._entries[e.entry] = hashes
                for h in hashes:
                    self._refs[h] = self._refs.get(h, 0) + 1
        self.published = set(self._refs)

    def _tree(self) -> None:
        bs, paths, covered = self.block_size, {}, set()
        for row in self.store.tree_frame().sort("depth").iter_rows(named=True):
            ids = paths.get(row["parent"], ()) + tuple(row["edge_ids"] or ())
            paths[row["id"]] = ids
            if row["depth"] // bs > row["start"] // bs:
                key = CacheKey(ids)
                hashes = key.block_hashes(bs)
                self._remember(key, hashes)
                covered.update(hashes[row["start"] // bs:row["depth"] // bs])
        self.published = covered

    def _send(self, before: set) -> None:
        gone, new = before - self.published, self.published - before
        if not gone and not new:
            return
        events = []
        if gone:
            events.append(fmt.block_removed([fmt.external_hash(h) for h in sorted(gone, key=self._position)]))
        run: list[bytes] = []
        for h in sorted(new, key=self._position) + [None]:
            if run and (h is None or self._info[h][0] != run[-1]):
                parent, bs = self._info[run[0]][0], self.block_size
                events.append(fmt.block_stored([fmt.external_hash(x) for x in run],
                                               None if parent is None else fmt.external_hash(parent),
                                               [t for x in run for t in self._info[x][1]], bs))
                run = []
            if h is not None:
                run.append(h)
        self._pub.send_multipart(fmt.frames(self.topic, self.seq, fmt.encode_batch(timing.wall(), events)))
        self.seq += 1
        for h in gone:
            self._info.pop(h, None)

    def _position(self, h: bytes) -> tuple:
        info = self._info.get(h)
        return (info[2] if info else 0, h)

    # -- reading / stopping -----------------------------------------------------------------------
    def info(self) -> dict:
        """What ``/kvlab/stats`` says under ``kv_events``: where, which format, the block size, the
        batches sent (``seq``) and the subscriptions seen."""
        import zmq

        with self._lock:
            while not self._pub.closed and self._pub.poll(0, zmq.POLLIN):
                self.subscribed += self._pub.recv()[:1] == b"\x01"  # \x00: an unsubscription
            return {"endpoint": self.endpoint, "format": f"vllm {fmt.VLLM_VERSION}", "block_size": self.block_size,
                    "topic": self.topic, "seq": self.seq, "blocks": len(self.published), "view": self.mode,
                    "subscribed": self.subscribed}

    def close(self) -> None:
        with self._lock:
            self._pub.close(linger=0)

    def __repr__(self) -> str:
        return (f"KVEventPublisher({self.endpoint}, vLLM {fmt.VLLM_VERSION} format, {self.mode} view of "
                f"{len(self.published)} blocks of {self.block_size}, {self.seq} batches)")

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"
