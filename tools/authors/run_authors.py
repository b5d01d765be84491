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


# -- SnapKV: SnapKVCluster of FasterDecoding/SnapKV ----------------------------------------------------
#: (label, MHA, budget N, window w, kernel k, pooling, prompt T): one-shot prefill compressed once.
SNAPKV_CONFIGS = (
    ("mha-N16-w4-k3-avg-T40", True, 16, 4, 3, "avg", 40),
    ("mha-N24-w8-k5-avg-T48", True, 24, 8, 5, "avg", 48),
    ("mha-N12-w4-k7-avg-T40", True, 12, 4, 7, "avg", 40),
    ("mha-N16-w4-k3-max-T40", True, 16, 4, 3, "max", 40),
    ("mha-N40-w32-k7-max-T64", True, 40, 32, 7, "max", 64),
    ("mha-N16-w8-k1-avg-T24", True, 16, 8, 1, "avg", 24),
    ("gqa-N16-w4-k3-avg-T40", False, 16, 4, 3, "avg", 40),
    ("gqa-N16-w4-k7-max-T40", False, 16, 4, 7, "max", 40),
)


def snapkv_authors_kept(module, model: Model, prompt, budget: int, window: int, kernel: int, pooling: str):
    """What ``SnapKVCluster.update_kv`` keeps in every layer after a one-shot prefill: (L, H, N).

    The queries and keys are refkv's (the views of its engine's eviction, one per layer; in a
    one-shot prefill no layer's input depends on an eviction). The keys are repeated to the
    query heads with the code's own ``repeat_kv`` (as its attention does before calling
    ``update_kv``). The values handed to it carry each token's position in their first entry:
    ``update_kv`` only gathers values (``snapkv_utils.py:64-69``), so what it returns names
    the tokens it kept.
    """
    import torch

    policy = policies.get("snapkv", window=window, kernel=kernel, pooling=pooling)  # its views only
    engine = Engine(model, policy, budget, record="views")
    engine.forward(prompt)
    cluster = module.SnapKVCluster(window_size=window, max_capacity_prompt=budget, kernel_size=kernel,
                                   pooling={"avg": "avgpool", "max": "maxpool"}[pooling])
    kept = []
    for event in sorted(engine.trace.evictions, key=lambda e: e.layer):
        view = event.view
        groups = view.group_size
        keys = module.repeat_kv(torch.from_numpy(view.keys.copy())[None], groups)  # (1, H, T, d)
        queries = torch.from_numpy(view.queries.copy())[None]  # (1, H, T, d)
        values = torch.zeros_like(keys)
        values[..., 0] = torch.from_numpy(view.positions[0].astype(np.float64))  # positions, one per token
        _, out = cluster.update_kv(keys, queries, values, None, groups)
        kept.append(np.sort(out[0, :, :, 0].numpy().astype(np.int64), axis=-1))
    return np.array(kept)  # (L, H, N)


