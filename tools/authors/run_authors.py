"""Run the authors' own selection code on refkv's inputs; write candidate goldens.

Given local checkouts of the authors' repositories, this loads their selection routines
*unmodified* (``importlib`` from the checkout's files; nothing is copied or patched) and
feeds them the keys, values and queries of refkv's models. What their code keeps is
written as a **candidate file in refkv's golden format**, so that::

    python -m refkv golden check CANDIDATE.json REFERENCE.json

judges the authors' code against refkv's ``form="authors"`` (the reference is made by
:func:`refkv.oracle.recorder.run_schedule_golden` or read from a vectors file; the test
``tests/authors/test_authors_candidates.py`` regenerates it and checks the committed
candidates, so CI needs neither the network nor the checkouts).

Usage::

    python tools/authors/run_authors.py --repos DIR [--out tests/authors] [--policy hashevict]

``DIR`` holds one folder per repository, named ``owner+name`` (``minghui-liu+cold-compress``,
``FasterDecoding+SnapKV``) or just ``name``; ``REFKV_AUTHORS_REPOS`` may name it instead.
The commit of each checkout is read from ``DIR/<folder>/COMMIT`` (a file holding the hash)
when the folder is not a git work tree.

This tool is never imported by ``refkv``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from refkv import policies  # noqa: E402
from refkv.engine import Engine  # noqa: E402
from refkv.files import atomic_write  # noqa: E402
from refkv.model import TINY, Model, random_weights  # noqa: E402
from refkv.oracle.endtoend import write_end_to_end  # noqa: E402
from refkv.oracle.models import build_model  # noqa: E402
from refkv.oracle.recorder import run_schedule_golden  # noqa: E402
from refkv.schedule import Schedule  # noqa: E402

#: The repository each policy's authors' code lives in (GitHub owner/name).
REPOSITORIES = {"hashevict": "minghui-liu/cold-compress", "snapkv": "FasterDecoding/SnapKV",
                "pyramidkv": "Zefan-Cai/KVCache-Factory", "adakv": "FFY0/AdaKV"}


# -- loading their code ---------------------------------------------------------------------------
def checkout(repos: Path, repo: str) -> Path:
    """The folder of ``repo`` (owner/name) under ``repos``."""
    for name in (repo.replace("/", "+"), repo.split("/")[1]):
        if (repos / name).is_dir():
            return repos / name
    raise SystemExit(f"error: no checkout of {repo} under {repos} (expected {repo.replace('/', '+')}/)")


def commit_of(folder: Path) -> str:
    """The commit a checkout is at (``git rev-parse HEAD``, or the ``COMMIT`` file of an export)."""
    marker = folder / "COMMIT"
    if marker.is_file():
        return marker.read_text().strip()
    out = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"error: cannot tell the commit of {folder}: put it in {marker}")
    return out.stdout.strip()


def load_module(folder: Path, relative: str, name: str):
    """Import ``folder/relative`` as module ``name``, unmodified; the checkout goes first on
    ``sys.path`` so that its own imports (``from prompt_compression import ...``) resolve."""
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# -- HashEvict: KVCacheLSH of minghui-liu/cold-compress -------------------------------------------
#: (label, model name, MHA, budget N, prompt length T, generated tokens D): prompts longer and
#: shorter than N (the authors' prompt cut, and none), GQA and not, several budgets.
HASHEVICT_CONFIGS = (
    ("tiny-N16-T24-D20", "tiny", False, 16, 24, 20),
    ("tiny-N24-T40-D16", "tiny", False, 24, 40, 16),
    ("tiny-N32-T20-D24", "tiny", False, 32, 20, 24),
    ("mha-N16-T24-D20", "tiny", True, 16, 24, 20),
    ("qwen2-N20-T30-D16", "qwen2", False, 20, 30, 16),
    ("llama3-N16-T16-D20", "llama3", False, 16, 16, 20),
)
HASHEVICT_PARAMS = {"form": "authors", "hash": "key"}


def model_for(name: str, mha: bool, dtype: str = "float64") -> tuple[Model, str]:
    """A golden model, or the tiny one with as many KV heads as query heads (no GQA)."""
    if not mha:
        return build_model(name, 0, dtype), name
    config = replace(TINY, n_kv_heads=TINY.n_heads, name="tiny-mha")
    return Model(config, random_weights(config, seed=0, dtype=dtype)), "tiny-mha"


def hashevict_authors_kept(module, compressor_module, policy, model: Model, prompt, decode, budget: int):
    """Teacher-forced: feed ``KVCacheLSH`` the keys refkv's model gives each token, one layer at a time.

    refkv's engine (``form="authors"``) is run alongside to produce every token's key and value
    in every layer; the authors' cache receives the same vectors and decides on its own. The
    engine's decisions only matter for the keys of later tokens (which the next layers' inputs
    depend on): while both agree, their inputs are the same as the authors' code would see in
    a model of its own; after a difference the check stops comparing.
    """
    import torch

    cfg = model.config
    hkv, d = cfg.n_kv_heads, cfg.d_head
    engine = Engine(model, policy, None)
    engine.forward(prompt)
    caches = []
    t = len(prompt)
    for layer, cache in enumerate(engine.caches):
        lsh = module.KVCacheLSH(1, hkv, d, dtype=torch.float64, max_cache_length=budget,
                                max_seq_length=t + len(decode), cache_bits=None, global_tokens=policy.sink,
                                recent_window=policy.recent, lsh_dim=policy.n_bits)
        planes = policy.planes(d, np.float64, layer)  # (c, d); theirs is (d, c): x @ R
        lsh.random_proj_matrix = torch.from_numpy(np.ascontiguousarray(planes.T))
        input_pos = torch.arange(t)
        k = torch.from_numpy(cache.keys.copy())[None]  # (1, Hkv, T, d)
        v = torch.from_numpy(cache.values.copy())[None]
        if budget < t:  # model.py:357-362: the default prompt compressor, recent_global
            compressor = compressor_module.PromptCompressorRecentGlobal(
                head_specific=True, max_cache_length=budget, global_tokens=policy.sink,
                recent_window=policy.recent)
            input_pos, k, v, _ = compressor(input_pos, k, v, attn=None)
        lsh.update_kv(input_pos, k, v, True)
        lsh.update_state(input_pos, k, v, True, None)
        caches.append(lsh)
    kept = []
    for token in decode:
        engine.budget = budget
        engine.forward([int(token)])
        engine.budget = None
        per_layer = []
        for layer, cache in enumerate(engine.caches):
            pos = cache.positions
            column = np.argmax(pos == t, axis=1)  # the new token's column in each head
            k = np.stack([cache.keys[h, column[h]] for h in range(hkv)])[None, :, None]
            v = np.stack([cache.values[h, column[h]] for h in range(hkv)])[None, :, None]
            caches[layer].update_kv(torch.tensor([t]), torch.from_numpy(k), torch.from_numpy(v), False)
            held = caches[layer].pos[0].numpy().astype(np.int64)  # (Hkv, N), -1: an empty slot
            order = np.lexsort((held, held < 0), axis=1)  # increasing positions, empty slots last
            per_layer.append(np.take_along_axis(held, order, axis=1))
        kept.append(per_layer)
        t += 1
    return np.array(kept)  # (R, L, Hkv, N)


def run_hashevict(repos: Path, out: Path) -> list[dict]:
    folder = checkout(repos, REPOSITORIES["hashevict"])
    commit = commit_of(folder)
    compressor_module = load_module(folder, "prompt_compression.py", "prompt_compression")
    module = load_module(folder, "cache.py", "authors_cold_compress_cache")
    policy = policies.get("hashevict", **HASHEVICT_PARAMS)
    rows = []
    target = out / "hashevict"
    target.mkdir(parents=True, exist_ok=True)
    for label, name, mha, budget, length, new in HASHEVICT_CONFIGS:
        model, model_name = model_for(name, mha)
        schedule = Schedule(None, None, 1, budget, new_tokens=new)
        manifest, arrays = run_schedule_golden(policy, schedule, prompt_length=length, model=model_name,
                                               built=model)
        kept = hashevict_authors_kept(module, compressor_module, policy, model, arrays["prompt"], arrays["decode"],
                                      budget)
        counts = (kept[:, :, 0] >= 0).sum(axis=-1).astype(np.int64)  # (R, L): tokens held by head 0
        width = arrays["kept"].shape[-1]
        kept = kept[..., :width] if kept.shape[-1] >= width else np.pad(
            kept, [(0, 0)] * 3 + [(0, width - kept.shape[-1])], constant_values=-1)
        candidate = {**manifest, "declare": {"kept_only": True},
                     "source": {"repository": REPOSITORIES["hashevict"], "commit": commit,
                                "code": "cache.py KVCacheLSH, prompt_compression.py PromptCompressorRecentGlobal",
                                "logits": "not computed by the authors' cache (zeros, not compared: kept_only)"}}
        write_end_to_end(target / f"{label}.json", candidate,
                         {"kept": kept, "kept_count": counts, "logits": np.zeros_like(arrays["logits"])})
        write_reference(out, "hashevict", label, manifest, arrays)
        same = bool(np.array_equal(kept, arrays["kept"]))
        rows.append({"policy": "hashevict", "configuration": label, "model": model_name, "budget": budget,
                     "prompt": length, "new_tokens": new, "gqa": model.config.n_kv_heads < model.config.n_heads,
                     "identical": same, "commit": commit, "file": f"tests/authors/hashevict/{label}.json"})
        print(f"hashevict {label}: {'identical' if same else 'DIFFERENT'}")
    write_provenance(target, "hashevict", commit, rows)
    return rows


# -- GQA: the two regimes of the authors' codes ------------------------------------------------------
#: A configuration's regime: ``"mha"`` (``tiny-mha``, one query head per KV head); ``"query"`` (the
#: GQA ``tiny``, the authors' code given the KV heads repeated to the query heads as their models
#: do: refkv's authors' form runs on ``tiny-kv-repeated``, refkv.model.heads.repeat_kv_heads);
#: ``"kvhead-<agg>"`` (the GQA ``tiny``, the authors' KV-head path reducing the group by ``agg``:
#: KVCache-Factory's ``gqa_score_agg``, Ada-KV's ``gqa_func``; refkv's authors' form with
#: ``gqa_agg=agg`` on ``tiny``).
REGIMES = ("mha", "query", "kvhead-mean", "kvhead-max", "kvhead-sum")


def regime_model(regime: str, dtype: str = "float32") -> tuple[Model, Model, str]:
    """(the model whose views feed the authors' code, the model refkv's reference runs, its builder name)."""
    if regime == "mha":
        model, name = model_for("tiny", True, dtype)
        return model, model, name
    tiny = build_model("tiny", 0, dtype)
    if regime == "query":
        return tiny, build_model("tiny-kv-repeated", 0, dtype), "tiny-kv-repeated"
    return tiny, tiny, "tiny"


def gqa_agg(regime: str) -> str | None:
    """The group reduction of a ``kvhead-<agg>`` regime (``None`` otherwise)."""
    return regime.split("-", 1)[1] if regime.startswith("kvhead-") else None


def layer_views(model: Model, prompt, window: int, kernel: int, pooling: str) -> list:
    """Every layer's view of a one-shot prefill of ``prompt`` (layer order): refkv's queries (H, T, d),
    keys and values (Hkv, T, d), positions. A budget of ``T - 1`` makes every layer evict once, so
    the trace holds each layer's view; in a one-shot prefill no layer's input depends on an eviction."""
    engine = Engine(model, policies.get("snapkv", window=window, kernel=kernel, pooling=pooling), len(prompt) - 1,
                    record="views")
    engine.forward(prompt)
    return [event.view for event in sorted(engine.trace.evictions, key=lambda e: e.layer)]


def position_values(view, heads: int):
    """Values ``(1, heads, T, d)`` whose first entry is each token's position: the clusters only
    gather values, so what they return names the tokens they kept."""
    import torch

    dtype = torch.from_numpy(view.keys[:0].copy()).dtype
    values = torch.zeros((1, heads, view.keys.shape[1], view.keys.shape[2]), dtype=dtype)
    values[..., 0] = torch.from_numpy(view.positions[0].astype(np.float64))
    return values


def inputs(module, view, regime: str):
    """(keys, queries, values, groups) as the authors' attention forward hands them to ``update_kv``:
    the keys repeated to the query heads first (``repeat_kv``, the module's own) except on a
    KV-head path, where the unrepeated keys go in."""
    import torch

    groups = view.group_size
    keys = torch.from_numpy(view.keys.copy())[None]  # (1, Hkv, T, d)
    if regime == "query":
        keys = module.repeat_kv(keys, groups)  # (1, H, T, d)
    return keys, torch.from_numpy(view.queries.copy())[None], position_values(view, keys.shape[1]), groups


def split_note(kept: np.ndarray, group: int) -> str:
    """How often the query heads of one KV head keep different sets (kept: (L, H, N), one row per query head)."""
    grouped = kept.reshape(kept.shape[0], -1, group, kept.shape[-1])  # (L, Hkv, g, N)
    pairs = grouped.shape[0] * grouped.shape[1]
    split = sum(len({tuple(x) for x in grouped[layer, h]}) > 1
                for layer in range(grouped.shape[0]) for h in range(grouped.shape[1]))
    return (f"per query head: in {split} of {pairs} (layer, KV head) pairs of the GQA model the group's query heads "
            f"keep different sets, which one set per KV head (refkv's paper form, gqa_agg) cannot hold")


# -- SnapKV: SnapKVCluster of FasterDecoding/SnapKV (and KVCache-Factory's KV-head path) -------------
#: (label, regime, budget N, window w, kernel k, pooling, prompt T): one-shot prefill compressed once.
SNAPKV_CONFIGS = (
    ("mha-N16-w4-k3-avg-T40", "mha", 16, 4, 3, "avg", 40),
    ("mha-N24-w8-k5-avg-T48", "mha", 24, 8, 5, "avg", 48),
    ("mha-N12-w4-k7-avg-T40", "mha", 12, 4, 7, "avg", 40),
    ("mha-N16-w4-k3-max-T40", "mha", 16, 4, 3, "max", 40),
    ("mha-N40-w32-k7-max-T64", "mha", 40, 32, 7, "max", 64),
    ("mha-N16-w8-k1-avg-T24", "mha", 16, 8, 1, "avg", 24),
    ("gqa-N16-w4-k3-avg-T40", "query", 16, 4, 3, "avg", 40),
    ("gqa-N24-w8-k5-avg-T48", "query", 24, 8, 5, "avg", 48),
    ("gqa-N12-w4-k7-avg-T40", "query", 12, 4, 7, "avg", 40),
    ("gqa-N16-w4-k7-max-T40", "query", 16, 4, 7, "max", 40),
    ("gqa-N40-w32-k7-max-T64", "query", 40, 32, 7, "max", 64),
    ("kvhead-aggmean-N16-w4-k3-avg-T40", "kvhead-mean", 16, 4, 3, "avg", 40),
    ("kvhead-aggmax-N24-w8-k5-avg-T48", "kvhead-max", 24, 8, 5, "avg", 48),
    ("kvhead-aggsum-N12-w4-k7-avg-T40", "kvhead-sum", 12, 4, 7, "avg", 40),
    ("kvhead-aggmean-N16-w4-k3-max-T40", "kvhead-mean", 16, 4, 3, "max", 40),
)


def snapkv_authors_kept(snapkv, factory, model: Model, prompt, budget, window, kernel, pooling, regime):
    """What the SnapKV cluster keeps in every layer after a one-shot prefill: (L, heads, N).

    ``"mha"``, ``"query"``: FasterDecoding/SnapKV's ``SnapKVCluster.update_kv`` given the keys repeated
    with the code's own ``repeat_kv`` (``mistral_hijack_4_37.py:97-98``), one set per query head.
    ``"kvhead-<agg>"``: KVCache-Factory's ``SnapKVCluster`` given the unrepeated keys (its opt-in
    ``kv_head`` layout, ``maybe_repeat_kv_before_cache``), one set per KV head.
    """
    kept = []
    for view in layer_views(model, prompt, window, kernel, pooling):
        pool = {"avg": "avgpool", "max": "maxpool"}[pooling]
        if regime.startswith("kvhead-"):
            cluster = factory.SnapKVCluster(window_size=window, max_capacity_prompt=budget, kernel_size=kernel,
                                            pooling=pool, gqa_score_agg=gqa_agg(regime))
        else:
            cluster = snapkv.SnapKVCluster(window_size=window, max_capacity_prompt=budget, kernel_size=kernel,
                                           pooling=pool)
        keys, queries, values, groups = inputs(snapkv, view, regime)
        _, out = cluster.update_kv(keys, queries, values, None, groups)
        kept.append(np.sort(out[0, :, :, 0].numpy().astype(np.int64), axis=-1))
    return np.array(kept)  # (L, heads, N)


def run_snapkv(repos: Path, out: Path) -> list[dict]:
    folder = checkout(repos, REPOSITORIES["snapkv"])
    commit = commit_of(folder)
    module = load_module(folder, "snapkv/monkeypatch/snapkv_utils.py", "authors_snapkv_utils")
    factory_folder = checkout(repos, REPOSITORIES["pyramidkv"])
    factory_commit = commit_of(factory_folder)
    factory = load_module(factory_folder, "pyramidkv/pyramidkv_utils.py", "authors_pyramidkv_utils")
    target = out / "snapkv"
    target.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, regime, budget, window, kernel, pooling, length in SNAPKV_CONFIGS:
        # float32: the code cannot run in float64 (snapkv_utils.py:46 fills a float32 tensor with
        # finfo(float64).min, which overflows); its models run in float16.
        source, reference, model_name = regime_model(regime)
        params = {"window": window, "kernel": kernel, "pooling": pooling, "form": "authors"}
        if gqa_agg(regime):
            params["gqa_agg"] = gqa_agg(regime)
        policy = policies.get("snapkv", **params)
        manifest, arrays = run_schedule_golden(policy, Schedule(None, budget, 1, budget, new_tokens=0),
                                               dtype="float32", prompt_length=length, model=model_name,
                                               built=reference)
        theirs = snapkv_authors_kept(module, factory, source, arrays["prompt"], budget, window, kernel, pooling,
                                     regime)
        ours = arrays["kept"][0]  # (L, heads, N)
        kv_head = regime.startswith("kvhead-")
        repository, at = (REPOSITORIES["pyramidkv"], factory_commit) if kv_head else (REPOSITORIES["snapkv"], commit)
        code = ("pyramidkv/pyramidkv_utils.py SnapKVCluster.update_kv (kv_head layout, gqa_score_agg="
                f"{gqa_agg(regime)!r})" if kv_head else "snapkv/monkeypatch/snapkv_utils.py SnapKVCluster.update_kv"
                + (" (keys repeated with repeat_kv first)" if regime == "query" else ""))
        candidate = {**manifest, "declare": {"kept_only": True},
                     "source": {"repository": repository, "commit": at, "code": code,
                                "logits": "not computed by the authors' routine (zeros, not compared: kept_only)"}}
        write_end_to_end(target / f"{label}.json", candidate,
                         {"kept": theirs[None], "kept_count": np.full((1, theirs.shape[0]), budget, dtype=np.int64),
                          "logits": np.zeros_like(arrays["logits"])})
        write_reference(out, "snapkv", label, manifest, arrays)
        rows.append({"policy": "snapkv", "configuration": label, "model": model_name, "budget": budget,
                     "window": window, "kernel": kernel, "pooling": pooling, "prompt": length,
                     "gqa": regime != "mha", "regime": regime, "gqa_agg": gqa_agg(regime), "repository": repository,
                     "commit": at, "form": "authors", "identical": bool(np.array_equal(theirs, ours)),
                     "file": f"tests/authors/snapkv/{label}.json"})
        if regime == "query":
            rows[-1]["note"] = split_note(theirs, source.config.n_heads // source.config.n_kv_heads)
        print(f"snapkv {label}: {'identical' if rows[-1]['identical'] else 'DIFFERENT'}")
    write_provenance(target, "snapkv", commit, rows)
    return rows


# -- PyramidKV: PyramidKVCluster of Zefan-Cai/KVCache-Factory ----------------------------------------
#: (label, regime, budget N, window w, kernel k, pooling, beta, prompt T), float32: the pyramid
#: (T >= 2(N - w)), the capped pyramid, the uniform fallback (N <= T < 2(N - w)), no compression
#: (T < N), another beta, max pooling; the same on GQA, per query head and per KV head.
PYRAMIDKV_CONFIGS = (
    ("N16-w4-k3-avg-b20-T40", "mha", 16, 4, 3, "avg", 20, 40),
    ("N16-w4-k3-avg-b20-T27", "mha", 16, 4, 3, "avg", 20, 27),
    ("N16-w4-k3-avg-b20-T20", "mha", 16, 4, 3, "avg", 20, 20),
    ("N16-w4-k3-avg-b20-T12", "mha", 16, 4, 3, "avg", 20, 12),
    ("N16-w4-k7-avg-b4-T40", "mha", 16, 4, 7, "avg", 4, 40),
    ("N24-w8-k5-max-b20-T48", "mha", 24, 8, 5, "max", 20, 48),
    ("gqa-N16-w4-k3-avg-b20-T40", "query", 16, 4, 3, "avg", 20, 40),
    ("gqa-N16-w4-k3-avg-b20-T27", "query", 16, 4, 3, "avg", 20, 27),
    ("gqa-N16-w4-k7-avg-b4-T40", "query", 16, 4, 7, "avg", 4, 40),
    ("gqa-N24-w8-k5-max-b20-T48", "query", 24, 8, 5, "max", 20, 48),
    ("kvhead-aggmean-N16-w4-k3-avg-b20-T40", "kvhead-mean", 16, 4, 3, "avg", 20, 40),
    ("kvhead-aggmax-N16-w4-k3-avg-b20-T27", "kvhead-max", 16, 4, 3, "avg", 20, 27),
    ("kvhead-aggsum-N24-w8-k5-avg-b4-T48", "kvhead-sum", 24, 8, 5, "avg", 4, 48),
    ("kvhead-aggmean-N24-w8-k5-max-b20-T48", "kvhead-mean", 24, 8, 5, "max", 20, 48),
)


def pyramidkv_authors_kept(module, model: Model, prompt, budget, window, kernel, pooling, beta, regime):
    """What each layer's ``PyramidKVCluster`` keeps after a one-shot prompt: list of (heads, keep_l).

    The query-head path is given the keys repeated (``maybe_repeat_kv_before_cache`` in the default
    ``query_head`` layout, ``llama_model.py:173``); the ``kv_head`` layout gives the unrepeated keys
    and ``update_kv`` takes its ``_update_kv_kv_head`` path (``pyramidkv_utils.py:354-356``).
    """
    kept = []
    for layer, view in enumerate(layer_views(model, prompt, window, kernel, pooling)):
        agg = {"gqa_score_agg": gqa_agg(regime)} if gqa_agg(regime) else {}
        cluster = module.PyramidKVCluster(num_hidden_layers=model.config.n_layers, window_size=window,
                                          max_capacity_prompt=budget, kernel_size=kernel,
                                          pooling={"avg": "avgpool", "max": "maxpool"}[pooling], beta=beta,
                                          layer_idx=layer, **agg)
        keys, queries, values, groups = inputs(module, view, regime)
        _, out = cluster.update_kv(keys, queries, values, None, groups)
        kept.append(np.sort(out[0, :, :, 0].numpy().astype(np.int64), axis=-1))
    return kept


def run_pyramidkv(repos: Path, out: Path) -> list[dict]:
    folder = checkout(repos, REPOSITORIES["pyramidkv"])
    commit = commit_of(folder)
    module = load_module(folder, "pyramidkv/pyramidkv_utils.py", "authors_pyramidkv_utils")
    target = out / "pyramidkv"
    target.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, regime, budget, window, kernel, pooling, beta, length in PYRAMIDKV_CONFIGS:
        source, reference, model_name = regime_model(regime)  # float32: as SnapKV's (the same mask code)
        base_params = {"window": window, "kernel": kernel, "pooling": pooling}
        if gqa_agg(regime):
            base_params["gqa_agg"] = gqa_agg(regime)
        policy = policies.get("pyramidkv", form="authors", beta=beta, base_params=base_params)
        manifest, arrays = run_schedule_golden(policy, Schedule(None, budget, 1, budget, new_tokens=0),
                                               dtype="float32", prompt_length=length, model=model_name,
                                               built=reference)
        theirs = pyramidkv_authors_kept(module, source, arrays["prompt"], budget, window, kernel, pooling, beta,
                                        regime)
        width = arrays["kept"].shape[-1]
        kept = np.full(arrays["kept"].shape, -1, dtype=np.int64)
        for layer, held in enumerate(theirs):
            kept[0, layer, :, :held.shape[1]] = held[:, :width]
        counts = np.array([[held.shape[1] for held in theirs]], dtype=np.int64)
        path = ("kv_head layout, _update_kv_kv_head, gqa_score_agg=" + repr(gqa_agg(regime)) if gqa_agg(regime)
                else "query-head path" + (", keys repeated with repeat_kv first" if regime == "query" else ""))
        candidate = {**manifest, "declare": {"kept_only": True},
                     "source": {"repository": REPOSITORIES["pyramidkv"], "commit": commit,
                                "code": f"pyramidkv/pyramidkv_utils.py PyramidKVCluster.update_kv ({path})",
                                "logits": "not computed by the authors' routine (zeros, not compared: kept_only)"}}
        write_end_to_end(target / f"{label}.json", candidate,
                         {"kept": kept, "kept_count": counts, "logits": np.zeros_like(arrays["logits"])})
        write_reference(out, "pyramidkv", label, manifest, arrays)
        same = bool(np.array_equal(kept, arrays["kept"]) and np.array_equal(counts, arrays["kept_count"]))
        rows.append({"policy": "pyramidkv", "configuration": label, "model": model_name, "budget": budget,
                     "window": window, "kernel": kernel, "pooling": pooling, "beta": beta, "prompt": length,
                     "gqa": regime != "mha", "regime": regime, "gqa_agg": gqa_agg(regime),
                     "repository": REPOSITORIES["pyramidkv"], "kept_per_layer": counts[0].tolist(),
                     "identical": same, "commit": commit, "file": f"tests/authors/pyramidkv/{label}.json"})
        if regime == "query":
            rows[-1]["note"] = split_note(kept[0], source.config.n_heads // source.config.n_kv_heads)
        print(f"pyramidkv {label}: {counts[0].tolist()} {'identical' if same else 'DIFFERENT'}")
    write_provenance(target, "pyramidkv", commit, rows)
    return rows


# -- Ada-KV: AdaptiveSnapKVCluster of FFY0/AdaKV ------------------------------------------------------
#: (label, regime, budget N, window w, kernel k, pooling, alpha, prompt T), float32. GQA: per query
#: head (``gqa_support=False``: the code repeats the keys itself) and per KV head
#: (``gqa_support=True`` with ``gqa_func`` mean or max, the only two it accepts).
ADAKV_CONFIGS = (
    ("N16-w4-k3-avg-a0.2-T40", "mha", 16, 4, 3, "avg", 0.2, 40),
    ("N16-w4-k3-avg-a0.5-T40", "mha", 16, 4, 3, "avg", 0.5, 40),
    ("N24-w8-k5-avg-a0.2-T48", "mha", 24, 8, 5, "avg", 0.2, 48),
    ("N12-w4-k7-max-a0.2-T40", "mha", 12, 4, 7, "max", 0.2, 40),
    ("N16-w4-k3-avg-a0-T40", "mha", 16, 4, 3, "avg", 0.0, 40),
    ("gqa-N16-w4-k3-avg-a0.2-T40", "query", 16, 4, 3, "avg", 0.2, 40),
    ("gqa-N24-w8-k5-avg-a0.5-T48", "query", 24, 8, 5, "avg", 0.5, 48),
    ("gqa-N12-w4-k7-max-a0.2-T40", "query", 12, 4, 7, "max", 0.2, 40),
    ("kvhead-aggmean-N16-w4-k3-avg-a0.2-T40", "kvhead-mean", 16, 4, 3, "avg", 0.2, 40),
    ("kvhead-aggmax-N16-w4-k3-avg-a0.2-T40", "kvhead-max", 16, 4, 3, "avg", 0.2, 40),
    ("kvhead-aggmean-N24-w8-k5-avg-a0-T48", "kvhead-mean", 24, 8, 5, "avg", 0.0, 48),
    ("kvhead-aggmax-N12-w4-k7-max-a0.5-T40", "kvhead-max", 12, 4, 7, "max", 0.5, 40),
)


def flash_attn_stub() -> None:
    """The AdaKV module imports ``flash_attn_func`` at load time (``snapkv_utils.py:9``) for its
    cache's attention, which the selection never calls; a stand-in that refuses to run is
    registered when the real package is absent (the only stub of this harness)."""
    if importlib.util.find_spec("flash_attn") is not None:
        return
    import types

    stub = types.ModuleType("flash_attn")

    def flash_attn_func(*args, **kwargs):
        raise RuntimeError("flash_attn stub: the selection routine must not call attention")

    stub.flash_attn_func = flash_attn_func
    sys.modules["flash_attn"] = stub


def adakv_authors_kept(module, model: Model, prompt, budget, window, kernel, pooling, alpha, regime):
    """What each layer's ``AdaptiveSnapKVCluster`` keeps after a one-shot prompt: per layer, the
    kept positions of every head (ragged), from refkv's queries and keys (values carry positions).

    As the authors' attention forward (``adaptive_mistral_hijack.py:241``) the cluster receives
    the unrepeated keys and values: ``update_kv_wo_gqa`` repeats them itself (``snapkv_utils.py:508-509``)
    and selects per query head; ``update_kv_gqa`` (``gqa_support=True``) selects per KV head.
    """
    import torch

    kept = []
    for layer, view in enumerate(layer_views(model, prompt, window, kernel, pooling)):
        gqa = {"gqa_support": True, "gqa_func": gqa_agg(regime)} if gqa_agg(regime) else {}
        cluster = module.AdaptiveSnapKVCluster(window_size=window, kernel_size=kernel,
                                               pooling={"avg": "avgpool", "max": "maxpool"}[pooling],
                                               base_capacity=budget, floor_alpha=alpha, skip=0, normalize=None,
                                               layer_idx=layer, num_hidden_layers=model.config.n_layers,
                                               num_key_value_groups=view.group_size, **gqa)
        keys = torch.from_numpy(view.keys.copy())[None]  # (1, Hkv, T, d): the code repeats them when it must
        values = position_values(view, keys.shape[1])
        _, flat = cluster.update_kv(keys, torch.from_numpy(view.queries.copy())[None], values)
        rows = torch.split(flat[:, 0], cluster.head_lens.tolist())
        kept.append([np.sort(r.numpy().astype(np.int64)) for r in rows])
    return kept


def run_adakv(repos: Path, out: Path) -> list[dict]:
    folder = checkout(repos, REPOSITORIES["adakv"])
    commit = commit_of(folder)
    flash_attn_stub()
    module = load_module(folder, "adaptive_snapkv/monkeypatch/snapkv_utils.py", "authors_adakv_snapkv_utils")
    target = out / "adakv"
    target.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, regime, budget, window, kernel, pooling, alpha, length in ADAKV_CONFIGS:
        source, reference, model_name = regime_model(regime)
        base_params = {"window": window, "kernel": kernel, "pooling": pooling}
        if gqa_agg(regime):
            base_params["gqa_agg"] = gqa_agg(regime)
        policy = policies.get("adakv", form="authors", alpha=alpha, base_params=base_params)
        manifest, arrays = run_schedule_golden(policy, Schedule(None, budget, 1, budget, new_tokens=0),
                                               dtype="float32", prompt_length=length, model=model_name,
                                               built=reference)
        theirs = adakv_authors_kept(module, source, arrays["prompt"], budget, window, kernel, pooling, alpha, regime)
        width = max(arrays["kept"].shape[-1], max(len(r) for layer in theirs for r in layer))
        kept = np.full((*arrays["kept"].shape[:3], width), -1, dtype=np.int64)
        for layer, per_head in enumerate(theirs):
            for h, r in enumerate(per_head):
                kept[0, layer, h, :len(r)] = r
        counts = np.array([[max(len(r) for r in layer) for layer in theirs]], dtype=np.int64)
        path = (f"update_kv_gqa, gqa_support=True, gqa_func={gqa_agg(regime)!r}" if gqa_agg(regime)
                else "update_kv_wo_gqa, gqa_support=False" + (", keys repeated inside" if regime == "query" else ""))
        candidate = {**manifest, "declare": {"kept_only": True},
                     "source": {"repository": REPOSITORIES["adakv"], "commit": commit,
                                "code": f"adaptive_snapkv/monkeypatch/snapkv_utils.py AdaptiveSnapKVCluster.update_kv "
                                        f"({path}); flash_attn stubbed (imported, never called)",
                                "logits": "not computed by the authors' routine (zeros, not compared: kept_only)"}}
        write_end_to_end(target / f"{label}.json", candidate,
                         {"kept": kept, "kept_count": counts, "logits": np.zeros_like(arrays["logits"])})
        write_reference(out, "adakv", label, manifest, arrays)
        ours = arrays["kept"]
        same = bool(ours.shape == kept.shape and np.array_equal(kept, ours))
        per_head = [[len(r) for r in layer] for layer in theirs]
        rows.append({"policy": "adakv", "configuration": label, "model": model_name, "budget": budget,
                     "window": window, "kernel": kernel, "pooling": pooling, "alpha": alpha, "prompt": length,
                     "gqa": regime != "mha", "regime": regime, "gqa_agg": gqa_agg(regime),
                     "repository": REPOSITORIES["adakv"], "kept_per_head": per_head, "identical": same,
                     "commit": commit, "file": f"tests/authors/adakv/{label}.json"})
        if regime == "query":
            rows[-1]["note"] = split_note(kept[0], source.config.n_heads // source.config.n_kv_heads)
        print(f"adakv {label}: {per_head} {'identical' if same else 'DIFFERENT'}")
    write_provenance(target, "adakv", commit, rows)
    return rows


def write_reference(out: Path, policy: str, label: str, manifest: dict, arrays: dict) -> None:
    """refkv's own golden of the run (its authors' form), beside the candidates: what a backend
    that ports the authors' code checks itself against (``tests/authors/reference/<policy>/``)."""
    folder = out / "reference" / policy
    folder.mkdir(parents=True, exist_ok=True)
    write_end_to_end(folder / f"{label}.json", manifest, arrays)


def write_provenance(target: Path, policy: str, commit: str, rows: list[dict]) -> None:
    obj = {"policy": policy, "repository": REPOSITORIES[policy], "commit": commit,
           "loaded_unmodified": True, "tool": "tools/authors/run_authors.py", "configurations": rows}
    atomic_write(target / "PROVENANCE.json", (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


RUNNERS = {"hashevict": run_hashevict, "snapkv": run_snapkv, "pyramidkv": run_pyramidkv, "adakv": run_adakv}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repos", default=os.environ.get("REFKV_AUTHORS_REPOS"),
                        help="folder of the authors' checkouts (or env REFKV_AUTHORS_REPOS)")
    parser.add_argument("--out", default=str(ROOT / "tests" / "authors"), help="where the candidates go")
    parser.add_argument("--policy", action="append", choices=sorted(RUNNERS), help="only these (repeatable)")
    args = parser.parse_args(argv)
    if not args.repos:
        parser.error("--repos DIR (or REFKV_AUTHORS_REPOS) is required")
    repos = Path(args.repos)
    if not repos.is_dir():
        parser.error(f"--repos must be a folder, got {repos}")
    for name in args.policy or sorted(RUNNERS):
        RUNNERS[name](repos, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
