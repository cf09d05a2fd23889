"""How the summary writes its figures: fractions as percentages, seconds in a readable unit."""

from __future__ import annotations


def percent(x: float) -> str:
    """``0.9512`` as ``95.12 %``."""
    return f"{100 * x:.2f} %"


def duration(seconds: float) -> str:
    """Seconds below two minutes, minutes below two hours, else hours."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