def run_snapkv(repos: Path, out: Path) -> list[dict]:
    folder = checkout(repos, REPOSITORIES["snapkv"])
    commit = commit_of(folder)
    module = load_module(folder, "snapkv/monkeypatch/snapkv_utils.py", "authors_snapkv_utils")
    target = out / "snapkv"
    target.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, mha, budget, window, kernel, pooling, length in SNAPKV_CONFIGS:
        # float32: the code cannot run in float64 (snapkv_utils.py:46 fills a float32 tensor with
        # finfo(float64).min, which overflows); its models run in float16.
        model, model_name = model_for("tiny", mha, "float32")
        schedule = Schedule(None, budget, 1, budget, new_tokens=0)
        form = "authors" if mha else "paper"  # GQA: refkv's authors' form refuses (one cache row per KV head)
        policy = policies.get("snapkv", window=window, kernel=kernel, pooling=pooling, form=form)
        manifest, arrays = run_schedule_golden(policy, schedule, dtype="float32", prompt_length=length,
                                               model=model_name, built=model)
        theirs = snapkv_authors_kept(module, model, arrays["prompt"], budget, window, kernel, pooling)
        ours = arrays["kept"][0]  # (L, Hkv, N)
        row = {"policy": "snapkv", "configuration": label, "model": model_name, "budget": budget, "window": window,
               "kernel": kernel, "pooling": pooling, "prompt": length, "gqa": not mha, "commit": commit}
        if mha:
            candidate = {**manifest, "declare": {"kept_only": True},
                         "source": {"repository": REPOSITORIES["snapkv"], "commit": commit,
                                    "code": "snapkv/monkeypatch/snapkv_utils.py SnapKVCluster.update_kv",
                                    "logits": "not computed by the authors' routine (zeros, not compared: kept_only)"}}
            write_end_to_end(target / f"{label}.json", candidate,
                             {"kept": theirs[None], "kept_count": np.full((1, theirs.shape[0]), budget, dtype=np.int64),
                              "logits": np.zeros_like(arrays["logits"])})
            write_reference(out, "snapkv", label, manifest, arrays)
            row.update(identical=bool(np.array_equal(theirs, ours)), form="authors",
                       file=f"tests/authors/snapkv/{label}.json")
        else:
            # the code keeps one set per query head; refkv's paper form one per KV head (group mean)
            g = model.config.n_heads // model.config.n_kv_heads
            grouped = theirs.reshape(theirs.shape[0], -1, g, theirs.shape[-1])  # (L, Hkv, g, N)
            split = int(sum(len({tuple(x) for x in grouped[layer, h]}) > 1
                            for layer in range(grouped.shape[0]) for h in range(grouped.shape[1])))
            equal = int(sum(any(np.array_equal(x, ours[layer, h]) for x in grouped[layer, h])
                            for layer in range(grouped.shape[0]) for h in range(grouped.shape[1])))
            row.update(identical=False, form="paper (authors' form refuses GQA)",
                       note=f"per query head: in {split} of {grouped.shape[0] * grouped.shape[1]} (layer, KV head) "
                            f"pairs the group's query heads keep different sets; in {equal} one of them equals "
                            f"refkv's group-mean set", file=None)
        rows.append(row)
        print(f"snapkv {label}: {row.get('note') or ('identical' if row['identical'] else 'DIFFERENT')}")
    write_provenance(target, "snapkv", commit, rows)
    return rows


# -- PyramidKV: PyramidKVCluster of Zefan-Cai/KVCache-Factory ----------------------------------------
#: (label, budget N, window w, kernel k, pooling, beta, prompt T), tiny model without GQA, float32:
#: the pyramid (T >= 2(N - w)), the capped pyramid, the uniform fallback (N <= T < 2(N - w)), no
#: compression (T < N), another beta, max pooling.
PYRAMIDKV_CONFIGS = (
    ("N16-w4-k3-avg-b20-T40", 16, 4, 3, "avg", 20, 40),
    ("N16-w4-k3-avg-b20-T27", 16, 4, 3, "avg", 20, 27),
    ("N16-w4-k3-avg-b20-T20", 16, 4, 3, "avg", 20, 20),
    ("N16-w4-k3-avg-b20-T12", 16, 4, 3, "avg", 20, 12),
    ("N16-w4-k7-avg-b4-T40", 16, 4, 7, "avg", 4, 40),
    ("N24-w8-k5-max-b20-T48", 24, 8, 5, "max", 20, 48),
)


