"""Small CPU experiments that re-test the seed papers' claims (``refkv experiment NAME``).

Each experiment module builds one :class:`~refkv.experiments.design.Experiment` (its grid,
cell, summary, own options and main table) and :mod:`~refkv.experiments.registry` lists it:

* :mod:`~refkv.experiments.passkey` -- needle in a haystack (KeyDiff Fig. 6);
* :mod:`~refkv.experiments.perplexity` -- perplexity under eviction (CAOTE Table 4, MAT Table 3);
* :mod:`~refkv.experiments.attention_loss` -- attention loss ratio (HashEvict App. D, Table 3)
  and attention-output error per layer (CAOTE Fig. 3);
* :mod:`~refkv.experiments.geometry` -- key geometry (KeyDiff Figs. 2, 4, 5; HashEvict Table 11);
* :mod:`~refkv.experiments.overlap` -- exploratory: how much the kept sets of two policies agree.

The runner (:mod:`~refkv.experiments.runner`) plans the cells still to run and appends one
JSON line per finished cell (:mod:`~refkv.experiments.records`); cells run here or in
parallel processes (:mod:`~refkv.experiments.pool`) behind a progress bar
(:mod:`~refkv.experiments.progress`). Plots (:mod:`~refkv.experiments.plots`) need
matplotlib (the ``plot`` extra).
"""
