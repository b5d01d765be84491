"""Saving a script's matplotlib figures: what the tutorials do when run by hand.

Rendered in the docs, a tutorial's figures are captured into the page by sphinx-gallery.
Run as a plain script (``python tutorials/05_hashevict.py``), with no window to show them
in, they would be lost; :func:`save_figures` writes every open figure to a PNG file and
says where: by default in :func:`default_folder` (``~/.cache/refkv/figures``), outside any
source tree, or in the folder named by ``$REFKV_FIGURES``.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

from .files import OutputFolder

__all__ = ["FIGURES_VARIABLE", "PLOT_INSTALL", "default_folder", "pyplot", "save_figures"]

#: Environment variable naming the folder figures go to (default: :func:`default_folder`).
FIGURES_VARIABLE = "REFKV_FIGURES"


#: How to get matplotlib, the ``plot`` extra.
PLOT_INSTALL = "pip install -e '.[plot]' in a refkv checkout, or pip install matplotlib"


def pyplot(who: str = "This script"):
    """``matplotlib.pyplot``, or a one-line exit naming the ``plot`` extra if it is missing.

    Parameters
    ----------
    who : str
        What needs it, for the message (``"Tutorial 3"``).

    Raises
    ------
    SystemExit
        With the message ``"<who> draws figures and needs matplotlib (the plot extra): ..."``
        when matplotlib is not installed, so a script stops with one line, not a traceback.
    """
    try:
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        raise SystemExit(f"{who} draws figures and needs matplotlib (the plot extra): {PLOT_INSTALL}") from None
    return plt


def default_folder() -> Path:
    """Where figures go unless told otherwise: ``$REFKV_FIGURES`` if set, else
    ``refkv/figures`` in the user's cache folder (``$XDG_CACHE_HOME``, default ``~/.cache``).

    Never the script's folder: a tutorial run from a checkout must not add files to it.
    """
    chosen = os.environ.get(FIGURES_VARIABLE)
    if chosen:
        return Path(chosen)
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "refkv" / "figures"


def save_figures(script=None, folder=None, *, dpi: int = 100, stream=None) -> list[Path]:
    """Save every open matplotlib figure as ``<script name>-<n>.png`` and print the paths.

    Parameters
    ----------
    script : str or PathLike, optional
        The script whose figures these are; names the files.
        Default: the running script, ``sys.argv[0]`` (sphinx-gallery, which runs the
        tutorials for the docs, defines no ``__file__``; it never gets this far).
    folder : str or PathLike, optional
        Where to write; default: :func:`default_folder` (``$REFKV_FIGURES`` if set, else
        ``~/.cache/refkv/figures``). Created if missing.
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
    touched: the files are written through :class:`refkv.files.OutputFolder` (no symlink
    followed, the script itself never replaced).
    """
    if "sphinx_gallery" in sys.modules:
        return []
    import matplotlib.pyplot as plt

    script = Path(script if script is not None else (sys.argv[0] or "figure")).resolve()
    target = Path(folder) if folder is not None else default_folder()
    numbers = plt.get_fignums()
    if not numbers:
        return []
    folder = OutputFolder(target, inputs=[script], what="figures folder")
    stream = sys.stdout if stream is None else stream
    written = []
    for index, number in enumerate(numbers, start=1):
        buffer = io.BytesIO()
        plt.figure(number).savefig(buffer, format="png", dpi=dpi)
        path = folder.write_bytes(f"{script.stem}-{index}.png", buffer.getvalue())
        written.append(path)
        print(f"saved figure {index} of {len(numbers)}: {path}", file=stream)
    return written
