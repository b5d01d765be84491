"""TOVA's ``TOVACache.reduce`` (schwartz-lab-NLP/TOVA) run on refkv's inputs; candidates for ``refkv golden check``.

Loads ``src/tova_cache.py`` from the checkout, unmodified (it subclasses transformers'
``DynamicCache``; the installed transformers is used, nothing is stubbed). Its ``reduce``
(lines 31-51) is called as the authors' attention forward calls it
(``src/convert_models/llama_custom.py:113``): with the forward's softmax weights
``(1, H, B, n)`` over the cache ``key_cache[layer]`` of shape ``(1, Hkv, n, d)``; past
``cache_size`` tokens it keeps the ``cache_size`` largest of the last query's weights
averaged over **all** query heads (line 44, ``torch.topk`` line 45), one set for every KV
head. The layer's cache is handed to it by setting ``key_cache``/``value_cache`` (the
lists ``reduce`` reads); its scores are a local of ``reduce``, so the candidate holds kept
columns only. Their forward's softmax is float32 (llama_custom.py:86); here the routine
gets refkv's float64 weights.

Usage: ``python -m tools.authors.tova --repos DIR --out tests/authors/tova``.
"""

from __future__ import annotations

from pathlib import Path

from refkv.oracle.io import write_json
from refkv.oracle.synthetic import replay
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
from .h2o import tie_tokens

REPO, COMMIT = "schwartz-lab-NLP/TOVA", "9c7d09bfff64cfc92cfb5f9d7e138cb04866e5a7"
FILE = "src/tova_cache.py"

#: (model, cache_size = N, block size (None: one-shot), prompt length)
CONFIGURATIONS = [
    ("tiny", 6, None, 16),
    ("tiny", 10, None, 16),
    ("tiny", 6, 1, 14),
    ("tiny", 10, 1, 14),
    ("tiny-mha", 6, None, 16),
    ("tiny-mha", 10, 1, 14),
    ("tiny-mha", 8, 4, 20),
]


class Decider:
    """A fresh ``TOVACache(cache_size=N)`` per eviction holding the layer's cache (reduce is stateless)."""

    def __init__(self, module):
        self.module, self.log = module, []

    def observe(self, view):
        pass

    def decide(self, view):
        hkv, g, b, n = view.attention.shape
        cache = self.module.TOVACache(view.keep)
        cache.key_cache = [None] * view.layer + [to_torch(view.keys)]
        cache.value_cache = [None] * view.layer + [to_torch(view.values)]
        cache.reduce(view.layer, to_torch(view.attention.reshape(hkv * g, b, n)))  # (1, H, B, n)
        return columns_of(cache.key_cache[view.layer], cache.value_cache[view.layer], view.keys, view.values), None


def main(argv=None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv)
    module = load_module(repos_dir(args.repos, "TOVA") / FILE, "authors_tova_cache")
    out = Path(args.out)
    runs, configs, errors = [], [], {}
    for model_name, size, block, length in CONFIGURATIONS:
        label = f"{model_name}, cache_size={size}, {'one-shot' if block is None else f'blocks of {block}'}, T={length}"
        configs.append({"label": label, "model": model_name, "cache_size": size, "budget": size, "block_size": block,
                        "prompt_length": length})
        run = run_config(label, model_name, get("tova", form="authors"), Decider(module), size, block, length)
        if run.error:
            errors[label] = run.error
            continue
        runs.append(run)
        print(f"{label}: {len(run.events)} evictions")
    refs = {"paper": get("tova"), "authors": get("tova", form="authors")}
    items = [item for run in runs for item in run_items(run, refs)]
    n = write_outputs(out, "tova", items, tuple(refs))

    ties = []
    for n_heads, n_kv in ((4, 2), (4, 4)):
        view = replay(refs["authors"], tie_tokens(n_heads, n_kv, dead=(3, 5, 7)), budget=10)  # one-shot, T=12
        kept, _ = Decider(module).decide(view)
        ties.append({"comment": f"exact ties on purpose (H={n_heads}, Hkv={n_kv}): positions 3, 5, 7 get weight 0.0 "
                                f"from every query; 9 live tokens, N=10, one of the three kept (T=12, one-shot)",
                     "view": view, "kept": kept, "scores": None, "flags": (), "references": refs})
        print("tie case kept columns:", kept.tolist())
    write_outputs(out / "ties", "tova", ties, tuple(refs))
    write_json(out / "PROVENANCE.json", provenance(
        REPO, COMMIT, [f"{FILE} (class TOVACache, method reduce)"], [], configs,
        {run.label: len(run.events) for run in runs}, errors,
        {"cases": n, "tie_cases": len(ties),
         "tie_case_kept": {str(i): t["kept"].tolist() for i, t in enumerate(ties, start=1)},
         "inputs": "refkv's float64 softmax weights (their forward's float32 softmax is not part of the routine)"}))


if __name__ == "__main__":
    main()
