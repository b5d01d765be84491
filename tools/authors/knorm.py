"""L2 compress's ``l2_compress`` (alessiodevoto/l2compress) run on refkv's inputs; candidates for
``refkv golden check``.

Loads ``cache.py`` from the checkout, unmodified (the installed transformers provides the
``DynamicCache`` it imports; nothing is stubbed). ``l2_compress(past_key_values,
keep_ratio, prune_after, skip_layers)`` (lines 8-53) sorts each head's tokens by the L2
norm of their keys (``argsort``, line 45) and keeps the first ``ceil(keep_ratio * n)``
(line 42), in norm order; the candidate is those rows found back in refkv's cache. It is
called with ``prune_after=1`` (compress whatever the length) and ``skip_layers=[]``:

* one-shot: once after the prompt, as their README, passkey and needle scripts do
  (``gen_utils.py:233-234``), with ``keep_ratio = r``; refkv runs ``knorm`` at
  ``N = ceil(r T)`` (the same expression, evaluated by the harness; the run checks the
  counts agree);
* token by token: after every token with the ratio ``N / (N + 1)`` that keeps ``N`` of the
  ``N + 1`` tokens (configurations where ``ceil`` of that product is exactly ``N``). Their
  ``eval_lm_quick.py`` compresses after every token too, but with a fixed ratio of the
  current cache (a saw-tooth between ``ceil(r P)`` and ``P``), which no fixed budget of
  refkv reproduces: that regime is not run.

The candidate holds kept columns only.

Usage: ``python -m tools.authors.knorm --repos DIR --out tests/authors/knorm``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from refkv.oracle.io import write_json
from refkv.oracle.synthetic import Tokens, replay
from refkv.policies import get

from .common import (
    columns_of,
    load_module,
    parse_args,
    provenance,
    repos_dir,
    run_config,
    run_items,
    to_torch,
    write_outputs,
)

REPO, COMMIT = "alessiodevoto/l2compress", "f93d6ca2702d85a2db97d2ef350b44d955609761"
FILE = "cache.py"

#: (model, keep_ratio (None: N / (N + 1), token by token), N for token by token, block size, prompt length)
CONFIGURATIONS = [
    ("tiny", 0.5, None, None, 16),
    ("tiny", 0.3, None, None, 16),
    ("tiny-mha", 0.25, None, None, 24),
    ("tiny", None, 6, 1, 14),
    ("tiny-mha", None, 10, 1, 14),
]


class Decider:
    """``l2_compress`` of the layer's cache with ``keep_ratio`` at each eviction (stateless)."""

    def __init__(self, module, ratio: float):
        self.module, self.ratio, self.log = module, ratio, []

    def observe(self, view):
        pass

    def decide(self, view):
        (ok, ov), = self.module.l2_compress([(to_torch(view.keys), to_torch(view.values))], keep_ratio=self.ratio,
                                            prune_after=1, skip_layers=[])
        return columns_of(ok, ov, view.keys, view.values), None


def tie_tokens() -> Tokens:
    """Keys of equal norm on purpose: positions 2, 5, 8 hold ``k``, ``-k`` and ``k`` with half its
    signs flipped (the same squares in the same order: exactly equal norms), the three smallest."""
    rng = np.random.default_rng(11)
    t, d = 12, 16
    queries = np.round(rng.standard_normal((4, t, d)) * 64) / 64
    keys = np.round(rng.standard_normal((2, t, d)) * 64) / 64
    small = keys[:, 2] / 16
    keys[:, 2], keys[:, 5], keys[:, 8] = small, -small, small * np.where(np.arange(d) % 2, -1, 1)
    values = np.round(rng.standard_normal((2, t, d)) * 64) / 64
    return Tokens(queries, keys, values)


def main(argv=None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv)
    module = load_module(repos_dir(args.repos, "l2compress") / FILE, "authors_l2compress_cache")
    out = Path(args.out)
    items, configs, counts = [], [], {}
    ref = get("knorm")
    for model_name, ratio, n_decode, block, length in CONFIGURATIONS:
        if ratio is None:
            ratio, budget = n_decode / (n_decode + 1), n_decode
            if math.ceil(ratio * (n_decode + 1)) != n_decode:
                raise RuntimeError(f"keep_ratio {ratio!r} does not keep {n_decode} of {n_decode + 1}")
        else:
            budget = math.ceil(ratio * length)  # the authors' count, cache.py:42
        label = (f"{model_name}, keep_ratio={ratio!r} (N={budget}), "
                 f"{'one-shot' if block is None else f'blocks of {block}'}, T={length}")
        configs.append({"label": label, "model": model_name, "keep_ratio": ratio, "budget": budget,
                        "block_size": block, "prompt_length": length})
        run = run_config(label, model_name, ref, Decider(module, ratio), budget, block, length)
        if run.error:
            raise RuntimeError(f"{label}: {run.error}")
        counts[label] = len(run.events)
        items += run_items(run, {"paper": ref})
        print(f"{label}: {len(run.events)} evictions")
    n_cases = write_outputs(out, "knorm", items, ("paper",))

    view = replay(ref, tie_tokens(), budget=2)  # one-shot, T=12: keep 2 of the 3 tied smallest norms
    kept, _ = Decider(module, 2 / 12).decide(view)  # ceil(2/12 * 12) = 2
    if kept.shape[1] != 2:
        raise RuntimeError(f"the tie case kept {kept.shape[1]} tokens, not 2")
    print("tie case kept columns:", kept.tolist())
    write_outputs(out / "ties", "knorm", [{
        "comment": "exact ties on purpose: positions 2, 5, 8 have keys of equal norm (k, -k, k with half its signs "
                   "flipped), the three smallest; N=2 keeps two of them (T=12, one-shot, keep_ratio=2/12)",
        "view": view, "kept": kept, "scores": None, "flags": (), "references": {"paper": ref}}], ("paper",))
    write_json(out / "PROVENANCE.json", provenance(
        REPO, COMMIT, [f"{FILE} (function l2_compress)"], [], configs, counts, {},
        {"cases": n_cases, "tie_cases": 1, "tie_case_kept": {"1": kept.tolist()}}))


if __name__ == "__main__":
    main()
