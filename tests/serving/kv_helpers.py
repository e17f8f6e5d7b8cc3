"""Waiting for a served request's store insert (an event, not a guess at timing), shared by the
KV-event and router tests."""

import time


def finished_inserts(server, n, timeout=30.0):
    """Wait until mlx-lm's final insert (prompt + output) of the n-th request has been drained: it
    comes after the response (kvlab.serving.generator), its offer row is written under the
    adapter's lock, which the insert holds to its end, and its events are published in the drain."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ev = server.events
        if ev.filter((ev["event"] == "offer") & (ev["segment"] == "assistant")).height >= n:
            with server.adapter.lock:
                return
        time.sleep(0.02)
    raise AssertionError(f"request {n}'s final insert never came")
