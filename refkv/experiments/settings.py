"""What the user chose for a run (:class:`Settings`), checked before any model is read.

The settings every experiment shares (model, dtype, grid size, policies, budgets, blocks,
seed, the registered design) are fields; the settings of one experiment (the passkey
prompts, the perplexity texts, ...) are declared by that experiment as
:class:`~refkv.experiments.design.Option` objects and travel in :attr:`Settings.options`,
by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..policies.spec import canonical_spec, make_policy
from ..validation import MAX_CONTEXT, check_choice, check_int
from .models import smollm2_installed

__all__ = ["MAX_SAMPLES", "MAX_TOKENS", "Settings", "check_policy_specs"]

#: Most texts or prompts per cell a grid may ask for (the full grid uses 50; the grid is
#: listed whole before anything runs, so this bounds its memory and the planning time).
MAX_SAMPLES = 10_000
#: Longest prompt, text, budget or block in tokens an experiment may ask for (checked when
#: the settings are made, before any model is read): :data:`refkv.validation.MAX_CONTEXT`.
MAX_TOKENS = MAX_CONTEXT


@dataclass(frozen=True)
class Settings:
    """What the user chose on the command line; experiments build their grids from it.

    Attributes
    ----------
    quick : bool
        The tiny grid (used by the tests; < 2 minutes).
    model : str or None
        ``"tiny"``, ``"smollm2"`` or a path; ``None`` picks ``smollm2`` when installed,
        else ``tiny``.
    dtype : str
        ``"float32"`` or ``"float64"``.
    policies : tuple of str or None
        Policy specs (``name`` or ``name:param=value,...``) replacing the default list.
    budgets : tuple of (int or None) or None
        Budgets ``N`` replacing the default list (``None`` = no eviction).
    blocks : tuple of (int or None) or None
        Block sizes ``B`` replacing the default list (``None`` = one-shot prefill).
    seed : int
        Base seed of everything random in the grid (needles, prompts, projections).
    full : bool
        The powered grid of issue 16: at least 8 perplexity texts of 1,024 tokens, 50
        passkey prompts per cell at 1K, 2K and 4K tokens, 10 prompts for output error,
        attention loss and the Fig. 2 statistics. Hours of CPU: run it with ``--jobs`` or
        ``--scheduler``.
    registered : bool
        The registered design (``docs/guide/registration.rst``), for the experiments that
        have one: passkey's calibration (without ``passkey_lengths``) or its test grid at
        the one calibrated length.
    options : mapping of str to value
        The experiments' own settings, by the name of the
        :class:`~refkv.experiments.design.Option` that declares them (``{"texts": 3}``);
        a name left out takes the grid's default. Each declaring option checks its value
        (:func:`refkv.experiments.registry.check_options`, run before a grid is planned).
    """

    quick: bool = False
    model: str | None = None
    dtype: str = "float32"
    policies: tuple[str, ...] | None = None
    budgets: tuple[int | None, ...] | None = None
    blocks: tuple[int | None, ...] | None = None
    seed: int = 0
    full: bool = False
    registered: bool = False
    # Left out of the hash: a dict is not hashable, and equal settings hash alike without it.
    options: Mapping = field(default_factory=dict, hash=False)

    def __post_init__(self):
        check_choice("dtype", self.dtype, ("float32", "float64"))
        if self.quick and self.full:
            raise ValueError("quick and full are exclusive: choose the tiny grid or the powered one")
        if self.registered and (self.quick or self.full):
            raise ValueError("registered is a grid of its own: give it without quick or full")
        for name in ("budgets", "blocks"):
            for value in getattr(self, name) or ():
                if value is not None:
                    check_int(name, value, 1, MAX_TOKENS)  # or None
        check_int("seed", self.seed, 0)
        if self.policies is not None:
            check_policy_specs(self.policies)
        if not isinstance(self.options, Mapping) or not all(isinstance(k, str) for k in self.options):
            raise ValueError(f"options must map option names (str) to values, got {self.options!r}")
        # A copy, lists as tuples: the settings stay unchanged whatever the caller does with its dict.
        object.__setattr__(self, "options", {k: tuple(v) if isinstance(v, list) else v
                                             for k, v in self.options.items()})

    @property
    def grid(self) -> int:
        """Which grid: 0 the quick one, 1 the default, 2 the full one (an index into
        :attr:`refkv.experiments.design.Option.sizes`)."""
        return 0 if self.quick else 2 if self.full else 1

    def resolved_model(self) -> str:
        """The model name the grid uses: the user's, or smollm2 when installed, else tiny."""
        if self.model is not None:
            return self.model
        return "smollm2" if smollm2_installed() else "tiny"


def check_policy_specs(specs, option: str = "policies") -> None:
    """Construct every policy spec once, so a bad one fails before any cell runs.

    Raises
    ------
    ValueError
        Naming ``option`` and the spec: an unknown policy or parameter, a value out of
        range, or the same policy listed twice (after canonicalisation).
    """
    if isinstance(specs, str) or not all(isinstance(spec, str) for spec in specs):
        raise ValueError(f"{option} must be a sequence of policy specs (str), got {specs!r}")
    seen: dict[str, str] = {}
    for spec in specs:
        try:
            canonical = canonical_spec(spec)
            make_policy(spec)
        except ValueError as err:
            raise ValueError(f"{option}: {spec!r}: {err}") from None
        if canonical in seen:
            raise ValueError(f"{option} lists {canonical!r} twice (as {seen[canonical]!r} and {spec!r})")
        seen[canonical] = spec
