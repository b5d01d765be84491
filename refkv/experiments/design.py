"""What an experiment declares: its grid, cell, summary, own settings and main table.

An experiment module builds one :class:`Experiment` and the registry
(:mod:`refkv.experiments.registry`) lists it; nothing else needs editing. The command line
(:mod:`refkv.experiments.cli`) makes one option per :class:`Option` an experiment
declares and prints the experiment's :attr:`Experiment.table` at the end of a run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..validation import check_int
from .settings import MAX_SAMPLES, Settings

__all__ = ["Experiment", "Option"]


@dataclass(frozen=True)
class Option:
    """A setting of one experiment (or a few that share it): a sample size in the grid.

    It becomes the command-line option ``--NAME`` (underscores as dashes) of type int,
    default None (the grid's own value), and its value travels in
    :attr:`Settings.options <refkv.experiments.settings.Settings.options>` under ``name``.

    Attributes
    ----------
    name : str
        The setting's name (``"passkey_prompts"``), also what its errors name.
    help : str
        The command line's help text.
    sizes : tuple
        The grid's value when the user gives none: (quick, default, full) grid, for the
        real model (an experiment may scale them for the tiny one).
    low, high : int
        Allowed range of the value, or of each value with ``many`` (checked before any
        model is read).
    metavar : str
        The value's name in the help (``N`` for counts, ``T`` for tokens).
    many : bool
        One or more values (``nargs="+"``); the value is a tuple.
    """

    name: str
    help: str
    sizes: tuple
    low: int = 1
    high: int = MAX_SAMPLES
    metavar: str = "N"
    many: bool = False

    @property
    def flag(self) -> str:
        """The command-line option: ``--passkey-prompts`` for ``passkey_prompts``."""
        return "--" + self.name.replace("_", "-")

    def check(self, value):
        """``value`` if it is allowed (a tuple of ints with ``many``, else an int).

        Raises
        ------
        ValueError
            Naming the option: ``texts must be an integer in [1, 10000], got 0``.
        """
        if not self.many:
            return check_int(self.name, value, self.low, self.high)
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise ValueError(f"{self.name} must be a sequence of integers, got {value!r}")
        return tuple(check_int(self.name, v, self.low, self.high) for v in value)

    def given(self, settings: Settings):
        """The user's value (checked), or None when the grid chooses."""
        value = settings.options.get(self.name)
        return None if value is None else self.check(value)

    def value(self, settings: Settings):
        """The user's value, else the grid's (:attr:`sizes` of the quick, default or full grid)."""
        given = self.given(settings)
        return self.sizes[settings.grid] if given is None else given


@dataclass(frozen=True)
class Experiment:
    """One experiment: its grid, its cell function, its summary and what it adds to the CLI.

    Attributes
    ----------
    name : str
        Command-line name (``refkv experiment NAME``).
    title : str
        One line for listings.
    cells : callable
        ``cells(settings) -> list of dict``: the grid, one JSON-serialisable parameter
        dict per cell.
    run : callable
        ``run(params) -> dict``: the result of one cell (JSON-serialisable). Must be a
        module-level function (it is sent to worker processes by name).
    summarise : callable
        ``summarise(records, folder, settings) -> list of Path``: tables and plots from
        the finished records of the grid.
    cost : callable
        ``cost(params) -> float``: a rough relative cost, for scheduling and the ETA.
    options : tuple of Option
        The experiment's own settings; each becomes a command-line option. Experiments
        that share a setting share the :class:`Option` object.
    table : tuple of (str, tuple of str) or None
        The main table of the summary, ``(file name, columns)``: the CSV under
        ``OUT/NAME/`` and the columns the end of a run prints.
    exploratory : bool
        True for an experiment that re-tests no paper claim: ``refkv experiment all``
        leaves it out (run it by name).
    phase : int, str or None
        The registered design a grid belongs to: ``2`` (phase two,
        ``docs/experiment_registration_phase2.json``) or ``"forms"`` (``docs/forms_registration.json``).
        Such a grid runs only by name, as its registration orders it, never in ``all``.
    check_result : callable or None
        ``check_result(params, result)`` raises a one-line ValueError when a record's result
        read back from the results file is not one this experiment's ``run`` makes (types,
        ranges, sizes). Such a record does not count as finished: it is skipped with a warning
        naming the file and line, and its cell runs again (:func:`refkv.experiments.records.read_records`).
    """

    name: str
    title: str
    cells: Callable[[Settings], list[dict]]
    run: Callable[[dict], dict]
    summarise: Callable[[list[dict], Path, Settings], list[Path]]
    cost: Callable[[dict], float] = field(default=lambda params: 1.0)
    options: tuple[Option, ...] = ()
    table: tuple[str, tuple[str, ...]] | None = None
    exploratory: bool = False
    phase: int | str | None = None
    check_result: Callable[[dict, dict], None] | None = None