def pyramidkv_authors_kept(module, model: Model, prompt, budget, window, kernel, pooling, beta):
    """What each layer's ``PyramidKVCluster`` keeps after a one-shot prompt: list of (H, keep_l).

    As :func:`snapkv_authors_kept`: refkv's queries and keys (the views of a recording engine; in a
    one-shot prefill no layer's input depends on an eviction), values carrying the positions.
    """
    import torch

    n_layers = model.config.n_layers
    # a budget of T - 1 makes every layer evict once, so the trace holds each layer's view
    engine = Engine(model, policies.get("snapkv", window=window, kernel=kernel, pooling=pooling), len(prompt) - 1,
                    record="views")
    engine.forward(prompt)
    kept = []
    for event in sorted(engine.trace.evictions, key=lambda e: e.layer):
        view = event.view
        cluster = module.PyramidKVCluster(num_hidden_layers=n_layers, window_size=window, max_capacity_prompt=budget,
                                          kernel_size=kernel, pooling={"avg": "avgpool", "max": "maxpool"}[pooling],
                                          beta=beta, layer_idx=event.layer)
        keys = torch.from_numpy(view.keys.copy())[None]
        values = torch.zeros_like(keys)
        values[..., 0] = torch.from_numpy(view.positions[0].astype(np.float64))
        _, out = cluster.update_kv(keys, torch.from_numpy(view.queries.copy())[None], values, None, 1)
        kept.append(np.sort(out[0, :, :, 0].numpy().astype(np.int64), axis=-1))
    return kept


def run_pyramidkv(repos: Path, out: Path) -> list[dict]:
    folder = checkout(repos, REPOSITORIES["pyramidkv"])
    commit = commit_of(folder)
    module = load_module(folder, "pyramidkv/pyramidkv_utils.py", "authors_pyramidkv_utils")
    target = out / "pyramidkv"
    target.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, budget, window, kernel, pooling, beta, length in PYRAMIDKV_CONFIGS:
        model, model_name = model_for("tiny", True, "float32")  # float32: as SnapKV's (the same mask code)
        policy = policies.get("pyramidkv", form="authors", beta=beta,
                              base_params={"window": window, "kernel": kernel, "pooling": pooling})
        manifest, arrays = run_schedule_golden(policy, Schedule(None, budget, 1, budget, new_tokens=0),
                                               dtype="float32", prompt_length=length, model=model_name, built=model)
        theirs = pyramidkv_authors_kept(module, model, arrays["prompt"], budget, window, kernel, pooling, beta)
        width = arrays["kept"].shape[-1]
        kept = np.full(arrays["kept"].shape, -1, dtype=np.int64)
        for layer, held in enumerate(theirs):
            kept[0, layer, :, :held.shape[1]] = held[:, :width]
        counts = np.array([[held.shape[1] for held in theirs]], dtype=np.int64)
        candidate = {**manifest, "declare": {"kept_only": True},
                     "source": {"repository": REPOSITORIES["pyramidkv"], "commit": commit,
                                "code": "pyramidkv/pyramidkv_utils.py PyramidKVCluster.update_kv (query-head path)",
                                "logits": "not computed by the authors' routine (zeros, not compared: kept_only)"}}
        write_end_to_end(target / f"{label}.json", candidate,
                         {"kept": kept, "kept_count": counts, "logits": np.zeros_like(arrays["logits"])})
        write_reference(out, "pyramidkv", label, manifest, arrays)
        same = bool(np.array_equal(kept, arrays["kept"]) and np.array_equal(counts, arrays["kept_count"]))
        rows.append({"policy": "pyramidkv", "configuration": label, "model": model_name, "budget": budget,
                     "window": window, "kernel": kernel, "pooling": pooling, "beta": beta, "prompt": length,
                     "gqa": False, "kept_per_layer": counts[0].tolist(), "identical": same, "commit": commit,
                     "file": f"tests/authors/pyramidkv/{label}.json"})
        print(f"pyramidkv {label}: {counts[0].tolist()} {'identical' if same else 'DIFFERENT'}")
    write_provenance(target, "pyramidkv", commit, rows)
    return rows


