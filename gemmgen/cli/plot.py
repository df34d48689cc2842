"""`gemmgen profile --plot`: per shape, the winner's TFLOP/s against torch SDPA's backends and
against the other candidates (matplotlib, an optional dependency: pip install 'gemmgen[plot]')."""
from __future__ import annotations

import importlib.util
import math
from typing import Any

from gemmgen.errors import InputError

SDPA_COLORS = {"flash": "tab:orange", "efficient": "tab:green", "cudnn": "tab:red"}


def require_matplotlib() -> None:
    """Raise InputError with the install command when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise InputError("--plot needs matplotlib, which is not installed: pip install 'gemmgen[plot]' "
                         "(or pip install matplotlib)")


def draw(results: list[tuple[Any, Any, dict[str, tuple[float, str | None]]]], path: str) -> None:
    """One group per shape: the other candidates (grey dots), the winner (blue bar), each SDPA backend."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gemmgen.select.shapes import tflops

    width = 0.2
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(results)), 4.5))
    for x, (shape, result, sdpa) in enumerate(results):
        winner = result.winner
        others = [tflops(shape, m.ms) for m in result.measurements if m.ok and m is not winner]
        ax.scatter([x - 1.5 * width] * len(others), others, color="grey", s=12,
                   label="other candidates" if x == 0 else None, zorder=3)
        ax.bar(x - 1.5 * width, tflops(shape, winner.ms) if winner else 0.0, width, color="tab:blue",
               label="gemmgen winner" if x == 0 else None)
        for i, (backend, color) in enumerate(SDPA_COLORS.items()):
            ms = sdpa.get(backend, (math.inf, None))[0]
            ax.bar(x + (i - 0.5) * width, tflops(shape, ms), width, color=color,
                   label=f"torch sdpa {backend}" if x == 0 else None)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels([s.describe().replace(" d=", "\nd=") for s, _, _ in results], rotation=60,
                       ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
