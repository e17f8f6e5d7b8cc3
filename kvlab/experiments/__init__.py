"""Experiments and runs: the cost model (``cost``), public traces (``traces``), the notebook runner
and its parameter grids (``runner``, ``grid``, ``kernel``), model-free replays of real stores
(``replay``) and the demo (``demo``). The simulator lives in ``kvlab.sim``."""
