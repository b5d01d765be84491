"""What the authors'-code harnesses share: loading a checkout, driving refkv's engine with the
authors' selection routine, and writing candidate and reference files in refkv's golden format.

How a run works (one configuration: a model, a policy, a budget, a regime)
---------------------------------------------------------------------------
refkv's :class:`~refkv.engine.Engine` runs the built-in ``tiny`` model (GQA: 4 query heads,
2 KV heads) or ``tiny-mha`` (the same shapes with 4 KV heads, built here with refkv's own
:class:`~refkv.model.ModelConfig` and :func:`~refkv.model.random_weights`) over a seeded
prompt, one-shot (the whole prompt is one block) or token by token (``B = 1``, the
decoding step). Its policy is refkv's own policy object with two methods handed to a
*decider* that calls the authors' code (:func:`driven`): ``observe`` (every layer step,
so a stateful routine such as H2O's sees every forward's weights, as in their model) and
``keep_indices`` (each eviction: the kept tokens are what the authors' routine returned,
found back in refkv's cache by exact equality of key and value rows). So the run follows
the authors' decisions, and at every eviction refkv's view -- the same keys, values,
positions, attention weights and per-token state -- is what both sides decided on.

Each eviction becomes one vector case: the reference (``encode_case`` of refkv's policy
in the form named, paper or authors') and the candidate (the authors' kept columns, and
their scores where their routine exposes them). ``refkv golden check CAND --against REF``
then judges the authors' code against refkv's form, decision by decision.

Nothing here is imported by refkv; nothing of the authors' code is copied: their files
are loaded from the checkout (``--repos DIR`` or ``REFKV_AUTHORS_REPOS``; ``DIR/<repo>/``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import io
import os
import platform
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from refkv.engine import Engine
from refkv.model import TINY, Model, builtin_model, random_weights
from refkv.oracle.encode import candidate_document, encode_case, vectors_document
from refkv.oracle.io import write_json
from refkv.oracle.models import prompt_tokens
from refkv.oracle.vectors import json_params

__all__ = ["ENV", "MODELS", "Run", "columns_of", "driven", "load_module", "parse_args", "provenance", "quiet",
           "repos_dir", "run_config", "run_items", "to_torch", "write_outputs"]

#: The environment variable naming the folder of checkouts (``DIR/<repo>/``).
ENV = "REFKV_AUTHORS_REPOS"

#: The non-GQA model: ``tiny``'s shapes with one KV head per query head.
TINY_MHA = replace(TINY, n_kv_heads=TINY.n_heads, name="tiny-mha")

#: The models a configuration runs: name -> builder(seed) (float64 weights).
MODELS = {
    "tiny": lambda seed: builtin_model(seed=seed, dtype=np.float64),
    "tiny-mha": lambda seed: Model(TINY_MHA, random_weights(TINY_MHA, seed=seed, dtype=np.float64)),
}

#: Prompt seed of every run (refkv.oracle.models.PROMPT_RULE) and model seed.
PROMPT_SEED, MODEL_SEED = 1, 0


def parse_args(description: str, argv=None) -> argparse.Namespace:
    """``--repos DIR`` (default ``$REFKV_AUTHORS_REPOS``) and ``--out DIR`` (the policy's tests/authors folder)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--repos", default=os.environ.get(ENV),
                   help=f"folder holding the authors' checkouts, one per repository (default ${ENV})")
    p.add_argument("--out", required=True, help="folder to write (candidate/, paper/, authors/, ties/, "
                                                "PROVENANCE.json)")
    args = p.parse_args(argv)
    if not args.repos:
        p.error(f"--repos is required (or set {ENV})")
    return args


def repos_dir(repos, name: str) -> Path:
    """``repos/name``, which must be a folder (a checkout of the authors' repository)."""
    path = Path(repos) / name
    if not path.is_dir():
        raise SystemExit(f"no checkout of {name} at {path}: export the pinned commit there (see tools/authors/"
                         f"README.rst)")
    return path


