"""Small CPU experiments that re-test the seed papers' claims (``refkv experiment NAME``).

Each experiment module defines one :class:`~refkv.experiments.runner.Experiment` and
registers it:

* :mod:`~refkv.experiments.passkey` -- needle in a haystack (KeyDiff Fig. 6);
* :mod:`~refkv.experiments.perplexity` -- perplexity under eviction (CAOTE Table 4, MAT Table 3);
* :mod:`~refkv.experiments.attention_loss` -- attention loss ratio (HashEvict App. D, Table 3)
  and attention-output error per layer (CAOTE Fig. 3);
* :mod:`~refkv.experiments.geometry` -- key geometry (KeyDiff Figs. 2, 4, 5; HashEvict Table 11).

The runner (:mod:`~refkv.experiments.runner`) appends one JSON line per finished cell,
resumes, runs cells in parallel processes and shows a progress bar; plots
(:mod:`~refkv.experiments.plots`) need matplotlib (the ``plot`` extra).
"""

from .runner import Experiment, Settings, get_experiment, read_records, run

__all__ = ["EXPERIMENT_MODULES", "Experiment", "Settings", "get_experiment", "read_records", "run"]

#: Modules that register an experiment, in the order ``refkv experiment all`` runs them.
EXPERIMENT_MODULES = ("passkey", "perplexity", "attention_loss", "geometry")


def _load_all() -> None:
    """Import every experiment module (each registers itself); cheap after the first call."""
    import importlib

    for name in EXPERIMENT_MODULES:
        importlib.import_module(f"{__name__}.{name}")
