"""Compression schedules: when a deployment evicts, and down to how many tokens.

:class:`~refkv.engine.Engine` evicts whenever a layer's cache exceeds its budget ``N``
(after every block of the prompt, after every generated token). Backends rarely do that:
kvpress's ``DecodingPress`` compresses the whole cache every ``K`` generated tokens down
to ``N`` and lets it grow in between; ``PrefillDecodingPress`` adds a one-time
compression of the prompt; ``CompressionRatioDecodingPress`` compresses every ``K``
tokens down to a fraction of the tokens seen so far. A :class:`Schedule` states such a
deployment and :func:`run_schedule` drives an engine through it.

Semantics (kvpress 0.5.5, ``presses/decoding_press.py``, matched exactly):

* **prefill**: the prompt is processed one-shot (``block_size=None``) or in blocks of
  ``B``; with a ``prefill_budget`` each block evicts as :class:`~refkv.engine.Engine`
  always does (one-shot: once, to ``prefill_budget``), without one it is not compressed
  (``DecodingPress`` alone only acts while decoding).
* **decoding**: tokens are fed one at a time. Each layer counts the decoding steps since
  its last compression; at the ``K``-th it compresses (after the token attended: the
  press is a forward hook of the attention layer), and the count restarts whether or not
  anything was evicted. ``rule="interval"`` compresses to ``N`` (``DecodingPress``: a
  cache of at most ``N`` tokens is left as it is, kvpress's compression ratio 0);
  ``rule="ratio"`` to ``max(1, int(seen * (1 - ratio)))`` with ``seen`` the tokens seen
  so far, the current one included (``CompressionRatioDecodingPress``). ``K = 1`` with
  ``rule="interval"`` is "keep at most ``N`` at every step", the engine's own rule.

A **round** is one scheduled compression step (a prefill block with a budget, or the
``K``-th decoding step); all layers hold the same number of tokens, so at a round either
every layer evicts or none does.

The driver changes nothing in the engine: at each step it sets the engine's ``budget``
(``None`` between rounds, so nothing is evicted) and calls
:meth:`~refkv.engine.Engine.forward`, restoring the budget afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np

from .engine import Engine, blocks
from .validation import check_int

__all__ = ["RULES", "Round", "Schedule", "run_schedule"]

#: Decoding rules: ``interval`` (compress to ``N`` every ``K`` steps, kvpress ``DecodingPress``),
#: ``ratio`` (to ``max(1, int(seen * (1 - ratio)))``, ``CompressionRatioDecodingPress``).
RULES = ("interval", "ratio")


@dataclass(frozen=True)
class Schedule:
    """A deployment's compression schedule (see the module docstring).

    Parameters
    ----------
    block_size : int or None
        Prefill blocks of ``B``; ``None`` is one-shot prefill.
    prefill_budget : int or None
        Tokens kept per layer and KV head after each prefill block; ``None``: the prompt
        is not compressed.
    interval : int
        ``K``: decoding steps between compressions (>= 1).
    budget : int or None
        ``N`` of ``rule="interval"``.
    rule : {"interval", "ratio"}
    ratio : float or None
        The fraction removed, ``0 <= ratio < 1``, of ``rule="ratio"``.
    new_tokens : int
        Decoding steps (tokens fed after the prompt).
    """

    block_size: int | None = None
    prefill_budget: int | None = None
    interval: int = 1
    budget: int | None = None
    rule: str = "interval"
    ratio: float | None = None
    new_tokens: int = 0

    def __post_init__(self):
        if self.block_size is not None:
            check_int("block_size", self.block_size, 1)
        if self.prefill_budget is not None:
            check_int("prefill_budget", self.prefill_budget, 1)
        check_int("interval", self.interval, 1)
        check_int("new_tokens", self.new_tokens, 0)
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if self.rule == "interval":
            if self.budget is None:
                raise ValueError("budget must be an integer >= 1 for rule='interval', got None")
            check_int("budget", self.budget, 1)
            if self.ratio is not None:
                raise ValueError(f"ratio must be None for rule='interval', got {self.ratio!r}")
        else:
            if self.budget is not None:
                raise ValueError(f"budget must be None for rule='ratio' (the ratio sets it), got {self.budget!r}")
            if (self.ratio is None or isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float))
                    or not 0 <= self.ratio < 1):
                raise ValueError(f"ratio must be a number in [0, 1) for rule='ratio', got {self.ratio!r}")

    def target(self, seen: int) -> int:
        """Tokens kept by a decoding round after ``seen`` tokens (the current one included)."""
        if self.rule == "interval":
            return self.budget
        return max(1, int(seen * (1 - self.ratio)))

    def to_dict(self) -> dict:
        """The schedule as JSON-ready fields (what a golden's manifest states)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> Schedule:
        """The schedule a manifest states; unknown or missing fields are a ValueError."""
        if not isinstance(fields, dict):
            raise ValueError(f"schedule must be an object, got {type(fields).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"schedule has unknown field(s) {unknown}; allowed: {sorted(known)}")
        return cls(**fields)

    def describe(self) -> str:
        """One line: ``"one-shot prefill to N=16, then every 4 tokens down to N=16 (12 tokens)"``, or
        ``"one-shot prefill to N=16, prefill only (no decoding rounds)"`` without new tokens."""
        pre = "one-shot prefill" if self.block_size is None else f"prefill in blocks of {self.block_size}"
        pre += f" to N={self.prefill_budget}" if self.prefill_budget is not None else " (not compressed)"
        if self.new_tokens == 0:
            return f"{pre}, prefill only (no decoding rounds)"
        to = f"N={self.budget}" if self.rule == "interval" else f"max(1, int(seen * (1 - {self.ratio:g})))"
        every = "every token" if self.interval == 1 else f"every {self.interval} tokens"
        return f"{pre}, then {every} down to {to} ({self.new_tokens} tokens)"


@dataclass(frozen=True)
class Round:
    """One scheduled compression step.

    Attributes
    ----------
    step : int
        Index of the :meth:`~refkv.engine.Engine.forward` call (prefill blocks first).
    phase : {"prefill", "decode"}
    budget : int
        Tokens kept per layer and KV head when the cache exceeds it.
    position : int
        Tokens processed once the step is done.
    """

    step: int
    phase: str
    budget: int
    position: int


@contextmanager
def _budget(engine: Engine, budget: int | None):
    saved = engine.budget
    engine.budget = budget
    try:
        yield
    finally:
        engine.budget = saved


def run_schedule(engine: Engine, prompt, new_tokens: Sequence[int], schedule: Schedule, *,
                 on_step: Callable[[int, Round | None], None] | None = None) -> tuple[np.ndarray, list[Round]]:
    """Drive ``engine`` through ``schedule``: the prompt, then ``new_tokens`` one at a time.

    Parameters
    ----------
    engine : Engine
        A fresh engine; its own ``budget`` is ignored (restored on return).
    prompt : sequence of ints
    new_tokens : sequence of ints
        The decoding steps' tokens (teacher-forced: a golden fixes them, so a candidate
        feeds the same ones); ``len(new_tokens)`` must be ``schedule.new_tokens``.
    schedule : Schedule
    on_step : callable, optional
        Called as ``on_step(step, round_or_None)`` after each forward call.

    Returns
    -------
    logits : (vocab,)
        Of the last token fed.
    rounds : list of Round

    Raises
    ------
    ValueError
        If the policy refuses a budget of the schedule (its ``check``), or an eviction (the
        policy's own errors).
    """
    if not isinstance(schedule, Schedule):
        raise ValueError(f"schedule must be a refkv.schedule.Schedule, got {type(schedule).__name__}")
    new_tokens = np.asarray(new_tokens, dtype=np.int64)
    if new_tokens.ndim != 1 or len(new_tokens) != schedule.new_tokens:
        raise ValueError(f"new_tokens must hold schedule.new_tokens = {schedule.new_tokens} tokens, "
                         f"got shape {new_tokens.shape}")
    cfg = engine.model.config
    for b in (schedule.prefill_budget, schedule.budget):
        if b is not None:
            engine.policy.check(b, cfg)
    prompt = engine.model.check_tokens(prompt)
    rounds: list[Round] = []
    step = 0
    logits = None
    for chunk in blocks(prompt, schedule.block_size):
        with _budget(engine, schedule.prefill_budget):
            logits = engine.forward(chunk)
        r = None
        if schedule.prefill_budget is not None:
            r = Round(step, "prefill", schedule.prefill_budget, engine.position)
            rounds.append(r)
        if on_step is not None:
            on_step(step, r)
        step += 1
    since = 0
    for token in new_tokens:
        since += 1
        budget = None
        if since == schedule.interval:
            budget = schedule.target(engine.position + 1)
            if budget != schedule.budget:
                engine.policy.check(budget, cfg)
            since = 0
        with _budget(engine, budget):
            logits = engine.forward([int(token)])
        r = None if budget is None else Round(step, "decode", budget, engine.position)
        if r is not None:
            rounds.append(r)
        if on_step is not None:
            on_step(step, r)
        step += 1
    return logits, rounds
