"""The CSV tables of the experiments' summaries: written atomically, read back for the console.

Numbers are written with six significant digits (``nan`` for NaN, empty for None), so
a table is stable across runs that agree to that precision.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from ..files import atomic_write

__all__ = ["csv_text", "format_table", "write_csv"]


def _cell(value):
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.6g}"
    if value is None:
        return ""
    return value


def csv_text(rows: list[dict], columns: list[str] | None = None) -> str:
    """``rows`` as the CSV text :func:`write_csv` writes (columns: given, or in order of appearance)."""
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _cell(row.get(k)) for k in columns})
    return buffer.getvalue()


def write_csv(path, rows: list[dict], columns: list[str] | None = None) -> Path:
    """Write ``rows`` as CSV atomically (temp file + ``os.replace``); return its path.

    ``path`` is a plain path or a :class:`refkv.files.Target` of the summary's guarded
    folder (``folder / "ppl.csv"``), written through its guards.
    """
    return atomic_write(path, csv_text(rows, columns))


def _rounded(text: str) -> str:
    """A table cell for the console: integers as written, other numbers to 3 significant digits."""
    try:
        value = float(text)
    except ValueError:
        return text
    if not math.isfinite(value):  # "nan": a gap with no full-cache run in the same table
        return text
    if value == int(value) and abs(value) < 1e6 and "." not in text:
        return text
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def format_table(path, columns) -> str | None:
    """The CSV at ``path`` as an aligned text table of ``columns`` (those it has), or None
    when there is no such file or it has no rows."""
    path = Path(path)
    if not path.is_file():
        return None
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return None
    columns = [c for c in columns if c in rows[0]]
    cells = [columns] + [[_rounded(row.get(c) or "-") for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return f"{path}:\n" + "\n".join("  " + line for line in lines)
