"""How the CLI prints a result: JSON for machines, an aligned listing for people."""

from __future__ import annotations

import json


def print_result(obj: dict, as_json: bool) -> None:
    """JSON for machines with --json, an aligned listing for people otherwise.

    Example:
        >>> print_result({"requests": 3}, False)
                        requests: 3
    """
    if as_json:
        print(json.dumps(obj, indent=2, default=str))
        return
    for k, v in obj.items():
        print(f"{k:>24}: {v}")


def in_foreground(service, banner: str, wait) -> None:
    """Print ``banner``, block in ``wait()`` until Ctrl-C, SIGTERM or ``wait`` returns, then stop
    ``service`` (always: its port freed, its recording closed)."""
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    print(banner, flush=True)
    try:
        wait()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        service.stop()
