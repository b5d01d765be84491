"""Saving a script's matplotlib figures: what the tutorials do when run by hand.

Rendered in the docs, a tutorial's figures are captured into the page by sphinx-gallery.
Run as a plain script (``python tutorials/05_hashevict.py``), with no window to show them
in, they would be lost; :func:`save_figures` writes every open figure to a PNG file and
says where.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

from .files import atomic_write

__all__ = ["FIGURES_VARIABLE", "save_figures"]

#: Environment variable naming the folder figures go to (default: next to the script).
FIGURES_VARIABLE = "REFKV_FIGURES"


def save_figures(script=None, folder=None, *, dpi: int = 100, stream=None) -> list[Path]:
    """Save every open matplotlib figure as ``<script name>-<n>.png`` and print the paths.

    Parameters
    ----------
    script : str or PathLike, optional
        The script whose figures these are; names the files and, by default, the folder.
        Default: the running script, ``sys.argv[0]`` (sphinx-gallery, which runs the
        tutorials for the docs, defines no ``__file__``; it never gets this far).
    folder : str or PathLike, optional
        Where to write; default: the folder in ``$REFKV_FIGURES`` if set, else the
        script's own folder. Created if missing.
    dpi : int
        Resolution of the PNG files.
    stream : file, default sys.stdout
        Where the "saved ..." lines go.

    Returns
    -------
    list of Path
        The files written, in figure order; empty under sphinx-gallery (the docs build
        captures the figures itself) or when no figure is open.

    Notes
    -----
    Each file is written to a temporary name in the same folder and renamed into place,
    so an interrupted run never leaves a half-written image. Nothing outside ``folder`` is
    touched.
    """
    if "sphinx_gallery" in sys.modules:
        return []
    import matplotlib.pyplot as plt

    script = Path(script if script is not None else (sys.argv[0] or "figure")).resolve()
    target = Path(folder if folder is not None else os.environ.get(FIGURES_VARIABLE) or script.parent)
    numbers = plt.get_fignums()
    if not numbers:
        return []
    target.mkdir(parents=True, exist_ok=True)
    stream = sys.stdout if stream is None else stream
    written = []
    for index, number in enumerate(numbers, start=1):
        path = target / f"{script.stem}-{index}.png"
        buffer = io.BytesIO()
        plt.figure(number).savefig(buffer, format="png", dpi=dpi)
        atomic_write(path, buffer.getvalue())
        written.append(path)
        print(f"saved figure {index} of {len(numbers)}: {path}", file=stream)
    return written
