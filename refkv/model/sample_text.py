"""Real English prose available offline, from two sources.

* :func:`english_prose`: CPython's ``pydoc_data.topics``, which every Python installation
  carries: the language reference's help pages (what ``help("assignment")`` shows), of which
  only the prose paragraphs are kept. Technical English, licensed under the PSF License.
* :func:`narrative_prose`: narrative chapters of the King James Version of the Bible (1611,
  public domain; in the United Kingdom the text is under perpetual Crown patent, which
  restricts printing there, not research use), shipped as ``refkv/data/kjv_narratives.txt``:
  Genesis 37-50 (the story of Joseph), Ruth, Esther and Jonah, one chapter per paragraph,
  verse numbers removed. Taken from Debian's ``bible-kjv-text`` 4.38 (read with its
  ``bible`` program), whose copyright file states the text's copyright has expired.
  Early-modern narrative English, about 110,000 characters (some 26,000 SmolLM2 tokens).

Tests, benchmarks and experiments measure perplexity and speed on them with no download.

Notes
-----
A paragraph (lines between blank lines) counts as prose when none of its lines is
indented (indented lines are grammar rules, code or tables), it has at least 20 words,
and it ends with a full stop. Topics are visited in sorted order, so the text is
deterministic for a given Python version (the docs change a little between versions;
tests assert properties of the text, never its exact content).
"""

from __future__ import annotations

import re

__all__ = ["PROSE_SOURCES", "english_prose", "narrative_prose", "prose"]

_MIN_WORDS = 20


def english_prose(min_chars: int = 10_000) -> str:
    """At least ``min_chars`` characters of prose paragraphs, joined by blank lines.

    Raises
    ------
    ValueError
        If ``min_chars < 1`` or the installed topics hold less prose than asked for.
    """
    if min_chars < 1:
        raise ValueError(f"min_chars must be >= 1, got {min_chars}")
    from pydoc_data.topics import topics

    paragraphs, total = [], 0
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            lines = block.strip("\n").splitlines()
            if not lines or any(line[:1].isspace() for line in lines):
                continue
            text = " ".join(line.strip() for line in lines)
            if len(text.split()) >= _MIN_WORDS and text.endswith("."):
                paragraphs.append(text)
                total += len(text) + 2
                if total >= min_chars:
                    return "\n\n".join(paragraphs)
    raise ValueError(f"pydoc_data.topics holds only {total} characters of prose, fewer than min_chars={min_chars}")


def narrative_prose() -> str:
    """The shipped King James narrative chapters (Genesis 37-50, Ruth, Esther, Jonah), one
    chapter per paragraph, paragraphs separated by blank lines."""
    from importlib.resources import files

    return files("refkv").joinpath("data", "kjv_narratives.txt").read_text(encoding="utf-8")


#: The offline prose sources by the name experiments record (``"text"`` in a cell's parameters).
PROSE_SOURCES = ("pydoc_prose", "kjv_narrative")


def prose(source: str, min_chars: int) -> str:
    """At least ``min_chars`` characters of the prose source ``source`` (one of
    :data:`PROSE_SOURCES`), or (nearly) all of it when it holds fewer.

    Raises
    ------
    ValueError
        If ``source`` is not one of :data:`PROSE_SOURCES` or ``min_chars < 1``.
    """
    if source not in PROSE_SOURCES:
        raise ValueError(f"source must be one of {', '.join(PROSE_SOURCES)}, got {source!r}")
    if min_chars < 1:
        raise ValueError(f"min_chars must be >= 1, got {min_chars}")
    if source == "kjv_narrative":
        return narrative_prose()
    try:
        return english_prose(min_chars)
    except ValueError:  # asked for more than there is: take (nearly) all of it
        return english_prose(_ALL_PYDOC_PROSE)


# Characters of prose every supported CPython's pydoc topics hold (3.11 has ~154,000).
_ALL_PYDOC_PROSE = 120_000
