"""One policy's goldens, built from the recipes of :mod:`refkv.oracle.recipes`.

Cases a policy refuses -- a budget its protected set does not fit, a block larger than
the budget of a policy that evicts before attention (so HashEvict and MAT have no one-shot
cases) -- are skipped through the policy's own ValueError and returned as skips, which the
suite lists in ``suite.json`` under ``skipped``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import policies as policy_registry
from ..engine import Engine
from ..policies import Policy
from ..policies.spec import make_policy, parse_spec
from .encode import encode_case, vectors_document
from .io import dumps
from .models import build_model, prompt_tokens
from .recipes import (
    BLOCK_RECIPES,
    BUDGETS,
    DECODE_SEED,
    E2E_FALLBACK,
    E2E_SETTINGS,
    E2E_UNBOUNDED,
    E2E_UNBOUNDED_ONESHOT,
    ENGINE_CASES,
    FULL_E2E_MODEL,
    MAX_VECTOR_BYTES,
    MIN_CASES,
    MODEL_SEED,
    NO_ONESHOT,
    ONESHOT_RECIPES,
    ONESHOT_SETTINGS,
    PROMPT_SEED,
    RECIPES,
    REDUCED_DEFAULTS,
    SCHEDULE_SETTINGS,
    VARIANTS,
    FormRegime,
    Recipe,
    Setting,
)
from .recorder import run_end_to_end, run_schedule_golden
from .synthetic import (
    Tokens,
    config_for,
    duplicate_key,
    huge_logits,
    near_duplicate_key,
    random_tokens,
    replay,
    zero_key,
)
from .tolerance import DEFAULT_TOLERANCE
from .vectors import json_params

__all__ = ["policy_end_to_end", "policy_schedules", "policy_vectors", "regime_end_to_end", "regime_jobs",
           "regime_schedules"]

#: Attempts (new positions) at planting an edit until its flag is detected.
_ATTEMPTS = 16


# -- vectors ---------------------------------------------------------------------------------
def _smallest_budget(policy: Policy, recipe: Recipe) -> int | None:
    cfg = config_for(recipe.n_heads, recipe.n_kv_heads, recipe.d_head, recipe.n_layers)
    for n in BUDGETS:
        try:
            policy.check(n, cfg)
        except ValueError:
            continue
        return n
    return None


def _edit(tokens: Tokens, edit: str, rng: np.random.Generator, recipe: Recipe) -> Tokens:
    t = tokens.n_tokens
    head = int(rng.integers(tokens.keys.shape[0]))
    if edit == "huge-logits":
        return huge_logits(tokens, 8.0)
    if edit == "zero-norm-key":
        return zero_key(tokens, head, int(rng.integers(1, t)))
    a, b = sorted(int(x) for x in rng.choice(np.arange(1, t), size=2, replace=False))
    if edit == "duplicate-keys":
        return duplicate_key(tokens, head, a, b)
    # A gap of a few tolerances: close enough to matter, far enough to be decided.
    delta = 2.0 ** np.round(np.log2(30 * DEFAULT_TOLERANCE[recipe.dtype]))
    return near_duplicate_key(tokens, head, a, b, float(delta))


def _synthetic_case(policy: Policy, recipe: Recipe, budget: int, rng: np.random.Generator, case_id: int):
    """A case from ``recipe`` at the smallest budget from ``budget`` on that the policy accepts.

    A policy may refuse a budget only at eviction time (a block that leaves too few places
    for its protected tokens); the next larger budget of :data:`~refkv.oracle.recipes.BUDGETS` is then tried.
    """
    error = None
    for b in (n for n in BUDGETS if n >= budget):
        try:
            return _synthetic_case_at(policy, recipe, b, np.random.default_rng(rng.integers(2**63)), case_id)
        except ValueError as err:
            error = err
    raise error


def _synthetic_case_at(policy: Policy, recipe: Recipe, budget: int, rng: np.random.Generator, case_id: int):
    n_tokens = recipe.n_tokens(budget)
    base = random_tokens(rng, recipe.n_heads, recipe.n_kv_heads, recipe.d_head, n_tokens, recipe.dtype)
    attempts = _ATTEMPTS if recipe.edit else 1
    comment = f"{recipe.comment} ({recipe.describe(budget, n_tokens)})"
    case = None
    for _ in range(attempts):
        tokens = _edit(base, recipe.edit, rng, recipe) if recipe.edit else base
        view = replay(policy, tokens, block_size=recipe.block, budget=budget, layer=recipe.layer,
                      n_layers=recipe.n_layers)
        case = encode_case(policy, view, case_id=case_id, comment=comment, mode=recipe.mode)
        if not recipe.edit or recipe.edit in case["flags"]:  # each edit is named after its flag
            break
    return case


def _engine_case(policy: Policy, budget: int, dtype: str, layer: int, block: int | None, case_id: int,
                 model_name: str = "tiny"):
    """The last eviction of ``layer`` in a short run of model ``model_name`` (the built-in one; from its Trace)."""
    model = build_model(model_name, MODEL_SEED, dtype)
    length = budget + 3 * block if block is not None else budget + 6
    prompt = prompt_tokens(PROMPT_SEED, length, model.config.vocab_size)
    engine = Engine(model, policy, budget, record="views")
    engine.prefill(prompt, block)
    views = [e.view for e in engine.trace.evictions if e.layer == layer]
    if not views:
        raise ValueError(f"layer {layer} never evicted")
    b = "the whole prompt (one-shot)" if block is None else block
    which = "built-in model" if model_name == "tiny" else f"model {model_name}"
    comment = (f"{which} (seed {MODEL_SEED}), prompt of {len(prompt)} tokens (seed {PROMPT_SEED}), "
               f"N={budget}, B={b}: last eviction of layer {layer}")
    return encode_case(policy, views[-1], case_id=case_id, comment=comment, extra_flags=("engine",),
                       mode="block" if block is not None else "oneshot")


def policy_vectors(spec: str, *, seed: int = 0, regime: FormRegime | None = None) -> tuple[dict | None, list[dict]]:
    """The vectors document of policy ``spec`` and the list of skipped cases.

    A bare name gets its defaults and its variants (:data:`~refkv.oracle.recipes.VARIANTS`); a
    spec with options (``adakv:base=keydiff,form=kvpress``) those options alone. ``regime``
    (an authors' form's, :func:`~refkv.oracle.specs.authors_regime`): its recipes
    (:func:`regime_jobs`) instead of the suite's.
    """
    name, options = parse_spec(spec)
    skipped: list[dict] = []
    groups = []
    param_sets = [options] if options else [{}] + [dict(v) for v in VARIANTS.get(name, [])]
    case_id = 0
    for set_index, params in enumerate(param_sets):
        try:
            policy = policy_registry.get(name, **params)
        except (ValueError, TypeError) as err:
            skipped.append({"policy": spec, "what": f"vectors with params {json_params(params)}", "reason": str(err)})
            continue
        rng = np.random.default_rng([seed, set_index])
        if regime is None:
            budget = _smallest_budget(policy, RECIPES[0])
            every = set_index == 0 and name not in REDUCED_DEFAULTS
            jobs = [("recipe", r) for r in BLOCK_RECIPES if every or r.variants]
            if set_index == 0:
                jobs[3:3] = [("engine", e) for e in ENGINE_CASES]
            if set_index > 0 or name not in REDUCED_DEFAULTS:
                jobs += [("recipe", r) for r in ONESHOT_RECIPES if every or r.variants]
        else:
            jobs = regime_jobs(regime)
            budget = _smallest_budget(policy, next(job for kind, job in jobs if kind == "recipe"))
        cases = []
        size = {"block": 0, "oneshot": 0}
        count = {"block": 0, "oneshot": 0}
        for kind, job in jobs:
            mode = job.mode if kind == "recipe" else ("block" if job[2] is not None else "oneshot")
            if kind == "recipe":
                what = f"vectors {json_params(params)}: {job.mode}: {job.comment}"
                b = _smallest_budget(policy, job)
                if job.largest_block:
                    cfg = config_for(job.n_heads, job.n_kv_heads, job.d_head, job.n_layers)
                    largest = None if b is None else policy.max_block(b, cfg)
                    if largest is None:
                        continue  # any block size runs: nothing particular to the largest one
                    job = replace(job, block=largest)
            else:
                what = f"vectors {json_params(params)}: engine capture, {job[0]}, layer {job[1]}, B={job[2]}"
                b = budget
            if mode == "oneshot" and policy.evict_before_attention:
                if not any(s["what"] == f"vectors {json_params(params)}: oneshot" for s in skipped):
                    skipped.append({"policy": spec, "what": f"vectors {json_params(params)}: oneshot",
                                    "reason": NO_ONESHOT})
                continue
            if count[mode] >= MIN_CASES[mode] and size[mode] > MAX_VECTOR_BYTES[mode]:
                skipped.append({"policy": spec, "what": what, "reason": f"the {mode} cases reached their size "
                                f"budget of {MAX_VECTOR_BYTES[mode]} bytes"})
                continue
            try:
                if b is None:
                    raise ValueError(f"no budget in {list(BUDGETS)} accepted")
                if kind == "recipe":
                    case = _synthetic_case(policy, job, b, rng, case_id + 1)
                else:
                    case = _engine_case(policy, b, job[0], job[1], job[2], case_id + 1,
                                        "tiny" if regime is None else regime.model)
            except ValueError as err:
                skipped.append({"policy": spec, "what": what, "reason": str(err)})
                continue
            cases.append(case)
            case_id += 1
            count[mode] += 1
            size[mode] += len(dumps(case))
        if cases:
            groups.append((json_params(policy.params()), cases))
    if not groups:
        return None, skipped
    return vectors_document(name, groups), skipped


# -- end to end -----------------------------------------------------------------------------------
def policy_end_to_end(spec: str, model: str = "tiny") -> tuple[list[tuple[str, dict, dict]], list[dict]]:
    """``[(label, manifest, arrays)]`` of policy ``spec`` (a name: default parameters) and the skips.

    Block mode: every setting of :data:`~refkv.oracle.recipes.E2E_SETTINGS` the policy accepts, in float64, the
    first of them in float32 too. One-shot: the first of :data:`~refkv.oracle.recipes.ONESHOT_SETTINGS` the policy
    accepts, in float64 and float32 (none for policies that evict before attention). For a
    model other than :data:`~refkv.oracle.recipes.FULL_E2E_MODEL`, only the first block and the first one-shot
    setting it accepts, in float32.
    """
    out, skipped = [], []
    name = parse_spec(spec)[0]

    def attempt(setting: Setting, dtype: str) -> bool:
        what = f"e2e {setting.label(dtype, model)}"
        try:
            manifest, arrays = run_end_to_end(make_policy(spec), budget=setting.budget,
                                              block_size=setting.block_size, dtype=dtype,
                                              prompt_length=setting.prompt_length, model_seed=MODEL_SEED,
                                              prompt_seed=PROMPT_SEED, model=model)
        except ValueError as err:
            skipped.append({"policy": spec, "what": what, "reason": str(err)})
            return False
        out.append((setting.label(dtype, model), manifest, arrays))
        return True

    if model != FULL_E2E_MODEL:
        block = next((s for s in (*E2E_SETTINGS, E2E_FALLBACK, E2E_UNBOUNDED) if attempt(s, "float32")), None)
        if policy_registry.policy_class(name).evict_before_attention:
            skipped.append({"policy": spec, "what": f"e2e one-shot ({model})", "reason": NO_ONESHOT})
        elif not next((s for s in ONESHOT_SETTINGS if attempt(s, "float32")), None) and block == E2E_UNBOUNDED:
            attempt(E2E_UNBOUNDED_ONESHOT, "float32")
        return out, skipped
    ran = [s for s in E2E_SETTINGS if attempt(s, "float64")]
    if len(ran) < 2 and attempt(E2E_FALLBACK, "float64"):
        ran.append(E2E_FALLBACK)
    if not ran and attempt(E2E_UNBOUNDED, "float64"):
        ran.append(E2E_UNBOUNDED)
    if ran:
        attempt(ran[0], "float32")
    if policy_registry.policy_class(name).evict_before_attention:
        skipped.append({"policy": spec, "what": f"e2e one-shot ({model})", "reason": NO_ONESHOT})
        return out, skipped
    oneshot = next((s for s in ONESHOT_SETTINGS if attempt(s, "float64")), None)
    if oneshot is None and ran == [E2E_UNBOUNDED] and attempt(E2E_UNBOUNDED_ONESHOT, "float64"):
        oneshot = E2E_UNBOUNDED_ONESHOT
    if oneshot is not None:
        attempt(oneshot, "float32")
    return out, skipped



def policy_schedules(spec: str) -> tuple[list[tuple[str, dict, dict]], list[dict]]:
    """``[(label, manifest, arrays)]`` of policy ``spec``'s schedule goldens (tiny model) and the skips."""
    out, skipped = [], []
    policy = make_policy(spec)
    cfg = build_model("tiny", MODEL_SEED, "float64").config
    for settings in SCHEDULE_SETTINGS:
        try:
            for setting in settings:
                if setting.schedule.budget is not None:
                    policy.check(setting.schedule.budget, cfg)
        except ValueError as err:
            reason = str(err)
            continue
        break
    else:
        skipped.append({"policy": spec, "what": "schedule goldens", "reason": reason})
        return out, skipped
    ran_oneshot_budget = False
    for i, setting in enumerate(settings):
        if i == len(settings) - 1 and ran_oneshot_budget:
            break
        for dtype in setting.dtypes:
            label = f"{setting.label}-{dtype}"
            try:
                manifest, arrays = run_schedule_golden(make_policy(spec), setting.schedule, dtype=dtype,
                                                       prompt_length=setting.prompt_length, model_seed=MODEL_SEED,
                                                       prompt_seed=PROMPT_SEED, decode_seed=DECODE_SEED)
            except ValueError as err:
                skipped.append({"policy": spec, "what": f"e2e {label}", "reason": str(err)})
                break
            out.append((label, manifest, arrays))
            ran_oneshot_budget |= i == 2
    return out, skipped


