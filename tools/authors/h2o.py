"""H2O's real-drop cache (FMInference/H2O) run on refkv's inputs; candidates for ``refkv golden check``.

Loads ``h2o_hf/utils_real_drop/modify_llama.py`` from the checkout, unmodified, and uses its
class ``H2OKVCache_LayerWise`` (lines 242-329): one object per layer, called as the
authors' ``H2OLlamaAttention.forward`` calls it (line 509) after every forward with the
forward's softmax weights ``(1, H, B, n)``; it accumulates them (``_update_hh_score``) and,
past ``hh_size + recent_size`` tokens, keeps the last ``recent_size`` and the ``hh_size``
largest scores of the rest (``torch.topk``, line 272). The candidate holds its kept columns
and its accumulated scores (read from a deep copy of the cache object updated by its own
``_update_hh_score``, so the real object is updated once). Their attention forward
computes the softmax in float32 (line 505); here the routine gets refkv's float64 weights,
the inputs refkv's own policy decided on.

Usage: ``python -m tools.authors.h2o --repos DIR --out tests/authors/h2o``.
"""

from __future__ import annotations

import copy
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
    quiet,
    repos_dir,
    run_config,
    run_items,
    to_torch,
    write_outputs,
)

REPO, COMMIT = "FMInference/H2O", "ac75c2a8a9e76832b2a4139b9363373b56336bfb"
FILE = "h2o_hf/utils_real_drop/modify_llama.py"

#: (model, hh_size, recent_size, block size (None: one-shot), prompt length)
CONFIGURATIONS = [
    ("tiny-mha", 4, 2, None, 16),
    ("tiny-mha", 4, 6, None, 16),
    ("tiny-mha", 4, 2, 1, 14),
    ("tiny-mha", 3, 5, 1, 14),
    ("tiny-mha", 8, 4, 4, 20),
    ("tiny", 4, 2, None, 16),   # GQA: the authors' cache raises (its mask indexes query heads)
    ("tiny", 4, 2, 1, 14),
]


class Decider:
    """One ``H2OKVCache_LayerWise`` per layer, fed every forward's weights."""

    def __init__(self, module, hh_size: int, recent_size: int, n_layers: int):
        self.caches = [quiet(module.H2OKVCache_LayerWise, hh_size=hh_size, recent_size=recent_size)
                       for _ in range(n_layers)]
        self.pending, self.log = {}, []

    def observe(self, view):
        hkv, g, b, n = view.attention.shape
        attn = to_torch(view.attention.reshape(hkv * g, b, n))  # (1, H, B, n): query head h of KV head h // g
        cache = self.caches[view.layer]
        probe = copy.deepcopy(cache)
        probe._update_hh_score(attn.clone())  # the scores the call below selects on, before it prunes them
        pkv = (to_torch(view.keys), to_torch(view.values))
        out = cache(pkv, attn.clone())
        if view.layer in self.pending:
            raise RuntimeError(f"layer {view.layer}: the authors' cache evicted but refkv's engine did not")
        if out is not pkv:
            self.pending[view.layer] = (columns_of(out[0], out[1], view.keys, view.values),
                                        probe.hh_score.numpy().astype(np.float64))

    def decide(self, view):
        if view.layer not in self.pending:
            raise RuntimeError(f"layer {view.layer}: refkv's engine evicts but the authors' cache did not")
        return self.pending.pop(view.layer)


def tie_tokens(n_heads: int, n_kv_heads: int, dead: tuple, t: int = 12, d: int = 16) -> Tokens:
    """Tokens whose ``dead`` positions get exactly zero weight from every query (exact ties at 0).

    Every query is the same vector ``u``; a dead key is ``-2000 u`` (a logit 2000 below the
    live ones: ``exp`` underflows to 0.0 in float64); token 0 is live, so every query sees a
    live token.
    """
    rng = np.random.default_rng(7)
    u = np.full(d, 0.5)
    queries = np.broadcast_to(u, (n_heads, t, d)).copy()
    keys = np.round(rng.standard_normal((n_kv_heads, t, d)) * 64) / 64
    keys[:, list(dead)] = -2000 * u
    values = np.round(rng.standard_normal((n_kv_heads, t, d)) * 64) / 64
    return Tokens(queries, keys, values)


def main(argv=None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv)
    checkout = repos_dir(args.repos, "H2O")
    module = load_module(checkout / FILE, "authors_h2o_real_drop")
    out = Path(args.out)

    runs, errors, configs = [], {}, []
    for model_name, hh, recent, block, length in CONFIGURATIONS:
        label = (f"{model_name}, hh_size={hh}, recent_size={recent}, "
                 f"{'one-shot' if block is None else f'blocks of {block}'}, T={length}")
        configs.append({"label": label, "model": model_name, "hh_size": hh, "recent_size": recent,
                        "budget": hh + recent, "block_size": block, "prompt_length": length})
        reference = get("h2o", recent=recent, form="authors")
        n_layers = 4
        run = run_config(label, model_name, reference, Decider(module, hh, recent, n_layers), hh + recent, block,
                         length)
        if run.error:
            errors[label] = run.error
            print(f"{label}: the authors' code raised {run.error}")
            continue
        runs.append((run, recent))
        print(f"{label}: {len(run.events)} evictions")
    items = [item for run, recent in runs for item in run_items(
        run, {"paper": get("h2o", recent=recent), "authors": get("h2o", recent=recent, form="authors")})]
    n = write_outputs(out, "h2o", items, ("paper", "authors"))

    # Ties on purpose: three tokens with exactly zero accumulated weight, the boundary among them.
    ties = []
    for n_heads, n_kv in ((4, 4),):
        tokens = tie_tokens(n_heads, n_kv, dead=(3, 5, 7))
        ref = get("h2o", recent=2, form="authors")
        view = replay(ref, tokens, budget=10)  # one-shot: T = 12, N = 10 = 8 heavy hitters + 2 recent
        decider = Decider(module, 8, 2, 1)
        decider.observe(view)
        kept, scores = decider.decide(view)
        ties.append({"comment": "exact ties on purpose: positions 3, 5, 7 get weight 0.0 from every query; "
                                "hh_size=8 of 10 candidates, one of the three kept (T=12, N=10, one-shot)",
                     "view": view, "kept": kept, "scores": scores, "flags": (),
                     "references": {"paper": get("h2o", recent=2), "authors": ref}})
    write_outputs(out / "ties", "h2o", ties, ("paper", "authors"))
    print("tie case kept columns:", ties[0]["kept"].tolist())

    write_json(out / "PROVENANCE.json", provenance(
        REPO, COMMIT, [f"{FILE} (class H2OKVCache_LayerWise)"], [], configs,
        {run.label: len(run.events) for run, _ in runs}, errors,
        {"cases": n, "tie_cases": len(ties),
         "tie_case_kept": {str(i): t["kept"].tolist() for i, t in enumerate(ties, start=1)},
         "inputs": "refkv's float64 softmax weights (their forward's float32 softmax is not part of the routine)"}))


if __name__ == "__main__":
    main()