def load_module(path: Path, name: str, stubs: dict | None = None):
    """Import the file ``path`` as a module named ``name``, unmodified (importlib from the checkout).

    ``stubs`` maps module names to stand-ins placed in ``sys.modules`` only while the file is
    executed (for heavy or missing imports the selection routine does not use); the modules
    the file imported are left as they were found afterwards.
    """
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    saved = {k: sys.modules.get(k) for k in (stubs or {})}
    try:
        sys.modules.update(stubs or {})
        spec.loader.exec_module(module)
    finally:
        for k, old in saved.items():
            if old is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = old
    return module


def quiet(fn, *args, **kwargs):
    """Call ``fn`` with its prints swallowed (the authors' constructors print their sizes)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args, **kwargs)


def to_torch(array: np.ndarray):
    """A (1, ...) torch tensor of ``array``, float64 as it is (the batch dimension the authors' code expects)."""
    import torch

    return torch.from_numpy(np.array(array, copy=True))[None]  # a writable copy


def columns_of(out_keys, out_values, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The columns of refkv's cache that the authors' returned rows are, per head, increasing.

    Parameters
    ----------
    out_keys, out_values : (1, Hkv, m, d) tensors
        What the authors' routine returned (rows gathered from the cache it was given).
    keys, values : (Hkv, n, d)
        The cache it was given (refkv's).

    Raises
    ------
    ValueError
        If two cache rows are identical (then a row cannot name its column) or a returned row
        is not in the cache.
    """
    out_k, out_v = out_keys.detach().numpy()[0], out_values.detach().numpy()[0]
    kept = []
    for h in range(keys.shape[0]):
        index = {keys[h, j].tobytes() + values[h, j].tobytes(): j for j in range(keys.shape[1])}
        if len(index) != keys.shape[1]:
            raise ValueError(f"head {h}: two cache rows are identical; their columns cannot be told apart")
        try:
            kept.append(sorted(index[out_k[h, i].tobytes() + out_v[h, i].tobytes()] for i in range(out_k.shape[1])))
        except KeyError:
            raise ValueError(f"head {h}: a returned row is not a row of the cache") from None
    return np.asarray(kept, dtype=np.int64)


def driven(policy, decider):
    """``policy`` with its decisions made by ``decider`` (the authors' code); its state and scores stay refkv's.

    ``decider.observe(view)`` is called at every layer step after refkv's own ``observe``;
    ``decider.decide(view)`` at every eviction returns ``(kept columns (Hkv, keep), scores
    (Hkv, n) or None)``; the decisions are appended to ``decider.log`` in eviction order.
    """
    base = type(policy)

    def observe(self, view):
        out = base.observe(self, view)
        decider.observe(view)
        return out

    def keep_indices(self, view):
        kept, scores = decider.decide(view)
        if kept.shape != (view.n_kv_heads, view.keep):
            raise ValueError(f"layer {view.layer}: the authors' code kept {kept.shape[1]} tokens per head, the "
                             f"eviction keeps {view.keep}")
        decider.log.append((kept, scores))
        return kept

    cls = type(f"Authors{base.__name__}", (base,), {"observe": observe, "keep_indices": keep_indices})
    return cls(**policy.params())


class Run:
    """The cases of one configuration: ``events`` (eviction views) and the authors' ``outputs``."""

    def __init__(self, label: str, events: list, outputs: list, error: str | None = None):
        self.label, self.events, self.outputs, self.error = label, events, outputs, error


def run_config(label: str, model_name: str, reference, decider, budget: int, block_size: int | None,
               prompt_length: int) -> Run:
    """Drive refkv's engine by ``decider`` on ``model_name`` and return its eviction cases.

    An exception of the authors' code (e.g. H2O's real-drop cache on a GQA model) ends the
    configuration: the run returns with ``error`` set to its one-line description.
    """
    model = MODELS[model_name](MODEL_SEED)
    prompt = prompt_tokens(PROMPT_SEED, prompt_length, model.config.vocab_size)
    engine = Engine(model, driven(reference, decider), budget, record="views")
    try:
        engine.prefill(prompt, block_size)
    except (IndexError, RuntimeError) as err:  # the authors' code failing on refkv's inputs
        return Run(label, [], [], error=f"{type(err).__name__}: {err}")
    events = engine.trace.evictions
    if len(events) != len(decider.log):
        raise RuntimeError(f"{label}: {len(events)} evictions but {len(decider.log)} decisions")
    for event, (kept, _) in zip(events, decider.log):
        if not np.array_equal(event.kept, kept):
            raise RuntimeError(f"{label}: the engine kept other columns than the decider returned")
    return Run(label, events, decider.log)


def run_items(run: Run, references: dict) -> list[dict]:
    """The cases of a run for :func:`write_outputs`, each judged by ``references`` (form -> Policy)."""
    return [{"comment": f"{run.label}: block {event.block}, layer {event.layer} (engine run driven by the authors' "
                        f"code)", "view": event.view, "kept": kept, "scores": scores, "references": references,
             "flags": ("engine",)}
            for event, (kept, scores) in zip(run.events, run.outputs)]


def write_outputs(out: Path, policy_name: str, items: list[dict], forms: tuple) -> int:
    """Write ``out/candidate/vectors/<policy>.json`` and ``out/<form>/vectors/<policy>.json``.

    Parameters
    ----------
    items : list of dict
        One per case: ``comment``, ``view`` (refkv's eviction view), ``kept`` and ``scores``
        (the authors' code's; scores may be None), ``references`` (form -> refkv's Policy
        judging it), ``flags`` (extra flags).
    forms : tuple of str
        The reference forms written (every item names a policy for each).

    Returns
    -------
    int
        The number of cases.
    """
    outputs, groups = {}, {form: {} for form in forms}
    for case_id, item in enumerate(items, start=1):
        for form in forms:
            policy = item["references"][form]
            case = encode_case(policy, item["view"], case_id=case_id, comment=item["comment"],
                               extra_flags=item["flags"])
            params = json_params(policy.params())
            groups[form].setdefault(repr(sorted(params.items())), (params, []))[1].append(case)
        kept, scores = item["kept"], item["scores"]
        outputs[case_id] = {"kept": kept} if scores is None else {"kept": kept, "scores": scores}
    write_json(out / "candidate" / "vectors" / f"{policy_name}.json", candidate_document(policy_name, outputs))
    for form, by_params in groups.items():
        write_json(out / form / "vectors" / f"{policy_name}.json",
                   vectors_document(policy_name, list(by_params.values())))
    return len(items)


def provenance(repo: str, commit: str, files: list[str], stubs: list[str], configurations: list[dict],
               counts: dict, errors: dict, extra: dict | None = None) -> dict:
    """The PROVENANCE.json of one policy's harness run."""
    import torch

    import refkv

    return {
        "repository": f"{repo}@{commit}",
        "files_loaded": files,
        "stubbed_imports": stubs,
        "harness": "tools/authors (refkv), run as python -m tools.authors.<policy> --repos DIR --out DIR",
        "date": datetime.date.today().isoformat(),
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "refkv_version": refkv.__version__,
        "python": platform.python_version(),
        "models": {"tiny": "refkv.model.builtin_model (GQA: 4 query heads, 2 KV heads), seed 0, float64",
                   "tiny-mha": "tiny's config with n_kv_heads = n_heads = 4 (no GQA), refkv.model.random_weights "
                               "seed 0, float64"},
        "prompt": f"numpy.random.default_rng({PROMPT_SEED}).integers(0, vocab_size, length)",
        "configurations": configurations,
        "cases_per_configuration": counts,
        "authors_code_errors": errors,
        **(extra or {}),
    }
