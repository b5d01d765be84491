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

from .runner import EXPERIMENT_MODULES, Experiment, Settings, get_experiment, read_records, run

__all__ = ["EXPERIMENT_MODULES", "Experiment", "Settings", "get_experiment", "read_records", "run"]
