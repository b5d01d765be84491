"""The text of the experiments: real English prose, tokenised once per model.

Two offline sources (:data:`refkv.model.sample_text.PROSE_SOURCES`): CPython's
``pydoc_data.topics`` (``"pydoc_prose"``, technical) and the shipped King James narrative
chapters (``"kjv_narrative"``). Each source is tokenised once per model; segment ``s`` of
length ``T`` is tokens ``[s T, (s + 1) T)`` of that stream, so segments of a source never
overlap. Perplexity takes its texts from both sources in turn (:func:`text_source`); the
other experiments read ``pydoc_prose``.
"""

from __future__ import annotations

import numpy as np

from ..model.sample_text import PROSE_SOURCES, prose
from .models import load_model

__all__ = ["cell_tokens", "prose_tail", "prose_tokens", "text_source"]

_TOKENS: dict[tuple, np.ndarray] = {}


def prose_tokens(model_name: str, dtype: str, length: int, segment: int = 0,
                 source: str = "pydoc_prose") -> np.ndarray:
    """Tokens ``[segment * length, (segment + 1) * length)`` of the tokenised prose ``source``
    (one of :data:`refkv.model.sample_text.PROSE_SOURCES`)."""
    if length < 2 or segment < 0:
        raise ValueError(f"length must be >= 2 and segment >= 0, got {length} and {segment}")
    _, tokenizer = load_model(model_name, dtype)
    key = (model_name, dtype, source)
    needed = (segment + 1) * length
    if key not in _TOKENS or len(_TOKENS[key]) < needed:
        # ~4.5 characters per BPE token of English, 1 per byte token: 8 is generous
        _TOKENS[key] = np.asarray(tokenizer.encode(prose(source, needed * 8)), dtype=np.int64)
    tokens = _TOKENS[key]
    if len(tokens) < needed:
        raise ValueError(f"the prose {source!r} holds {len(tokens)} tokens; segment {segment} of length "
                         f"{length} needs {needed}")
    return tokens[segment * length:needed]


def prose_tail(model_name: str, dtype: str, source: str, start: int) -> np.ndarray:
    """All tokens of the prose ``source`` from token ``start`` on (the passkey haystacks of
    the registered design draw from beyond the perplexity segments)."""
    _, tokenizer = load_model(model_name, dtype)
    key = (model_name, dtype, source, "all")
    if key not in _TOKENS:
        _TOKENS[key] = np.asarray(tokenizer.encode(prose(source, _ALL_PROSE_CHARS)), dtype=np.int64)
    tokens = _TOKENS[key]
    if len(tokens) <= start:
        raise ValueError(f"the prose {source!r} holds {len(tokens)} tokens, none from token {start} on")
    return tokens[start:]


#: Characters asked of a prose source for its whole text (both shipped sources hold less).
_ALL_PROSE_CHARS = 120_000


def text_source(number: int) -> tuple[str, int]:
    """Text ``number`` of a perplexity grid: ``(source, segment)``, taking the sources of
    :data:`~refkv.model.sample_text.PROSE_SOURCES` in turn (text 0 is pydoc segment 0, text 1
    King James segment 0, text 2 pydoc segment 1, ...), so any number of texts spans both."""
    if number < 0:
        raise ValueError(f"number must be >= 0, got {number}")
    return PROSE_SOURCES[number % len(PROSE_SOURCES)], number // len(PROSE_SOURCES)


def cell_tokens(params: dict) -> np.ndarray:
    """A dense cell's prompt: the first ``params["length"]`` tokens of its text.

    A cell names its text by ``"text"`` (a prose source, default the pydoc prose) and
    ``"segment"``; with ``"text_length"`` the segment is counted in texts of that length and
    the prompt is that text's first ``length`` tokens (the registered design's prompts are
    the first 512 tokens of the 1,024-token perplexity texts), else in prompts of ``length``.
    """
    length = params["length"]
    text_length = params.get("text_length") or length
    if text_length < length:
        raise ValueError(f"text_length must be >= length ({length}), got {text_length}")
    tokens = prose_tokens(params["model"], params["dtype"], text_length, params["segment"],
                          params.get("text", "pydoc_prose"))
    return tokens[:length]


_CAPTURES: dict[tuple, tuple] = {}
