"""Small text formatting helpers shared by the library and the CLI (a leaf module)."""

from __future__ import annotations

import numpy as np

__all__ = ["format_position_set", "format_ranges"]


def format_ranges(positions: np.ndarray) -> str:
    """Compress sorted positions into ``"0-3,120-135"`` style ranges (``"-"`` when empty)."""
    if len(positions) == 0:
        return "-"
    parts, start, prev = [], int(positions[0]), int(positions[0])
    for p in map(int, positions[1:]):
        if p != prev + 1:
            parts.append(f"{start}-{prev}" if prev > start else str(start))
            start = p
        prev = p
    parts.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(parts)


def format_position_set(positions) -> str:
    """Positions in any order (a kept set) as sorted ranges: :func:`format_ranges` of them sorted."""
    return format_ranges(np.sort(np.asarray(positions)))
