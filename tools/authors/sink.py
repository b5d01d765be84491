"""StreamingLLM's ``StartRecentKVCache`` (mit-han-lab/streaming-llm) run on refkv's inputs; candidates for
``refkv golden check``.

Loads ``streaming_llm/kv_cache.py`` from the checkout, unmodified (it imports torch only).
Two of its methods are run at each of refkv's evictions to ``N``, with
``start_size = s`` and ``recent_size = N - s``:

* ``__call__`` (lines 43-67) on the cache after the block attended (refkv's stage):
  keeps the first ``start_size`` and the last ``recent_size`` tokens;
* ``evict_for_space`` (lines 69-94), what their ``examples/run_streaming_llama.py`` calls
  *before* a block of ``B`` tokens arrives: on the cache without the block,
  ``num_coming = B``; the candidate is what it keeps plus the block (the cache after the
  block is appended). Only for ``B <= recent_size``: a longer block (a one-shot prompt) is
  kept whole by it, so there the authors' cache holds more than ``N`` tokens.

The candidate holds kept columns only (the rule is positional: no scores, no ties).

Usage: ``python -m tools.authors.sink --repos DIR --out tests/authors/sink``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from refkv.oracle.io import write_json
from refkv.policies import get

from .common import (
    columns_of,
    load_module,
    parse_args,
    provenance,
    quiet,
    repos_dir,
    run_config,
    run_items,
    to_torch,
    write_outputs,
)

REPO, COMMIT = "mit-han-lab/streaming-llm", "2e5042606d69933d88fbf909bd77907456b9b4dd"
FILE = "streaming_llm/kv_cache.py"

#: (model, start_size = s, budget N, block size (None: one-shot), prompt length, method)
CONFIGURATIONS = [
    (model, s, n, block, length, method)
    for method in ("__call__", "evict_for_space")
    for model, s, n, block, length in (("tiny", 1, 6, None, 16), ("tiny", 4, 10, 1, 14), ("tiny-mha", 4, 10, None, 16),
                                       ("tiny-mha", 1, 6, 1, 14), ("tiny", 2, 8, 4, 20))
    # evict_for_space makes room in the old cache only: a block longer than recent_size (a
    # one-shot prompt) is kept whole (kv_cache.py:74-75 keeps nothing of the old cache and the
    # block is appended), so it has no one-shot configuration.
    if method == "__call__" or block is not None
]


class Decider:
    """A ``StartRecentKVCache(start_size=s, recent_size=N - s)`` applied at each eviction."""

    def __init__(self, module, start: int, method: str):
        self.module, self.start, self.method, self.log = module, start, method, []

    def observe(self, view):
        pass

    def decide(self, view):
        cache = quiet(self.module.StartRecentKVCache, start_size=self.start, recent_size=view.keep - self.start)
        k, v = to_torch(view.keys), to_torch(view.values)
        if self.method == "__call__":
            (ok, ov), = cache([[k, v]])
            return columns_of(ok, ov, view.keys, view.values), None
        b, n = len(view.query_positions), view.n
        (ok, ov), = cache.evict_for_space([[k[:, :, :n - b], v[:, :, :n - b]]], b)
        old = columns_of(ok, ov, view.keys, view.values)  # (Hkv, N - B) of the tokens before the block
        return np.concatenate([old, np.broadcast_to(np.arange(n - b, n), (old.shape[0], b))], axis=1), None


def main(argv=None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv)
    module = load_module(repos_dir(args.repos, "streaming-llm") / FILE, "authors_streaming_kv_cache")
    out = Path(args.out)
    items, configs, counts = [], [], {}
    for model_name, s, n, block, length, method in CONFIGURATIONS:
        label = (f"{model_name}, {method}, start_size={s}, recent_size={n - s}, "
                 f"{'one-shot' if block is None else f'blocks of {block}'}, T={length}")
        configs.append({"label": label, "model": model_name, "method": method, "start_size": s, "recent_size": n - s,
                        "budget": n, "block_size": block, "prompt_length": length})
        ref = get("sink", sink=s)
        run = run_config(label, model_name, ref, Decider(module, s, method), n, block, length)
        if run.error:
            raise RuntimeError(f"{label}: {run.error}")
        counts[label] = len(run.events)
        items += run_items(run, {"paper": ref})
        print(f"{label}: {len(run.events)} evictions")
    n_cases = write_outputs(out, "sink", items, ("paper",))
    write_json(out / "PROVENANCE.json", provenance(
        REPO, COMMIT, [f"{FILE} (class StartRecentKVCache: __call__, evict_for_space)"], [], configs, counts, {},
        {"cases": n_cases}))


if __name__ == "__main__":
    main()
