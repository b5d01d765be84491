"""The one place where parameter checks live.

Every public entry point (policies, engine, loaders, oracle, experiments, CLI) validates
its arguments with these helpers, so that a bad value always gets the same kind of
message: one line, naming the parameter and the range it may take, as a ``ValueError``.
The CLI turns that ValueError into ``error: ...`` and exit status 2.
"""

from __future__ import annotations

import math
import re

import numpy as np

__all__ = ["MAX_CONTEXT", "check_choice", "check_context", "check_float", "check_int", "check_lengths", "check_prompt",
           "check_size", "shown"]


#: The longest context, in tokens, any parameter counted in tokens may span (a window, a
#: kernel, future positions, a prompt): no model refkv reads has a longer one, and every
#: such parameter is checked against it before anything is sized by it.
MAX_CONTEXT = 2**17


def shown(value, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages (a 400-digit integer stays one short line)."""
    try:
        text = repr(value) if not isinstance(value, int) or abs(value) < 10**limit else f"{value:.3e}"
    except (ValueError, OverflowError):  # an int too large for repr (Python's digit limit)
        text = f"an integer of about {value.bit_length()} bits"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    """Validate an integer parameter and return it as a Python ``int``.

    Parameters
    ----------
    name : str
        The parameter's name, as the user wrote it; the error message starts with it.
    value : object
        The value to check. ``bool`` is refused although it is an ``int`` subclass.
    low, high : int
        Inclusive bounds; ``high=None`` means no upper bound.

    Raises
    ------
    ValueError
        ``"{name} must be an integer >= {low}, got {value!r}"`` (or ``in [low, high]``).
    """
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if not ok or value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {allowed}, got {shown(value)}")
    return int(value)


def check_size(name: str, value, low: int, high: int, *, why: str = "") -> int:
    """An integer size, count, id or length, always with an upper bound (checked before allocating).

    Like :func:`check_int` with ``high`` required; ``why`` says where the bound comes from
    (``"the model's context"``, ``"the file's size"``) and is added to the message.
    """
    try:
        return check_int(name, value, low, high)
    except ValueError as err:
        raise ValueError(f"{err} ({why})" if why else str(err)) from None


def check_float(name: str, value, low: float | None = None, high: float | None = None, *,
                low_open: bool = False, high_open: bool = False) -> float:
    """Validate a finite real parameter and return it as a Python ``float``.

    NaN and infinities are always refused: no parameter of refkv has a meaning for them,
    and accepting them silently is how a tolerance of ``inf`` would make every check pass.

    Parameters
    ----------
    name : str
        The parameter's name for the message.
    value : object
        An ``int``, ``float`` or NumPy real scalar (``bool`` is refused).
    low, high : float or None
        Bounds; ``None`` leaves that side unbounded.
    low_open, high_open : bool
        Exclude the bound itself (``(low, high]`` etc.).
    """
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if ok:
        try:
            ok = math.isfinite(float(value))
        except OverflowError:  # an integer beyond the float range (400 digits)
            ok = False
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        if low is None:
            left = "("
        if high is None:
            right = ")"
        raise ValueError(f"{name} must be a finite number in {left}{lo}, {hi}{right}, got {shown(value)}")
    return float(value)


def check_choice(name: str, value, choices) -> object:
    """Validate that ``value`` is one of ``choices`` (compared with ``==``)."""
    choices = tuple(choices)
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {listed}, got {shown(value)}")
    return value


def check_context(n_tokens: int, max_positions: int, what: str = "prompt") -> int:
    """Refuse ``n_tokens`` beyond the model's context (``max_positions``) before any token runs.

    Positions past the context were never trained (RoPE extrapolates badly) and a prompt of
    100,000 tokens would take quadratic memory: the answer would be wrong or never come.
    """
    if n_tokens > max_positions:
        raise ValueError(f"{what} has {n_tokens} tokens, more than the model's context of {max_positions} "
                         f"(max_positions); shorten it")
    return n_tokens


def check_lengths(lengths, max_positions: int | None = None, *, model: str = "the model",
                  within: tuple[str, ...] = ()) -> dict[str, int]:
    """Check lengths counted in tokens against the hard cap and the model's context, before any use.

    The one check of every prompt length, number of new tokens, passkey length and
    compression interval a caller sizes anything by: each must be an integer in
    ``[low, MAX_CONTEXT]`` (:data:`MAX_CONTEXT`, the hard cap, checked first so that a
    length of 10**9 is refused before a model is even read), and the tokens the run will
    hold together -- the sum of the lengths named in ``within`` (a prompt and the tokens
    decoded after it) -- must fit the model's context ``max_positions``. Positions past the
    context were never trained, and their arrays grow with the length: the answer would be
    wrong or never come.

    Parameters
    ----------
    lengths : dict
        ``{name: (value, low)}``, names as the user wrote them (``"--prompt-length"``); a
        value of ``None`` is skipped (not given).
    max_positions : int, optional
        The model's context (``ModelConfig.max_positions``); ``None`` checks the hard cap only.
    model : str
        The model's name, for the message.
    within : tuple of str
        The names whose sum must fit the context (each length alone must always fit it).

    Returns
    -------
    dict
        ``{name: int(value)}`` of the lengths given.

    Raises
    ------
    ValueError
        ``"--new-tokens must be an integer in [0, 131072], got 1000000000 (the hard cap on lengths in tokens)"``,
        or ``"--prompt-length 4090 + --new-tokens 64 = 4154 tokens, more than the context of tiny (4096
        positions, max_positions)"``.
    """
    checked = {}
    for name, (value, low) in lengths.items():
        if value is not None:
            checked[name] = check_size(name, value, low, MAX_CONTEXT, why="the hard cap on lengths in tokens")
    if max_positions is None:
        return checked
    for name, value in checked.items():
        if value > max_positions:
            raise ValueError(f"{name} {value} is more than the context of {model} ({max_positions} positions, "
                             f"max_positions)")
    parts = [name for name in within if name in checked]
    total = sum(checked[name] for name in parts)
    if len(parts) > 1 and total > max_positions:
        raise ValueError(f"{' + '.join(f'{name} {checked[name]}' for name in parts)} = {total} tokens, more than "
                         f"the context of {model} ({max_positions} positions, max_positions)")
    return checked


def check_prompt(prompt) -> str:
    """Return ``prompt`` if it is text that came from valid UTF-8; a ValueError otherwise.

    Python hands over undecodable bytes of ``argv`` (and of stdin read with
    ``surrogateescape``) as lone surrogates ``U+DC80..U+DCFF``; the message shows the byte
    and its offset in the prompt as the user gave it (before any chat template wraps it).
    """
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
    match = _SURROGATE.search(prompt)
    if match is None:
        return prompt
    code = ord(match.group())
    offset = len(prompt[:match.start()].encode("utf-8"))  # the first bad character: the prefix is clean
    if 0xDC80 <= code <= 0xDCFF:
        raise ValueError(f"prompt is not valid UTF-8: byte 0x{code - 0xDC00:02x} at byte {offset} of the prompt")
    raise ValueError(f"prompt is not valid Unicode: lone surrogate U+{code:04X} at byte {offset} of the prompt")


_SURROGATE = re.compile("[\ud800-\udfff]")
