"""How the benchmarks draw: matplotlib on its file-only backend, and no plot where matplotlib is missing."""
from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType | None:
    """matplotlib.pyplot on the Agg backend (no display needed); None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
