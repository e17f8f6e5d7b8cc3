"""``kvlab serve --kv-events``: every store published as vLLM 0.10.2 KV events, decoded exactly as
vLLM's own subscriber (examples/online_serving/kv_events_subscriber.py of that release) does:
ZMQ SUB, (topic, 8-byte sequence, payload), msgspec's typed msgpack Decoder over its structs;
and the blocks they announce are the blocks the store holds."""

from __future__ import annotations

import time
from typing import Any, Optional, Union

import pytest
from kv_helpers import finished_inserts

import kvlab as kv
from kvlab.keys import cache_key
from kvlab.primitives import kv_events as fmt
from kvlab.primitives.tokens import from_ids

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")
pytestmark = [pytest.mark.model, pytest.mark.serving]


# vLLM 0.10.2's types, copied as its example subscriber copies them
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Optional[Union[bytes, int]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


class Subscriber:
    """vLLM's subscriber loop: SUB to the endpoint, decode each batch, keep the resident set."""

    def __init__(self, endpoint):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, "")
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.seqs, self.held, self.stored = [], set(), []

    def drain(self, until_seq, timeout=30.0):
        end = time.monotonic() + timeout
        while (not self.seqs or self.seqs[-1] < until_seq) and time.monotonic() < end:
            if self.sock.poll(100):
                _, seq_bytes, payload = self.sock.recv_multipart()
                self.seqs.append(int.from_bytes(seq_bytes, "big"))
                for ev in self.decoder.decode(payload).events:
                    if isinstance(ev, BlockStored):
                        assert ev.block_size == 16 and ev.medium == "GPU" and len(ev.token_ids) == 16 * len(ev.block_hashes)
                        self.stored.append(ev)
                        self.held.update(ev.block_hashes)
                    elif isinstance(ev, BlockRemoved):
                        self.held.difference_update(ev.block_hashes)
        assert self.seqs and self.seqs[-1] >= until_seq, f"events up to {until_seq} never came: {self.seqs}"

    def close(self):
        self.sock.close(linger=0)


def ext(ids, n=None):
    return {fmt.external_hash(h) for h in cache_key(from_ids(ids)).block_hashes(16, n)}


@pytest.mark.parametrize("store", ["paged", "radix", "shared-radix", "mlx-lru"])
def test_events_are_vllm_0_10_2_and_match_what_the_store_holds(start, client, store):
    server = start(store, kv_events="tcp://127.0.0.1:0", budget="4MiB" if store == "paged" else None)
    sub = Subscriber(server.kv_events.endpoint)
    # a SUB joins late (ZMQ drops what was published before its subscription is in): wait until the
    # publisher has seen it (mutant: a PUB that cannot tell, where the first batch may be lost)
    end = time.monotonic() + 30
    while server.kv_events.info()["subscribed"] < 1:
        assert time.monotonic() < end, "the subscription never reached the publisher"
        time.sleep(0.01)
    texts = ["The quick brown fox jumps over the lazy dog. " * 6]
    texts.append(texts[0] + "Then it naps in the warm afternoon sun for hours. " * 5)
    c = client(server)
    for i, text in enumerate(texts):
        c.completions.create(model="tiny", prompt=text, max_tokens=1)
        finished_inserts(server, i + 1)
        sub.drain(server.kv_events.seq - 1)
    seen = [server.model.tokenizer.encode(text) for text in texts]
    assert len(seen[1]) // 16 > len(seen[0]) // 16 + 2
    # catches a publisher whose hashes are not the chained block hashes of what was cached, or that
    # misses a store's inserts (each prompt's full blocks are announced, parents before children)
    assert sub.seqs == list(range(len(sub.seqs)))
    assert ext(seen[0]) <= sub.held and ext(seen[1]) <= sub.held
    first = sub.stored[0]
    assert first.parent_block_hash is None and first.token_ids[:16] == list(seen[0][:16])
    # the announced view is the publisher's own record of the store
    assert sub.held == {fmt.external_hash(h) for h in server.kv_events.published}
    if store == "paged":
        held = {fmt.external_hash(bytes.fromhex(h)) for h in server.store.blocks_frame()["hash"].to_list()}
        assert sub.held == held  # catches removals not published (the budget evicts blocks here)
    assert server.stats()["kv_events"]["format"] == "vllm 0.10.2"
    sub.close()


def test_format_round_trip_and_hash():
    payload = fmt.encode_batch(2.0, [fmt.block_stored([1, 2], None, list(range(32)), 16), fmt.block_removed([9]),
                                     fmt.all_cleared()])
    batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert batch.events[0].block_hashes == [1, 2] and batch.events[1].medium == "GPU"
    assert fmt.decode_batch(payload)[1][1] == {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU"}
    # vLLM's int form: the last 8 bytes, big-endian
    assert fmt.external_hash(bytes(range(16))) == int.from_bytes(bytes(range(8, 16)), "big")
    with pytest.raises(kv.errors.KvlabError, match="takes a ZMQ address"):
        from kvlab.serving.kv_publisher import KVEventPublisher

        KVEventPublisher("127.0.0.1:5557", None)
