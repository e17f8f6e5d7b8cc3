"""Human-readable quantities: the one byte formatter every table, repr and figure uses.

Example:
    >>> fmt_bytes(1536)
    '1.5 KiB'
"""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(n: float) -> str:
    """Bytes in binary units (KiB = 1024 B), one decimal above a KiB.

    Example:
        >>> fmt_bytes(512), fmt_bytes(3 * 2**20)
        ('512 B', '3.0 MiB')
    """
    n = float(n)
    for unit in _UNITS:
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_bytes(text) -> int:
    """``"1GiB"``, ``"512MiB"``, ``"1.5 GB"``, ``"100000"`` -> bytes (GB = 10**9, GiB = 2**30).

    Example:
        >>> parse_bytes("1GiB"), parse_bytes("2 MB")
        (1073741824, 2000000)
    """
    from ..errors import BudgetError

    if isinstance(text, int) and not isinstance(text, bool):
        return text
    s = str(text).strip().replace(" ", "")
    factors = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "k": 2**10, "m": 2**20,
               "g": 2**30, "b": 1}
    low = s.lower()
    for suffix in sorted(factors, key=len, reverse=True):
        if low.endswith(suffix):
            number, factor = low[: -len(suffix)], factors[suffix]
            break
    else:
        number, factor = low, 1
    try:
        value = float(number)
    except ValueError:
        raise BudgetError(f"cannot read {text!r} as a size; write e.g. 1GiB, 512MiB, 2GB or a "
                          "number of bytes") from None
    if value <= 0:
        raise BudgetError(f"a size must be positive, got {text!r}")
    return int(value * factor)
