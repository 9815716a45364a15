"""How the benchmarks draw: matplotlib (pinned in the `bench` extra) on its file-only Agg backend."""
from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend: plots are written to files, no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
