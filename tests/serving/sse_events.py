"""The data objects of a server-sent-events body, for the serving tests."""

import json


def sse_events(data: bytes) -> list[dict]:
    """Every event's JSON data, in order; comments, empty events and ``[DONE]`` left out."""
    out = []
    for event in data.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [ln[6:] for ln in event.split(b"\n") if ln.startswith(b"data: ")]
        if lines and lines[0] != b"[DONE]":
            out.append(json.loads(b"".join(lines)))
    return out
