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
