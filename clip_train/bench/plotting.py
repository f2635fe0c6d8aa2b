"""The benchmarks' ``--plot``: matplotlib is the optional ``bench`` extra, drawn to files only."""

from __future__ import annotations

from types import ModuleType

from clip_train.errors import UserError


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend, or a one-line error naming the extra to install."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'clip_train[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
