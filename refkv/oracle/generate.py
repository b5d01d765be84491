"""``refkv golden generate``: write a golden suite, or a folder of custom schedule goldens.

Layout of a suite directory::

    suite.json                          index: versions, policies, every file with its sha256
    vectors/<policy>.json               score-function test vectors
    e2e/<policy>/N<N>-B<B>-<dtype>.json end-to-end manifest ...
    e2e/<policy>/N<N>-B<B>-<dtype>.npz  ... and its arrays

``<policy>`` is the policy's name, or for a policy with options (``--policies
"adakv(base=keydiff,form=kvpress)"``) its tag, ``adakv+base-keydiff+form-kvpress``
(:func:`refkv.oracle.specs.spec_tag`): goldens of one policy with different options never
share a file.

What a suite holds is declared in :mod:`refkv.oracle.recipes` and built per policy by
:mod:`refkv.oracle.goldens`. Generating into a folder that holds a suite **merges**: the
named policies' files are added or replaced, the others' are left untouched. The update is
a transaction (:mod:`refkv.oracle.staging`): an interrupted run leaves the old suite or the
new one, never a mix that fails its own checksums, and nothing outside the folder is ever
touched.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ..files import OutputFolder
from ..model import load
from ..model.loading import peek_context
from ..policies.spec import make_policy
from ..validation import check_lengths
from .endtoend import end_to_end_files, write_end_to_end
from .goldens import policy_end_to_end, policy_schedules, policy_vectors, regime_end_to_end, regime_schedules
from .io import dumps, read_json, sha256
from .kinds import BY_NAME, KINDS, LISTED
from .models import MODELS, build_model, context_of
from .recipes import DECODE_SEED, E2E_MODELS, MODEL_SEED, PROMPT_SEED, library_policies
from .recorder import run_schedule_golden
from .regenerate import REGENERATION_BOUND
from .schema import SUITE_SCHEMA, header
from .specs import authors_regime, golden_specs, spec_name, spec_tag
from .staging import commit, recover, safe_path
from .suiteindex import existing_index

__all__ = ["generate_schedules", "generate_suite", "load_golden_model", "schedule_label"]


def generate_suite(out, policies: list[str] | None = None, *, progress=None) -> dict:
    """Write a golden suite into folder ``out`` (or merge into the suite there); return its index.

    Parameters
    ----------
    out : path-like
        Created if needed. If it holds a suite, the named policies' files are added or
        replaced and every other policy's files are left untouched (their checksums must
        hold).
    policies : list of str, optional
        Policy specs, options included (``"adakv(base=keydiff,form=kvpress)"``, one spec
        parser: :mod:`refkv.policies.spec`); the suite lists each by its canonical spec
        (:func:`~refkv.oracle.specs.golden_spec`). Default:
        :func:`~refkv.oracle.recipes.library_policies`, every policy refkv itself registers at
        its defaults. An empty list, an unknown name or option, or a spec given twice is a
        ValueError. An authors' form of :func:`~refkv.oracle.specs.authors_specs` gets the
        goldens of its authors' regime (:data:`~refkv.oracle.recipes.AUTHORS_REGIMES`; the
        committed suite ``tests/golden-authors``).
    progress : callable, optional
        Called with a line of text per policy.

    Notes
    -----
    **Nothing outside** ``out`` is touched: the paths an existing ``suite.json`` lists must
    be suite files inside ``out`` (``vectors/<policy>.json``, ``e2e/<policy>/<name>.json``,
    normalised, not leading out through a symlink), else a ValueError is raised before
    anything is written or deleted.

    **Atomic update.** Every file is first written into the staging folder
    ``out/.refkv-generate/`` (each written atomically), the new ``suite.json`` too; then a
    commit record is written (atomically) and the files are moved into place with
    :func:`os.replace`, ``suite.json`` last, and the old policies' stale files are deleted.
    A run killed before the commit record leaves the old suite untouched (the staging
    folder is deleted by the next run or read); killed after it, the next
    :func:`generate_suite` (or :func:`refkv.oracle.staging.recover`) finishes the move;
    :func:`refkv.oracle.suiteindex.read_suite` refuses
    the suite until then (a reader never writes). Either way a reader sees the old suite or
    the new one, never a mix that fails its checksums.
    """
    out = Path(out)
    names = _policy_names(policies)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    recover(out)
    old = existing_index(out, set(names))
    for name in names:  # every new file's folder stays inside out (a symlinked e2e/<policy> is refused now)
        for rel in dict.fromkeys(kind.path(spec_tag(name)) for kind in KINDS):
            safe_path(out, rel, f"generating {name} into {out}")

    files: dict[str, bytes] = {}
    entries, skipped = [], []
    for name in names:
        regime = authors_regime(name)  # an authors' form's goldens keep to its authors' regime
        doc, skips = policy_vectors(name, regime=regime)
        skipped += skips
        if doc is not None:
            kind = BY_NAME["vectors"]
            rel = kind.path(spec_tag(name))
            files[rel] = dumps(doc).encode("utf-8")
            entries.append({"path": rel, "kind": kind.listed_as, "policy": name, "sha256": sha256(files[rel]),
                            "cases": doc["number_of_cases"]})
        n_runs = 0
        if regime is None:
            made = [(BY_NAME["e2e"], policy_end_to_end(name, model)) for model in E2E_MODELS]
            made.append((BY_NAME["schedule"], policy_schedules(name)))
        else:
            made = [(BY_NAME["e2e"], regime_end_to_end(name, regime)),
                    (BY_NAME["schedule"], regime_schedules(name, regime))]
        for kind, (runs, skips) in made:
            skipped += skips
            n_runs += len(runs)
            for label, manifest, arrays in runs:
                rel = kind.path(spec_tag(name), label)
                manifest, text, data = end_to_end_files(label, manifest, arrays)
                files[rel], files[rel[:-len(".json")] + ".npz"] = text, data
                entries.append({"path": rel, "kind": kind.listed_as, "policy": name, "mode": manifest["mode"],
                                "dtype": manifest["dtype"], "sha256": sha256(text), "npz_sha256": sha256(data)})
        if progress is not None:
            n_cases = doc["number_of_cases"] if doc else 0
            n_skips = sum(1 for s in skipped if s["policy"] == name)
            progress(f"{name}: {n_cases} vector cases, {n_runs} end-to-end goldens, {n_skips} skipped")

    kept_entries, kept_skips, kept_policies = [], [], []
    if old is not None:
        kept_policies = [p for p in old.get("policies", []) if p not in names]
        kept_entries = [e for e in old["files"] if e["policy"] not in names]
        kept_skips = [s for s in old.get("skipped", []) if isinstance(s, dict) and s.get("policy") not in names]
    all_names = kept_policies + names
    order = {n: i for i, n in enumerate(library_policies())}
    all_names.sort(key=lambda n: (order.get(spec_name(n), len(order)), n))
    rank = {n: i for i, n in enumerate(all_names)}
    index = {
        **header(SUITE_SCHEMA),
        "description": ("refkv golden suite: score-function test vectors (vectors/) and end-to-end goldens "
                        "(e2e/), one-shot and block mode. Check a candidate with: "
                        "refkv golden check CANDIDATE_DIR --against THIS_DIR"),
        "model": {"name": "tiny", "seed": MODEL_SEED},
        "models": _models(all_names),
        "prompt_seed": PROMPT_SEED,
        "regeneration": {
            "float_bound": {kind: dict(b) for kind, b in REGENERATION_BOUND.items()},
            "rule": ("regenerating on any machine must give identical decisions (kept positions, protected "
                     "masks, flags, counts, integers, strings) and floats with |a - b| <= bound[kind][dtype] "
                     "* max(1, max |a|) per array (kind: vectors or e2e); bit-identity is expected only on the "
                     "same machine"),
        },
        "policies": all_names,
        "files": sorted(kept_entries + entries, key=lambda e: (rank[e["policy"]], LISTED.index(e["kind"]))),
        "skipped": sorted(kept_skips + skipped, key=lambda s: rank.get(s["policy"], len(rank))),
    }
    written = {e["path"] for e in entries}
    stale = sorted(e["path"] for e in (old["files"] if old else []) if e["policy"] in names
                   and e["path"] not in written)
    commit(out, files, index, stale)
    return index



def load_golden_model(name: str, dtype: str):
    """A model for goldens: a name of :data:`refkv.oracle.models.MODELS` (seeded random weights),
    ``"smollm2"`` or a checkpoint path (:func:`refkv.model.load`)."""
    if name in MODELS:
        return build_model(name, MODEL_SEED, dtype)
    return load(name, dtype=np.dtype(dtype))


def schedule_label(model: str, schedule, prompt_length: int, dtype: str) -> str:
    """The file name (without ``.json``) of a schedule golden of ``generate_schedules``.

    Every setting that tells two such goldens apart is in it: the model, the prompt's length
    ``T``, the prefill (``oneshot`` or blocks ``B<B>``, and ``P<N0>`` when it is compressed),
    then the decoding rounds -- interval ``K``, budget ``N`` or ``ratio<R>``, ``D`` new
    tokens -- or ``prefill-only`` for a golden without decoding::

        tiny-sched-T24-oneshot-K16-N8-D48-float64
        tiny-sched-T4096-oneshot-P3072-prefill-only-float32
    """
    tag = re.sub(r"[^A-Za-z0-9_.+-]", "_", Path(model).name if model not in MODELS else model)
    prefill = "oneshot" if schedule.block_size is None else f"B{schedule.block_size}"
    if schedule.prefill_budget is not None:
        prefill += f"-P{schedule.prefill_budget}"
    if schedule.new_tokens == 0:
        rounds = "prefill-only"
    else:
        rule = f"N{schedule.budget}" if schedule.rule == "interval" else f"ratio{schedule.ratio:g}"
        rounds = f"K{schedule.interval}-{rule}-D{schedule.new_tokens}"
    return f"{tag}-sched-T{prompt_length}-{prefill}-{rounds}-{dtype}"


def generate_schedules(out, policies: list[str] | None, schedule, *, model: str = "tiny", prompt_length: int = 128,
                       dtype: str | None = None, progress=None) -> dict:
    """Schedule goldens of ``policies`` (default: every library policy) for one model and schedule.

    Written as ``out/e2e/<policy>/<label>.json`` (+ ``.npz``) in a folder of golden files
    without ``suite.json`` (``refkv golden check`` finds them by their schema); ``<policy>``
    is the policy's name or, with options, its tag (:func:`~refkv.oracle.specs.spec_tag`),
    ``<label>`` :func:`schedule_label` (model, prompt length, prefill, rounds, new tokens,
    dtype), so goldens of other settings never replace each other.
    A real checkpoint defaults to float32 (the reduced set: one precision, one schedule).
    A policy that refuses the schedule is skipped and listed. Returns ``{"written", "skipped"}``.
    """
    out = Path(out)
    if (out / "suite.json").exists():
        raise ValueError(f"--out {out} holds a golden suite (suite.json); write custom goldens to another folder")
    names = _policy_names(policies)
    lengths = {"--prompt-length": (prompt_length, 1), "--new-tokens": (schedule.new_tokens, 0),
               "--interval": (schedule.interval, 1), "--prefill": (schedule.block_size, 1)}
    within = ("--prompt-length", "--new-tokens")
    # Every length against the hard cap and the model's context before the model is read
    # (a tiny model's config is known; a checkpoint's from its config.json alone) ...
    context = context_of(model) if model in MODELS else peek_context(model)
    check_lengths(lengths, context, model=str(model), within=within)
    dtype = dtype or ("float64" if model in MODELS else "float32")
    built = load_golden_model(model, dtype)
    # ... and against the context of the model read (a GGUF file's is in its header only)
    check_lengths(lengths, built.config.max_positions, model=str(model), within=within)
    label = schedule_label(model, schedule, prompt_length, dtype)
    folder = OutputFolder(out, what="--out", inputs=[] if model in MODELS else [model])
    mine = {"model": model, "model_seed": MODEL_SEED, "dtype": dtype, "prompt_length": prompt_length,
            "prompt_seed": PROMPT_SEED, "new_tokens": schedule.new_tokens, "decode_seed": DECODE_SEED,
            "schedule": json.loads(json.dumps(schedule.to_dict()))}
    for name in names:  # every target checked before any model runs or any file is written
        rel = f"e2e/{spec_tag(name)}/{label}.json"
        folder.check_replaceable(rel[:-len(".json")] + ".npz")  # no symlink below --out, the npz included
        folder.refuse_other_settings(rel, mine, _schedule_settings(folder.path(rel)), what="schedule golden")
    written, skipped = [], []
    for name in names:
        try:
            manifest, arrays = run_schedule_golden(make_policy(name), schedule, dtype=dtype,
                                                   prompt_length=prompt_length, model_seed=MODEL_SEED,
                                                   prompt_seed=PROMPT_SEED, decode_seed=DECODE_SEED, model=model,
                                                   built=None if model in MODELS else built)
        except ValueError as err:
            skipped.append({"policy": name, "reason": str(err)})
            if progress is not None:
                progress(f"{name}: skipped: {err}")
            continue
        rel = f"e2e/{spec_tag(name)}/{label}.json"
        path = folder.path(rel)
        write_end_to_end(folder / rel, manifest, arrays)
        written.append(str(path))
        if progress is not None:
            progress(f"{name}: {path} ({manifest['n_rounds']} rounds)")
    return {"written": written, "skipped": skipped}



def _schedule_settings(path: Path) -> dict | None:
    """The settings the schedule golden at ``path`` was made with (None: no file there).

    What distinguishes two schedule goldens of one policy (model, seeds, precision, prompt
    length, number of new tokens, schedule), read from its manifest so that a second
    generation with other settings is refused instead of silently replacing it.
    """
    if not path.exists():
        return None
    try:
        m = read_json(path)
        return {"model": m["model"]["builder"], "model_seed": m["model"]["seed"], "dtype": m["dtype"],
                "prompt_length": m["prompt"]["length"], "prompt_seed": m["prompt"]["seed"],
                "new_tokens": m["decode"]["length"], "decode_seed": m["decode"]["seed"], "schedule": m["schedule"]}
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: a file is there that is not a readable schedule golden ({err}); refusing to "
                         f"replace it -- use another folder or remove it") from None


def _models(specs: list[str]) -> list[str]:
    """The models a suite of ``specs`` runs: :data:`~refkv.oracle.recipes.E2E_MODELS` for the usual
    goldens, each authors' form's regime model for its own."""
    regimes = [authors_regime(spec) for spec in specs]
    usual = list(E2E_MODELS) if any(r is None for r in regimes) else []
    return list(dict.fromkeys(usual + [r.model for r in regimes if r is not None]))


def _policy_names(policies) -> list[str]:
    """Canonical specs of ``policies`` (:func:`~refkv.oracle.specs.golden_specs`); None: every library policy."""
    if policies is None:
        return library_policies()
    return golden_specs(policies)
