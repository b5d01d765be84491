"""Write the student edition of the tutorials: every script with its exercises, without
the solutions.

Usage::

    python tutorials/make_student_edition.py FOLDER

writes ``FOLDER/NN_name.py`` for each numbered tutorial, plus ``FOLDER/README.rst`` (so
that sphinx-gallery can render the folder as a gallery of its own). Each copy runs like
the original up to the exercises; where an exercise asks for a function to be written,
the copy keeps its empty version (it raises ``NotImplementedError``), and the solution
that replaces it in the teacher's edition is gone. The teacher's edition is the
``tutorials/`` folder itself: its solutions are executed and asserted by
``tests/docs/test_tutorials.py``, which also checks that this edition holds none of
their code and still runs.

Nothing outside FOLDER is written, every file atomically; FOLDER may not be the
tutorials' own folder.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

TUTORIALS = pathlib.Path(__file__).resolve().parent
SOLUTIONS = "# Solutions\n# ---------\n"
FIGURES = "# %%\n# Saving the figures\n"
NOTE = ("# Your answers\n"
        "# ------------\n"
        "# Write them in the cell below; the teacher's edition of this tutorial has\n"
        "# the solutions, checked by refkv's test suite.\n"
        "\n"
        "# (your code here)\n"
        "\n")

STUDENT_NOTE = ("**This is the student edition:** the exercises below have no "
                "solutions here, only a\ncell for your answers. The solutions are in "
                "the tutorials of :ref:`tutorials`.\n\n")


def student_text(text: str, name: str = "tutorial") -> str:
    """The student version of one tutorial's source: the solutions section removed.

    The section runs from the ``Solutions`` heading (in the exercises' comment block, or
    opening a cell of its own) to the ``Saving the figures`` cell, which is kept.
    """
    if text.count(SOLUTIONS) != 1 or text.count(FIGURES) != 1:
        raise ValueError(f"{name} must have one 'Solutions' heading and one "
                         "'Saving the figures' cell")
    start, end = text.index(SOLUTIONS), text.index(FIGURES)
    if end < start:
        raise ValueError(f"{name}: the solutions must come before 'Saving the figures'")
    head = text[:start]
    # The heading is the tail of the exercises' comment block ("#\n# Solutions") or the
    # start of a cell of its own ("# %%\n# Solutions"): drop that separator too.
    for separator in ("#\n", "# %%\n"):
        if head.endswith(separator):
            head = head[:-len(separator)]
            break
    if not head.endswith("\n\n"):
        head = head.rstrip("\n") + "\n\n"
    return head + "# %%\n" + NOTE + text[end:]


def scripts() -> list[pathlib.Path]:
    """The numbered tutorials, in order."""
    return sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))


def write_edition(folder, suffix: str = "") -> list[pathlib.Path]:
    """Write the student edition into ``folder``; returns the paths written.

    ``suffix`` is added to each script's name (``00_bytes_and_sinks_student.py``): the
    documentation renders both editions, and sphinx-gallery needs distinct names.
    """
    from refkv.files import atomic_write

    folder = pathlib.Path(folder).resolve()
    if folder == TUTORIALS:
        raise ValueError(f"folder must not be the tutorials' own folder ({TUTORIALS}): "
                         "the student edition would replace the solutions")
    written = []
    for script in scripts():
        text = student_text(script.read_text(encoding="utf-8"), script.name)
        written.append(atomic_write(folder / f"{script.stem}{suffix}.py", text))
    readme = (TUTORIALS / "README.rst").read_text(encoding="utf-8")
    title = "Read-along tutorials"
    heading = f"{title} (student edition)\n{'=' * (len(title) + 18)}\n\n"
    readme = readme.replace(f"{title}\n{'=' * len(title)}\n\n", heading + STUDENT_NOTE,
                            1)
    written.append(atomic_write(folder / "README.rst", readme.replace(
        ".. _tutorials:", ".. _tutorials_student:", 1)))
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Write the tutorials without their "
                                                 "solutions into FOLDER.")
    parser.add_argument("folder", help="where to write the student edition")
    args = parser.parse_args(argv)
    try:
        written = write_edition(args.folder)
    except (ValueError, OSError) as error:
        print(f"make_student_edition: {error}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files to {pathlib.Path(args.folder).resolve()}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(TUTORIALS.parent))  # this checkout's refkv
    raise SystemExit(main())
