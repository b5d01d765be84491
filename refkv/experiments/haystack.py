"""Passkey prompts in natural text, and the registered passkey grid.

The registered design (``docs/guide/registration.rst``) replaces the repeated filler and
the five fixed depths of the first passkey grid: each prompt is a window of natural prose
from one of the shipped sources at a random offset, with the needle at the sentence end
nearest a random depth. In a repeated filler the needle is, by construction, the most
distinctive key of the prompt, which favours policies that keep distinctive keys; in prose
it is one sentence among many.

What a prompt is, given its registered draw (``seed, length, sample``):

* **source**: the two prose sources of :data:`refkv.model.sample_text.PROSE_SOURCES`
  alternate by sample;
* **window**: a random offset into the source's tokens *after* the first
  :data:`RESERVED_SEGMENTS` segments of 1,024 tokens, which the perplexity texts use, so
  no passkey haystack repeats a perplexity text;
* **depth**: uniform in [0.05, 0.95]; the needle goes after the sentence end (".", "!" or
  "?" and white space) nearest that fraction of the haystack's characters;
* **key**: a random 5-digit number.

Calibration prompts draw with a different stream from test prompts (``purpose``), so the
two sets never share a prompt.
"""

from __future__ import annotations

import re

import numpy as np

from ..validation import check_choice, check_int

__all__ = [
    "ANSWER_PREFIX",
    "CALIBRATION_LENGTHS",
    "DOCUMENT_SEED",
    "DOCUMENT_WINDOWS",
    "NEEDLE",
    "QUESTION",
    "RESERVED_SEGMENTS",
    "build_document_prompt",
    "build_text_prompt",
    "document_draw",
    "draw",
]

#: The needle and question of the registered design (amendment 1: "secret number").
NEEDLE = "The secret number is {key}. Remember it."
QUESTION = "What is the secret number?"
ANSWER_PREFIX = "The secret number is"
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")

#: Perplexity segments (1,024 tokens each, per source) no haystack may overlap: 8 verdict
#: texts and 2 selection texts per source.
RESERVED_SEGMENTS = 10
#: The lengths the calibration considers (registered).
CALIBRATION_LENGTHS = (512, 768, 1024)
#: The streams of the registered draws; calibration and test prompts never share one.
PURPOSES = {"calibration": 1, "test": 2}


def draw(seed: int, length: int, sample: int, purpose: str) -> dict:
    """The registered random draw of one prompt: source, offset fraction, depth and key."""
    from ..model.sample_text import PROSE_SOURCES

    check_choice("purpose", purpose, tuple(PURPOSES))
    rng = np.random.default_rng([check_int("seed", seed, 0), check_int("length", length, 64),
                                 check_int("sample", sample, 0), PURPOSES[purpose]])
    return {"source": PROSE_SOURCES[sample % len(PROSE_SOURCES)], "offset": float(rng.uniform()),
            "depth": float(rng.uniform(0.05, 0.95)), "key": int(rng.integers(10000, 100000))}


#: A sentence end: ".", "!" or "?" (and a closing quote or bracket), then white space.
_SENTENCE_END = re.compile(r"[.!?][\"')\]]?\s+")


def _needle_at(haystack: str, depth: float) -> int:
    """Character index just after the sentence end nearest ``depth`` of the haystack (0 if none)."""
    ends = [match.end() for match in _SENTENCE_END.finditer(haystack)]
    if not ends:
        return 0
    target = depth * len(haystack)
    return min(ends, key=lambda i: abs(i - target))


def build_text_prompt(tokenizer, source_tokens: np.ndarray, length: int, depth: float, key: int,
                      offset: float) -> tuple[list[int], int]:
    """A natural-text passkey prompt of about ``length`` tokens and the token index of its key.

    Parameters
    ----------
    tokenizer
        The model's tokenizer (``encode``, ``decode``).
    source_tokens : (n,) ints
        The source's tokens, beyond the reserved perplexity segments.
    length : int
        Target prompt length in tokens (intro, haystack, needle, question together).
    depth : float in [0, 1]
        Where the needle goes, as a fraction of the haystack's characters (moved to the
        nearest sentence end).
    key : int
        The five-digit secret number.
    offset : float in [0, 1)
        Where the haystack window starts, as a fraction of the room the source leaves.

    Returns
    -------
    tokens : list of int
    key_at : int
        Index of the first token of the key's last four digits (-1 if the tokenizer merged
        them with their neighbours).
    """
    needle = NEEDLE.format(key=key)
    frame = f"{INTRO}\n\n{needle}\n\n{QUESTION} {ANSWER_PREFIX}"
    room = check_int("length", length, 64) - len(tokenizer.encode(frame))
    if room < 16:
        raise ValueError(f"length must leave room for a haystack: {length} tokens hold only the frame")
    if len(source_tokens) <= room:
        raise ValueError(f"the source holds {len(source_tokens)} tokens, fewer than a {room}-token haystack")
    start = int(offset * (len(source_tokens) - room))
    haystack = tokenizer.decode(source_tokens[start:start + room]).strip()
    at = _needle_at(haystack, depth)
    text = f"{INTRO}\n\n{haystack[:at]}{needle} {haystack[at:]}\n\n{QUESTION} {ANSWER_PREFIX}"
    tokens = list(tokenizer.encode(text))
    digits = list(tokenizer.encode(str(key)[1:]))
    key_at = next((i for i in range(len(tokens) - len(digits) + 1) if tokens[i:i + len(digits)] == digits), -1)
    return tokens, key_at


# -- phase two: prompts from the shipped documents ------------------------------------------
#: The seed of phase two's keys and depths (phase one used 0 and 1, its pilot 12345).
DOCUMENT_SEED = 2
#: Phase two's windows of 1,024 tokens per document, by purpose (docs/experiment_registration_phase2.json).
DOCUMENT_WINDOWS = {"perplexity": (0, 1), "calibration": (2, 3), "test": tuple(range(4, 11))}
#: The width of the windows the documents are cut into.
WINDOW_TOKENS = 1024


def document_draw(seed: int, document: str, window: int) -> dict:
    """Phase two's random draw for the prompt made of ``window`` of ``document``: its depth and key.

    The stream depends on the document's place in the shipped list, the window and the seed
    only, never on the policy or the budget, so every policy answers the same prompts.
    """
    from .documents import document_names

    names = document_names()
    if document not in names:
        raise ValueError(f"document must be one of {', '.join(names)}, got {document!r}")
    rng = np.random.default_rng([check_int("seed", seed, 0), names.index(document),
                                 check_int("window", window, 0), 3])
    return {"depth": float(rng.uniform(0.05, 0.95)), "key": int(rng.integers(10000, 100000))}


def build_document_prompt(model_name: str, dtype: str, tokenizer, document: str, window: int, length: int,
                          seed: int = DOCUMENT_SEED) -> tuple[list[int], int, dict]:
    """A passkey prompt of about ``length`` tokens whose haystack is window ``window`` of ``document``.

    The haystack is the start of the window (1,024 tokens of the document, cut to the room the
    frame leaves), so prompts of different windows share no text.

    Returns
    -------
    tokens : list of int
    key_at : int
        Index of the first token of the key's last four digits (-1 if merged with neighbours).
    draw : dict
        ``depth`` and ``key`` (:func:`document_draw`).
    """
    from .documents import document_window

    check_int("length", length, 64, WINDOW_TOKENS)
    d = document_draw(seed, document, window)
    source = document_window(model_name, dtype, document, WINDOW_TOKENS, window)
    tokens, key_at = build_text_prompt(tokenizer, source, length, d["depth"], d["key"], 0.0)
    return tokens, key_at, d
