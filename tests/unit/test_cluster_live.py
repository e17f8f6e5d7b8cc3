"""The live router's state (kvlab.cluster.live) and its KV-event feed, without servers: events of
another block size refuse the instance for good, a refused instance is decided around and tried
again after down_s, none up is None; the feed counts skipped batches and waits by sequence."""

import pytest

from kvlab.cluster.live import LiveRouting
from kvlab.primitives import kv_events as fmt

zmq = pytest.importorskip("zmq")


def stored(hashes, block_size=16):
    return {"type": fmt.STORED, "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": [0] * block_size * len(hashes), "block_size": block_size, "lora_id": None, "medium": "GPU"}


def test_events_of_another_block_size_refuse_the_instance_for_good():
    lr = LiveRouting(2, "llmd_weighted", "precise", 16, down_s=1.0)
    assert lr.on_events(0, [stored([1, 2])], 0.0) is None
    why = lr.on_events(1, [stored([1, 2], 32)], 0.0)
    # mutant: events applied whatever their block size (every later match would be zero, silently)
    assert "32-token blocks" in why and "--block-size 32" in why
    assert lr.blocks(1, 5.0) == set() and lr.blocks(0, 5.0) == {1, 2}
    for t in (1.0, 100.0):  # never revived, unlike a refused connection
        assert lr.choose([9, 9], 40, 0, 0, t).instance == 0
    assert lr.state()[1]["up"] is False and lr.on_events(1, [stored([3])], 200.0) == why


def test_a_refused_instance_is_decided_around_and_tried_again_after_down_s():
    lr = LiveRouting(2, "round_robin", "approximate", 16, down_s=10.0)
    d = lr.choose([1, 2], 40, 0, 0, 0.0)
    assert d.instance == 0
    d2 = lr.refused(d, "connection refused", 1.0)
    assert (d2.instance, d2.refused) == (1, [0])  # mutant: a refusal that gives up (None): a 502
    assert lr.running.tolist() == [0, 1] and lr.blocks(0, 1.0) == set()  # its load and record went
    assert [lr.choose([3], 20, 0, 0, t).instance for t in (2.0, 3.0)] == [1, 1]
    assert lr.choose([3], 20, 0, 0, 11.0).instance == 0  # down for 10 s, then tried again
    lr.mark_down(0, "x", 12.0)
    lr.mark_down(1, "y", 12.0)
    assert lr.choose([3], 20, 0, 0, 13.0) is None


def test_the_feed_counts_skipped_batches_and_waits_by_sequence():
    from kvlab.cluster.feed import EventFeed

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    got = []
    feed = EventFeed([None, f"tcp://127.0.0.1:{port}"], lambda i, events: got.append((i, events)))
    try:
        assert pub.recv()[:1] == b"\x01"  # the subscription is in: nothing published from here on is lost
        for seq in (0, 1, 3):
            pub.send_multipart(fmt.frames("", seq, fmt.encode_batch(0.0, [fmt.block_removed([seq])])))
        assert feed.wait(1, 3, timeout=30.0)
        assert [e[0]["block_hashes"] for _, e in got] == [[0], [1], [3]] and {i for i, _ in got} == {1}
        assert feed.gaps == [0, 1] and feed.seen == [-1, 3]  # batch 2 never came: counted, not hidden
        assert not feed.wait(1, 4, timeout=0.05)
    finally:
        feed.close()
        pub.close(linger=0)


def test_calibration_recovers_the_cost_and_robust_is_not_dragged_by_slow_requests():
    from kvlab.cluster import ServiceModel

    new = [100, 200, 300, 400, 500, 600, 700, 800]
    t = [0.05 + 0.002 * n for n in new]
    exact = ServiceModel.calibrate(new, [0] * 8, t)
    assert (round(exact.a, 9), round(exact.b, 9)) == (0.05, 0.002)  # mutant: the columns swapped
    slow = list(t)
    slow[1] *= 10  # one request a busy machine slowed tenfold
    robust = ServiceModel.calibrate(new, [0] * 8, slow, robust=True)
    assert (round(robust.a, 9), round(robust.b, 9)) == (0.05, 0.002)  # Theil-Sen ignores it
    plain = ServiceModel.calibrate(new, [0] * 8, slow)
    assert abs(plain.b - 0.002) > 1e-4 or abs(plain.a - 0.05) > 1e-2  # least squares is dragged
    # reused tokens are not new work: the fit is on prompt - reused (mutant: on the prompt)
    fit = ServiceModel.calibrate([100, 300, 400], [0, 100, 100], [0.25, 0.45, 0.65])
    assert (round(fit.a, 9), round(fit.b, 9)) == (0.05, 0.002)
