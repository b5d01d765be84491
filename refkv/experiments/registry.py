"""The list of experiments: what ``refkv experiment NAME`` can run.

Adding an experiment is one module that builds an
:class:`~refkv.experiments.design.Experiment` (``EXPERIMENT``) and its entry here: the
import and its place in :data:`EXPERIMENTS`. The command line takes its names, options
and summary tables from this list. :func:`register_experiment` adds an experiment from
outside the list (a test's toy grid) for this process.
"""

from __future__ import annotations

from . import attention_loss, forms, geometry, overlap, passkey, perplexity, phase2_passkey, phase2_texts
from .design import Experiment, Option
from .settings import Settings

__all__ = ["EXPERIMENTS", "check_options", "experiment_options", "get_experiment", "register_experiment",
           "suite"]

#: Every experiment, in the order ``refkv experiment all`` runs them (exploratory ones and phase grids left out).
EXPERIMENTS: tuple[Experiment, ...] = (passkey.EXPERIMENT, perplexity.EXPERIMENT, attention_loss.EXPERIMENT,
                                       geometry.EXPERIMENT, overlap.EXPERIMENT, phase2_passkey.EXPERIMENT,
                                       *phase2_texts.EXPERIMENTS, forms.EXPERIMENT)

_BY_NAME: dict[str, Experiment] = {}


def register_experiment(experiment: Experiment) -> Experiment:
    """Make ``experiment`` runnable by name in this process (it replaces one of the same name)."""
    if not experiment.name or experiment.name == "all":
        raise ValueError(f"experiment name must be non-empty and not 'all', got {experiment.name!r}")
    _BY_NAME[experiment.name] = experiment
    return experiment


for _experiment in EXPERIMENTS:
    register_experiment(_experiment)


def get_experiment(name: str) -> Experiment:
    """The experiment ``name``."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown experiment {name!r}; available: {', '.join(sorted(_BY_NAME))}, all") from None


def suite() -> list[Experiment]:
    """What ``refkv experiment all`` runs: the listed experiments that are neither exploratory nor a
    registered phase's grid."""
    return [experiment for experiment in EXPERIMENTS if not experiment.exploratory and experiment.phase is None]


def experiment_options() -> list[Option]:
    """Every option the listed experiments declare, once each, in the order of the list.

    Raises
    ------
    ValueError
        If two experiments declare different options of the same name (share the object instead).
    """
    options: dict[str, Option] = {}
    for experiment in EXPERIMENTS:
        for option in experiment.options:
            if options.setdefault(option.name, option) != option:
                raise ValueError(f"experiment {experiment.name!r} declares option {option.name!r} unlike another "
                                 f"experiment does: share one Option")
    return list(options.values())


def check_options(settings: Settings) -> None:
    """Check every value of ``settings.options`` with the option that declares it.

    Raises
    ------
    ValueError
        Naming the option: a value out of range, or a name no experiment declares.
    """
    declared = {option.name: option for option in experiment_options()}
    declared.update((o.name, o) for e in _BY_NAME.values() for o in e.options)
    for name, value in settings.options.items():
        if name not in declared:
            raise ValueError(f"no experiment has the option {name!r}; the options are: {', '.join(sorted(declared))}")
        if value is not None:
            declared[name].check(value)
