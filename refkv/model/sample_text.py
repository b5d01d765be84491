"""Real English prose that every Python installation carries: CPython's ``pydoc_data.topics``.

The topics are the language reference's help pages (what ``help("assignment")`` shows).
:func:`english_prose` keeps only their prose paragraphs, so tests and benchmarks can
measure perplexity and speed on natural text with no download.

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

__all__ = ["english_prose"]

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