# -- Ada-KV: AdaptiveSnapKVCluster of FFY0/AdaKV ------------------------------------------------------
#: (label, budget N, window w, kernel k, pooling, alpha, prompt T): tiny model without GQA, float32.
ADAKV_CONFIGS = (
    ("N16-w4-k3-avg-a0.2-T40", 16, 4, 3, "avg", 0.2, 40),
    ("N16-w4-k3-avg-a0.5-T40", 16, 4, 3, "avg", 0.5, 40),
    ("N24-w8-k5-avg-a0.2-T48", 24, 8, 5, "avg", 0.2, 48),
    ("N12-w4-k7-max-a0.2-T40", 12, 4, 7, "max", 0.2, 40),
    ("N16-w4-k3-avg-a0-T40", 16, 4, 3, "avg", 0.0, 40),
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


def adakv_authors_kept(module, model: Model, prompt, budget, window, kernel, pooling, alpha):
    """What each layer's ``AdaptiveSnapKVCluster`` keeps after a one-shot prompt: per layer, the
    kept positions of every head (ragged), from refkv's queries and keys (values carry positions)."""
    import torch

    n_layers = model.config.n_layers
    engine = Engine(model, policies.get("snapkv", window=window, kernel=kernel, pooling=pooling), len(prompt) - 1,
                    record="views")
    engine.forward(prompt)
    kept = []
    for event in sorted(engine.trace.evictions, key=lambda e: e.layer):
        view = event.view
        cluster = module.AdaptiveSnapKVCluster(window_size=window, kernel_size=kernel,
                                               pooling={"avg": "avgpool", "max": "maxpool"}[pooling],
                                               base_capacity=budget, floor_alpha=alpha, skip=0, normalize=None,
                                               layer_idx=event.layer, num_hidden_layers=n_layers)
        keys = torch.from_numpy(view.keys.copy())[None]
        values = torch.zeros_like(keys)
        values[..., 0] = torch.from_numpy(view.positions[0].astype(np.float64))
        _, flat = cluster.update_kv(keys, torch.from_numpy(view.queries.copy())[None], values)
        lengths = cluster.head_lens.tolist()
        rows = torch.split(flat[:, 0], lengths)
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
    for label, budget, window, kernel, pooling, alpha, length in ADAKV_CONFIGS:
        model, model_name = model_for("tiny", True, "float32")
        policy = policies.get("adakv", form="authors", alpha=alpha,
                              base_params={"window": window, "kernel": kernel, "pooling": pooling})
        manifest, arrays = run_schedule_golden(policy, Schedule(None, budget, 1, budget, new_tokens=0),
                                               dtype="float32", prompt_length=length, model=model_name, built=model)
        theirs = adakv_authors_kept(module, model, arrays["prompt"], budget, window, kernel, pooling, alpha)
        width = max(arrays["kept"].shape[-1], max(len(r) for layer in theirs for r in layer))
        kept = np.full((*arrays["kept"].shape[:3], width), -1, dtype=np.int64)
        for layer, per_head in enumerate(theirs):
            for h, r in enumerate(per_head):
                kept[0, layer, h, :len(r)] = r
        counts = np.array([[max(len(r) for r in layer) for layer in theirs]], dtype=np.int64)
        candidate = {**manifest, "declare": {"kept_only": True},
                     "source": {"repository": REPOSITORIES["adakv"], "commit": commit,
                                "code": "adaptive_snapkv/monkeypatch/snapkv_utils.py AdaptiveSnapKVCluster.update_kv "
                                        "(gqa_support=False); flash_attn stubbed (imported, never called)",
                                "logits": "not computed by the authors' routine (zeros, not compared: kept_only)"}}
        write_end_to_end(target / f"{label}.json", candidate,
                         {"kept": kept, "kept_count": counts, "logits": np.zeros_like(arrays["logits"])})
        write_reference(out, "adakv", label, manifest, arrays)
        ours = arrays["kept"]
        same = bool(ours.shape == kept.shape and np.array_equal(kept, ours))
        per_head = [[len(r) for r in layer] for layer in theirs]
        rows.append({"policy": "adakv", "configuration": label, "model": model_name, "budget": budget,
                     "window": window, "kernel": kernel, "pooling": pooling, "alpha": alpha, "prompt": length,
                     "gqa": False, "kept_per_head": per_head, "identical": same, "commit": commit,
                     "file": f"tests/authors/adakv/{label}.json"})
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