# -- the authors' forms, in their regimes --------------------------------------------------------------
def regime_jobs(regime: FormRegime) -> list[tuple[str, object]]:
    """The vector jobs of an authors' form: ``("recipe", Recipe)`` of the regime's modes and block
    sizes, with one query head per KV head where the regime says so, then its engine captures."""
    jobs = []
    for recipe in BLOCK_RECIPES + ONESHOT_RECIPES:
        if recipe.mode not in regime.modes or recipe.largest_block:
            continue  # the largest block a form takes is one of its modes' (B = 1 for HashEvict's)
        if recipe.mode == "block" and regime.blocks is not None and recipe.block not in regime.blocks:
            continue
        if regime.mha and recipe.n_kv_heads != recipe.n_heads:
            recipe = replace(recipe, n_kv_heads=recipe.n_heads, comment=recipe.comment.replace(
                "GQA", f"{recipe.n_heads} KV heads for {recipe.n_heads} query heads (no GQA)"))
        jobs.append(("recipe", recipe))
    return jobs + [("engine", e) for e in regime.engine]


def regime_end_to_end(spec: str, regime: FormRegime) -> tuple[list[tuple[str, dict, dict]], list[dict]]:
    """``[(label, manifest, arrays)]`` of the authors' form ``spec``'s end-to-end goldens on its
    regime's model (each setting in float64 and float32) and the skips."""
    out, skipped = [], []
    for setting in regime.e2e:
        for dtype in ("float64", "float32"):
            label = setting.label(dtype, regime.model)
            try:
                manifest, arrays = run_end_to_end(make_policy(spec), budget=setting.budget,
                                                  block_size=setting.block_size, dtype=dtype,
                                                  prompt_length=setting.prompt_length, model_seed=MODEL_SEED,
                                                  prompt_seed=PROMPT_SEED, model=regime.model)
            except ValueError as err:
                skipped.append({"policy": spec, "what": f"e2e {label}", "reason": str(err)})
                continue
            out.append((label, manifest, arrays))
    return out, skipped


def regime_schedules(spec: str, regime: FormRegime) -> tuple[list[tuple[str, dict, dict]], list[dict]]:
    """``[(label, manifest, arrays)]`` of the authors' form ``spec``'s schedule goldens on its
    regime's model and the skips."""
    out, skipped = [], []
    prefix = "" if regime.model == "tiny" else f"{regime.model}-"
    for setting in regime.schedules:
        for dtype in setting.dtypes:
            label = f"{prefix}{setting.label}-{dtype}"
            try:
                manifest, arrays = run_schedule_golden(make_policy(spec), setting.schedule, dtype=dtype,
                                                       prompt_length=setting.prompt_length, model_seed=MODEL_SEED,
                                                       prompt_seed=PROMPT_SEED, decode_seed=DECODE_SEED,
                                                       model=regime.model)
            except ValueError as err:
                skipped.append({"policy": spec, "what": f"e2e {label}", "reason": str(err)})
                continue
            out.append((label, manifest, arrays))
    return out, skipped
