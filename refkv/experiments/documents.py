"""The phase-two population: 21 independent documents of 6 kinds, shipped with their provenance.

``refkv/data/documents/`` holds each document's text and ``PROVENANCE.json`` (source
package and version, author and title, licence, how the text was extracted, SHA-256),
written by ``docs/documents_extract.py``. The kinds: drama (5 Shakespeare plays), poetry
(2 by Shakespeare, 1 by Milton), essay (Milton's *Areopagitica*), encyclopaedic (the 1911
Britannica's Shakespeare article, Bierce's *Devil's Dictionary*, the Jargon File's lexicon),
technical documentation (5 Python HOWTOs) and code comments (the comments and docstrings of
4 standard-library modules).

Each document is tokenised once per model and cut into non-overlapping windows of a given
length (:func:`document_window`); the second registered phase gives every window one use
(a perplexity text, a calibration prompt or a test prompt), so no two prompts share text,
and the document, not the window, is its unit (``docs/experiment_registration_phase2.json``).
"""

from __future__ import annotations

import hashlib
from importlib.resources import files

import numpy as np

__all__ = ["DOCUMENT_KINDS", "document_kind", "document_names", "document_text", "document_window",
           "document_windows", "provenance"]

#: The kinds of text, in the order the pages list them.
DOCUMENT_KINDS = ("drama", "poetry", "essay", "encyclopaedic", "technical", "code comments")
#: Largest document read (the shipped ones are under 60,000 characters).
MAX_DOCUMENT_BYTES = 1 << 20

_TEXT: dict[str, str] = {}
_TOKENS: dict[tuple, np.ndarray] = {}


def provenance() -> list[dict]:
    """The entries of ``PROVENANCE.json``, one per document, in the shipped order."""
    from ..files import load_json

    path = files("refkv").joinpath("data", "documents", "PROVENANCE.json")
    data = load_json(str(path), MAX_DOCUMENT_BYTES, what="document provenance file")
    return list(data["documents"])


def document_names() -> tuple[str, ...]:
    """The documents' names, in the shipped order (kinds grouped)."""
    return tuple(entry["name"] for entry in provenance())


def document_kind(name: str) -> str:
    """The kind of text document ``name`` is (one of :data:`DOCUMENT_KINDS`)."""
    return _entry(name)["kind"]


def _entry(name: str) -> dict:
    entries = {entry["name"]: entry for entry in provenance()}
    if name not in entries:
        raise ValueError(f"document must be one of {', '.join(entries)}, got {name!r}")
    return entries[name]


def document_text(name: str) -> str:
    """The text of document ``name``, checked against its SHA-256 in ``PROVENANCE.json``.

    Raises
    ------
    ValueError
        If ``name`` is not a shipped document or its text does not match its recorded hash.
    """
    if name not in _TEXT:
        entry = _entry(name)
        data = files("refkv").joinpath("data", "documents", f"{name}.txt").read_bytes()
        if len(data) > MAX_DOCUMENT_BYTES or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ValueError(f"document {name!r}: its text does not match the SHA-256 in PROVENANCE.json")
        _TEXT[name] = data.decode("utf-8")
    return _TEXT[name]


def document_windows(model_name: str, dtype: str, name: str, length: int) -> int:
    """How many non-overlapping windows of ``length`` tokens document ``name`` holds."""
    return len(_document_tokens(model_name, dtype, name)) // _check_length(length)


def document_window(model_name: str, dtype: str, name: str, length: int, index: int) -> np.ndarray:
    """Tokens ``[index * length, (index + 1) * length)`` of document ``name`` (int64, (length,)).

    Raises
    ------
    ValueError
        If the document holds fewer than ``index + 1`` windows of ``length`` tokens.
    """
    length = _check_length(length)
    tokens = _document_tokens(model_name, dtype, name)
    available = len(tokens) // length
    if not 0 <= index < available:
        raise ValueError(f"index must be in [0, {available}) for document {name!r} in windows of "
                         f"{length} tokens, got {index}")
    return tokens[index * length:(index + 1) * length]


def _check_length(length) -> int:
    from ..validation import check_int

    return check_int("length", length, 2)


def _document_tokens(model_name: str, dtype: str, name: str) -> np.ndarray:
    from .models import load_model

    key = (model_name, dtype, name)
    if key not in _TOKENS:
        _, tokenizer = load_model(model_name, dtype)
        _TOKENS[key] = np.asarray(tokenizer.encode(document_text(name)), dtype=np.int64)
    return _TOKENS[key]
