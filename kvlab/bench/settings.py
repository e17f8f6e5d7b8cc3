"""What a benchmark section may read: the model (loaded once, only when a section needs it),
repeats and per-section options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..primitives.display import summary_html


@dataclass
class Settings:
    """One ``kvlab bench`` run's options, shared by every section.

    Example:
        >>> Settings("tiny", repeats=3)
        Settings(model_name='tiny', repeats=3, ttft_system_tokens=1000, model=None, dtype=None)
    """

    model_name: str = "smollm2"
    repeats: int = 5
    ttft_system_tokens: int = 1000
    model: Any = None
    dtype: str | None = None  # what ``--dtype`` asked for; None: the model's stored dtype

    def _repr_html_(self) -> str:
        return summary_html(repr(self), code=True)
