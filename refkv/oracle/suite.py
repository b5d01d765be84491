"""The golden suite: what ``refkv golden generate`` writes, and how it is read back.

Layout of a suite directory::

    suite.json                          index: versions, policies, every file with its sha256
    vectors/<policy>.json               score-function test vectors
    e2e/<policy>/N<N>-B<B>-<dtype>.json end-to-end manifest ...
    e2e/<policy>/N<N>-B<B>-<dtype>.npz  ... and its arrays

Every policy refkv registers is included (:func:`library_policies`: the registry's
policies whose class lives in the ``refkv`` package, so a test module or a plugin that
registers its own does not change the suite), and a new policy is picked up by the next
``refkv golden generate``. Cases a policy refuses -- a budget its protected set does not
fit, a block larger than the budget of a policy that evicts before attention (so
HashEvict and MAT have no one-shot cases) -- are skipped through the policy's own
ValueError and listed in ``suite.json`` under ``skipped``; nothing here names a policy:
:data:`VARIANTS`, the extra parameter sets that widen the coverage of policies with
options, are the policy classes' ``card.variants``.

Two regimes are covered (a case's ``mode``): **one-shot** (the whole prompt is one block:
full square causal attention over all ``T`` tokens, then one eviction to ``N``; what
kvpress and most GPU backends do at prefill) and **block** prompt processing (blocks of
``B`` tokens, the last block full, ``B = 1`` being token generation).

Generating into a folder that holds a suite **merges**: the named policies' files are
added or replaced, the others' are left untouched. The update is a transaction (see
:func:`generate_suite`): an interrupted run leaves the old suite or the new one, never a
mix that fails its own checksums, and nothing outside the folder is ever touched.
"""

from __future__ import annotations

import math
import os
import posixpath
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .. import policies as policy_registry
from ..engine import Engine
from ..files import atomic_write
from ..policies import Policy
from .encode import encode_case, vectors_document
from .endtoend import end_to_end_files
from .io import dumps, read_json, read_npz, sha256
from .models import build_model, prompt_tokens
from .recorder import run_end_to_end
from .schema import SUITE_SCHEMA, check_header, header, require
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

__all__ = ["BUDGETS", "E2E_MODELS", "E2E_SETTINGS", "ONESHOT_SETTINGS", "RECIPES", "REGENERATION_BOUND",
           "SCHEDULE_SETTINGS", "VARIANTS", "Recipe", "ScheduleSetting", "Setting", "generate_schedules",
           "generate_suite", "library_policies", "policy_schedules", "read_suite", "regeneration_differences"]

#: Budgets tried for vector cases, smallest first: a policy's cases use the smallest its
#: ``check`` accepts (small budgets make small files).
BUDGETS = (6, 8, 12, 16, 24, 40)

#: Extra parameter sets per policy (beyond the defaults), with a reduced set of recipes: each
#: policy class's ``card.variants``.
#: A set a policy rejects (ValueError/TypeError) is skipped and listed.
VARIANTS: dict[str, list[dict]] = {
    name: [dict(v) for v in policy_registry.policy_class(name).card.variants]
    for name in policy_registry.available() if policy_registry.policy_class(name).card.variants}


#: Meta-policies whose defaults run over SnapKV's default window of 32 (so their cases need
#: ``N = 40`` and repeat the size of SnapKV's own): their default parameter set takes only the
#: block recipes marked ``variants`` and the engine captures (a one-shot case of ``T = 46``
#: is 117 kB of attention weights), so the suite stays small; their variants over small
#: windows carry the one-shot cases and the default's one-shot run is an end-to-end golden.
REDUCED_DEFAULTS = ("adakv", "pyramidkv")


@dataclass(frozen=True)
class Recipe:
    """How to build one synthetic vector case.

    ``block=None`` is **one-shot**: ``T = N + extra`` tokens (or ``tokens`` if given) in one
    block. Otherwise **block** mode: ``T`` is the smallest multiple of ``block`` that
    reaches ``N``, plus ``1 + extra`` more blocks, so every block is full and earlier
    blocks evict too; ``no_eviction`` uses the largest multiple of ``block`` within ``N``.
    ``edit`` plants an adversarial feature. The case's comment states the ``T``, ``B`` and
    ``N`` it ran with.
    """

    comment: str
    dtype: str = "float64"
    n_heads: int = 4
    n_kv_heads: int = 2
    d_head: int = 4
    block: int | None = 3
    extra: int = 1
    tokens: int | None = None
    layer: int = 3
    edit: str | None = None
    no_eviction: bool = False
    variants: bool = False  # also used for the variant parameter sets
    n_layers: int = 4
    largest_block: bool = False  # B = policy.max_block(N): only for policies that evict before attention

    @property
    def mode(self) -> str:
        return "oneshot" if self.block is None else "block"

    def n_tokens(self, budget: int) -> int:
        """``T`` for budget ``N`` (see the class docstring)."""
        if self.block is None:
            return self.tokens if self.tokens is not None else budget + self.extra
        if self.no_eviction:
            return max(self.block, budget // self.block * self.block)
        return -(-budget // self.block) * self.block + self.block * (1 + self.extra)

    def describe(self, budget: int, n_tokens: int) -> str:
        """What ran, in words: ``"one-shot: T=12 in one block, N=6"``."""
        if self.block is None:
            return f"one-shot: T={n_tokens} in one block, N={budget}"
        return f"T={n_tokens} in {n_tokens // self.block} blocks of {self.block}, N={budget}"


#: Block-mode recipes, in priority order (see :data:`MAX_VECTOR_BYTES`).
BLOCK_RECIPES = (
    Recipe("random keys, GQA, deepest layer", variants=True),
    Recipe("random keys, GQA, float32, layer 2", dtype="float32", layer=2, variants=True),
    Recipe("generation step: blocks of one token", block=1, extra=4, variants=True),
    Recipe("the largest block the policy accepts, B = max_block(N): nearest to one-shot for a policy that "
           "evicts before attention", largest_block=True, extra=0, variants=True),
    Recipe("near-duplicate key planted (near tie)", edit="near-tie"),
    Recipe("zero key planted", edit="zero-norm-key", layer=1),
    Recipe("duplicate key and value planted (exact tie for key-based scores)", edit="duplicate-keys"),
    Recipe("queries and keys scaled by 8 (saturated softmax)", edit="huge-logits", layer=2),
    Recipe("random keys, one query head per KV head, layer 0", n_heads=2, block=2, layer=0),
    Recipe("fewer tokens than the budget", no_eviction=True),
    Recipe("near-duplicate key planted (near tie), float32", dtype="float32", edit="near-tie", layer=2),
    Recipe("generation step, float32", dtype="float32", block=1, extra=2, layer=1),
)
#: One-shot recipes (kvpress's regime), in priority order; the adversarial ones in float32
#: and float64.
ONESHOT_RECIPES = (
    Recipe("random keys, GQA, deepest layer", block=None, extra=6, variants=True),
    Recipe("random keys, GQA, float32, layer 2", block=None, extra=6, dtype="float32", layer=2, variants=True),
    Recipe("near-duplicate key planted (near tie), float32", block=None, extra=6, dtype="float32",
           edit="near-tie", variants=True),
    Recipe("zero key planted, float32", block=None, extra=6, dtype="float32", edit="zero-norm-key", layer=1),
    Recipe("duplicate key and value planted, float32", block=None, extra=6, dtype="float32",
           edit="duplicate-keys"),
    Recipe("queries and keys scaled by 8 (saturated softmax), float32", block=None, extra=6, dtype="float32",
           edit="huge-logits", layer=2),
    Recipe("one query head per KV head, float32, layer 0", block=None, extra=6, dtype="float32", n_heads=2,
           layer=0),
    Recipe("a single-token prompt, float32", block=None, tokens=1, dtype="float32"),
    Recipe("near-duplicate key planted (near tie)", block=None, extra=6, edit="near-tie"),
    Recipe("zero key planted", block=None, extra=6, edit="zero-norm-key", layer=1),
    Recipe("duplicate key and value planted", block=None, extra=6, edit="duplicate-keys"),
    Recipe("queries and keys scaled by 8 (saturated softmax)", block=None, extra=6, edit="huge-logits", layer=2),
    Recipe("one query head per KV head, layer 0", block=None, extra=6, n_heads=2, layer=0),
)
RECIPES = BLOCK_RECIPES + ONESHOT_RECIPES

#: Engine captures of the default parameters, block mode: (dtype, layer, B), inserted after
#: the third block recipe.
ENGINE_CASES = (("float64", 3, 2), ("float32", 1, 2))
#: A vectors file stops taking cases of one parameter set and mode once they exceed this many
#: bytes of JSON (the first :data:`MIN_CASES` always go in). Per-token state can be large
#: (Scissorhands keeps a 400-step history per token), and so can one-shot attention weights
#: (SnapKV's default window needs ``T > 32``); the skipped cases are listed in ``suite.json``.
MAX_VECTOR_BYTES = {"block": 100_000, "oneshot": 120_000}
MIN_CASES = {"block": 4, "oneshot": 2}

#: Attempts (new positions) at planting an edit until its flag is detected.
_ATTEMPTS = 16


@dataclass(frozen=True)
class Setting:
    """One end-to-end run: budget ``N``, block size ``B`` (None: one-shot), prompt length."""

    budget: int | None
    block_size: int | None
    prompt_length: int

    def label(self, dtype: str, model: str = "tiny") -> str:
        b = "all" if self.block_size is None else self.block_size
        prefix = "" if model == "tiny" else f"{model}-"
        return f"{prefix}N{self.budget if self.budget is not None else 'none'}-B{b}-{dtype}"


#: Block-mode end-to-end settings, tried for every policy (float64).
E2E_SETTINGS = (Setting(8, 4, 40), Setting(16, 1, 28), Setting(24, 8, 40))
#: Tried when fewer than two of :data:`E2E_SETTINGS` run (policies with large protected sets).
E2E_FALLBACK = Setting(40, 8, 64)
#: One-shot settings (B = the whole prompt), in float64 and float32: the first one the policy
#: accepts. SnapKV's default window of 32 needs ``N > 32``, hence the second.
ONESHOT_SETTINGS = (Setting(16, None, 40), Setting(40, None, 64))
#: Tried when no budgeted setting runs (``full``): the no-eviction baseline.
E2E_UNBOUNDED = Setting(None, 8, 40)
E2E_UNBOUNDED_ONESHOT = Setting(None, None, 40)

#: The models end-to-end goldens run (names of :data:`refkv.oracle.models.MODELS`): a tiny
#: model of another architecture is added to the suite with one entry here.
E2E_MODELS = ("tiny", "llama3", "qwen2", "qwen3")
#: Models other than the built-in one get the smaller set a backend of that architecture
#: needs: the first block setting and the first one-shot setting the policy accepts, in
#: float32 (the precision low-precision kernels are checked against), so the suite grows
#: by a few files per policy instead of repeating every setting.
FULL_E2E_MODEL = "tiny"

MODEL_SEED = 0
PROMPT_SEED = 1
#: Seed of the tokens fed while decoding in schedule goldens.
DECODE_SEED = 2

#: Why policies that evict before attention (HashEvict, MAT) have no one-shot cases.
NO_ONESHOT = ("no one-shot form: the policy evicts before attention (HashEvict Algorithm 1, MAT Eq. 4: the "
              "token attends over the already-evicted cache), so a block attends to at most N tokens and a "
              "block of the whole prompt (T > N) contradicts its definition; its largest block is "
              "policy.max_block(N), which a block-mode case of each parameter set uses")

#: How far floats may move when the suite is regenerated on another machine (another CPU or
#: BLAS rounds differently): ``|a - b| <= bound * max(1, max |a|)`` per array (per value for
#: JSON numbers), by kind of file and dtype. Decisions (kept positions, protected masks,
#: flags, counts, integers, strings) must be identical. Each bound is at least 5x below the
#: check tolerance of its files (vectors: rtol 1e-10 / 1e-5; end to end, where a whole model
#: runs: 1e-8 / 1e-4).
REGENERATION_BOUND = {"vectors": {"float64": 1e-12, "float32": 2e-6},
                      "e2e": {"float64": 1e-10, "float32": 1e-5}}


def library_policies() -> list[str]:
    """Registered policies defined by refkv itself (the default contents of a suite)."""
    return [name for name in policy_registry.available()
            if policy_registry.policy_class(name).__module__.startswith("refkv.")]


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
    for its protected tokens); the next larger budget of :data:`BUDGETS` is then tried.
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


def _engine_case(policy: Policy, budget: int, dtype: str, layer: int, block: int | None, case_id: int):
    """The last eviction of ``layer`` in a short run of the built-in model (from its Trace)."""
    model = build_model("tiny", MODEL_SEED, dtype)
    length = budget + 3 * block if block is not None else budget + 6
    prompt = prompt_tokens(PROMPT_SEED, length, model.config.vocab_size)
    engine = Engine(model, policy, budget, record="views")
    engine.prefill(prompt, block)
    views = [e.view for e in engine.trace.evictions if e.layer == layer]
    if not views:
        raise ValueError(f"layer {layer} never evicted")
    b = "the whole prompt (one-shot)" if block is None else block
    comment = (f"built-in model (seed {MODEL_SEED}), prompt of {len(prompt)} tokens (seed {PROMPT_SEED}), "
               f"N={budget}, B={b}: last eviction of layer {layer}")
    return encode_case(policy, views[-1], case_id=case_id, comment=comment, extra_flags=("engine",),
                       mode="block" if block is not None else "oneshot")


def policy_vectors(name: str, *, seed: int = 0) -> tuple[dict | None, list[dict]]:
    """The vectors document of policy ``name`` and the list of skipped cases."""
    skipped: list[dict] = []
    groups = []
    param_sets = [{}] + [dict(v) for v in VARIANTS.get(name, [])]
    case_id = 0
    for set_index, params in enumerate(param_sets):
        try:
            policy = policy_registry.get(name, **params)
        except (ValueError, TypeError) as err:
            skipped.append({"policy": name, "what": f"vectors with params {json_params(params)}", "reason": str(err)})
            continue
        rng = np.random.default_rng([seed, set_index])
        budget = _smallest_budget(policy, RECIPES[0])
        every = set_index == 0 and name not in REDUCED_DEFAULTS
        jobs = [("recipe", r) for r in BLOCK_RECIPES if every or r.variants]
        if set_index == 0:
            jobs[3:3] = [("engine", e) for e in ENGINE_CASES]
        if set_index > 0 or name not in REDUCED_DEFAULTS:
            jobs += [("recipe", r) for r in ONESHOT_RECIPES if every or r.variants]
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
                    skipped.append({"policy": name, "what": f"vectors {json_params(params)}: oneshot",
                                    "reason": NO_ONESHOT})
                continue
            if count[mode] >= MIN_CASES[mode] and size[mode] > MAX_VECTOR_BYTES[mode]:
                skipped.append({"policy": name, "what": what, "reason": f"the {mode} cases reached their size "
                                f"budget of {MAX_VECTOR_BYTES[mode]} bytes"})
                continue
            try:
                if b is None:
                    raise ValueError(f"no budget in {list(BUDGETS)} accepted")
                if kind == "recipe":
                    case = _synthetic_case(policy, job, b, rng, case_id + 1)
                else:
                    case = _engine_case(policy, b, job[0], job[1], job[2], case_id + 1)
            except ValueError as err:
                skipped.append({"policy": name, "what": what, "reason": str(err)})
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
def policy_end_to_end(name: str, model: str = "tiny") -> tuple[list[tuple[str, dict, dict]], list[dict]]:
    """``[(label, manifest, arrays)]`` of policy ``name`` (default parameters) and the skips.

    Block mode: every setting of :data:`E2E_SETTINGS` the policy accepts, in float64, the
    first of them in float32 too. One-shot: the first of :data:`ONESHOT_SETTINGS` the policy
    accepts, in float64 and float32 (none for policies that evict before attention). For a
    model other than :data:`FULL_E2E_MODEL`, only the first block and the first one-shot
    setting it accepts, in float32.
    """
    out, skipped = [], []

    def attempt(setting: Setting, dtype: str) -> bool:
        what = f"e2e {setting.label(dtype, model)}"
        try:
            manifest, arrays = run_end_to_end(policy_registry.get(name), budget=setting.budget,
                                              block_size=setting.block_size, dtype=dtype,
                                              prompt_length=setting.prompt_length, model_seed=MODEL_SEED,
                                              prompt_seed=PROMPT_SEED, model=model)
        except ValueError as err:
            skipped.append({"policy": name, "what": what, "reason": str(err)})
            return False
        out.append((setting.label(dtype, model), manifest, arrays))
        return True

    if model != FULL_E2E_MODEL:
        block = next((s for s in (*E2E_SETTINGS, E2E_FALLBACK, E2E_UNBOUNDED) if attempt(s, "float32")), None)
        if policy_registry.policy_class(name).evict_before_attention:
            skipped.append({"policy": name, "what": f"e2e one-shot ({model})", "reason": NO_ONESHOT})
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
        skipped.append({"policy": name, "what": f"e2e one-shot ({model})", "reason": NO_ONESHOT})
        return out, skipped
    oneshot = next((s for s in ONESHOT_SETTINGS if attempt(s, "float64")), None)
    if oneshot is None and ran == [E2E_UNBOUNDED] and attempt(E2E_UNBOUNDED_ONESHOT, "float64"):
        oneshot = E2E_UNBOUNDED_ONESHOT
    if oneshot is not None:
        attempt(oneshot, "float32")
    return out, skipped


# -- compression schedules (refkv.schedule) ------------------------------------------------------------
@dataclass(frozen=True)
class ScheduleSetting:
    """One schedule golden: a label, the schedule, the prompt length, and the dtypes it is written in."""

    label: str
    schedule: object  # refkv.schedule.Schedule
    prompt_length: int
    dtypes: tuple = ("float64",)


def _schedule_settings(budget: int, prompt: int, fallback_block: int) -> tuple:
    from ..schedule import Schedule

    return (
        # kvpress DecodingPress alone: the prompt is not compressed, then every 4 tokens down to N
        ScheduleSetting(f"sched-oneshot-K4-N{budget}", Schedule(None, None, 4, budget, new_tokens=12), prompt,
                        ("float64", "float32")),
        # blocks of 8 evicting to N, then at most N at every step (the engine's own rule)
        ScheduleSetting(f"sched-B8-K1-N{budget}", Schedule(8, budget, 1, budget, new_tokens=3), prompt),
        # PrefillDecodingPress: one-shot prefill to N, then every 16 tokens down to N
        ScheduleSetting(f"sched-oneshot{budget}-K16-N{budget}", Schedule(None, budget, 16, budget, new_tokens=48),
                        prompt),
        # CompressionRatioDecodingPress: every 4 tokens down to half the tokens seen
        ScheduleSetting("sched-oneshot-K4-ratio0.5", Schedule(None, None, 4, None, "ratio", 0.5, 12), prompt),
        # a policy that evicts before attention has no one-shot prefill with a budget: blocks instead
        ScheduleSetting(f"sched-B{fallback_block}-K16-N{budget}",
                        Schedule(fallback_block, budget, 16, budget, new_tokens=48), prompt),
    )


#: Schedule goldens per policy (tiny model), tried at N = 16 with a prompt of 24; a policy that
#: refuses N = 16 (SnapKV's default window of 32) gets N = 40 with a prompt of 48. The last
#: setting is written only when the third (one-shot prefill with a budget) is refused. At least
#: 3 decoding rounds each, K in {1, 4, 16}, one-shot and block prefill.
SCHEDULE_SETTINGS = (_schedule_settings(16, 24, 4), _schedule_settings(40, 48, 8))


def policy_schedules(name: str) -> tuple[list[tuple[str, dict, dict]], list[dict]]:
    """``[(label, manifest, arrays)]`` of policy ``name``'s schedule goldens (tiny model) and the skips."""
    from .recorder import run_schedule_golden

    out, skipped = [], []
    policy = policy_registry.get(name)
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
        skipped.append({"policy": name, "what": "schedule goldens", "reason": reason})
        return out, skipped
    ran_oneshot_budget = False
    for i, setting in enumerate(settings):
        if i == len(settings) - 1 and ran_oneshot_budget:
            break
        for dtype in setting.dtypes:
            label = f"{setting.label}-{dtype}"
            try:
                manifest, arrays = run_schedule_golden(policy_registry.get(name), setting.schedule, dtype=dtype,
                                                       prompt_length=setting.prompt_length, model_seed=MODEL_SEED,
                                                       prompt_seed=PROMPT_SEED, decode_seed=DECODE_SEED)
            except ValueError as err:
                skipped.append({"policy": name, "what": f"e2e {label}", "reason": str(err)})
                break
            out.append((label, manifest, arrays))
            ran_oneshot_budget |= i == 2
    return out, skipped


def load_golden_model(name: str, dtype: str):
    """A model for goldens: a name of :data:`refkv.oracle.models.MODELS` (seeded random weights),
    ``"smollm2"`` or a checkpoint path (:func:`refkv.model.load`)."""
    from ..model import load
    from .models import MODELS

    if name in MODELS:
        return build_model(name, MODEL_SEED, dtype)
    return load(name, dtype=np.dtype(dtype))


def generate_schedules(out, policies: list[str] | None, schedule, *, model: str = "tiny", prompt_length: int = 128,
                       dtype: str | None = None, progress=None) -> dict:
    """Schedule goldens of ``policies`` (default: every library policy) for one model and schedule.

    Written as ``out/e2e/<policy>/<model>-<label>-<dtype>.json`` (+ ``.npz``) in a folder of
    golden files without ``suite.json`` (``refkv golden check`` finds them by their schema).
    A real checkpoint defaults to float32 (the reduced set: one precision, one schedule).
    A policy that refuses the schedule is skipped and listed. Returns ``{"written", "skipped"}``.
    """
    from .endtoend import write_end_to_end
    from .models import MODELS
    from .recorder import run_schedule_golden

    out = Path(out)
    if (out / "suite.json").exists():
        raise ValueError(f"--out {out} holds a golden suite (suite.json); write custom goldens to another folder")
    names = _policy_names(policies)
    dtype = dtype or ("float64" if model in MODELS else "float32")
    built = load_golden_model(model, dtype)
    tag = re.sub(r"[^A-Za-z0-9_.+-]", "_", Path(model).name if model not in MODELS else model)
    sched = schedule
    prefill = "oneshot" if sched.block_size is None else f"B{sched.block_size}"
    rule = f"N{sched.budget}" if sched.rule == "interval" else f"ratio{sched.ratio:g}"
    label = (f"{tag}-sched-{prefill}{'' if sched.prefill_budget is None else sched.prefill_budget}"
             f"-K{sched.interval}-{rule}-{dtype}")
    written, skipped = [], []
    for name in names:
        try:
            manifest, arrays = run_schedule_golden(policy_registry.get(name), sched, dtype=dtype,
                                                   prompt_length=prompt_length, model_seed=MODEL_SEED,
                                                   prompt_seed=PROMPT_SEED, decode_seed=DECODE_SEED, model=model,
                                                   built=None if model in MODELS else built)
        except ValueError as err:
            skipped.append({"policy": name, "reason": str(err)})
            if progress is not None:
                progress(f"{name}: skipped: {err}")
            continue
        path = out / "e2e" / name / f"{label}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_end_to_end(path, manifest, arrays)
        written.append(str(path))
        if progress is not None:
            progress(f"{name}: {path} ({manifest['n_rounds']} rounds)")
    return {"written": written, "skipped": skipped}


# -- paths inside the suite folder -----------------------------------------------------------------
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.+-]*"
_SUITE_PATH = re.compile(rf"vectors/{_NAME}\.json|e2e/{_NAME}/{_NAME}\.json")
#: The folder inside a suite where a generation stages its files (see :func:`generate_suite`).
STAGING = ".refkv-generate"
_COMMITTED = "COMMITTED.json"


def _safe_path(root: Path, rel, where: str) -> str:
    """``rel`` if it names a suite file inside ``root``; otherwise a ValueError (nothing touched).

    A suite file is ``vectors/<name>.json`` or ``e2e/<policy>/<name>.json``: relative,
    already normalised (no ``..``, ``.``, empty parts or backslashes), and it must resolve
    inside ``root`` (a symlinked folder pointing out of the suite is refused too).
    """
    if not isinstance(rel, str) or not _SUITE_PATH.fullmatch(rel) or posixpath.normpath(rel) != rel:
        raise ValueError(f"{where}: path {rel!r} is not a suite file (vectors/<policy>.json or "
                         f"e2e/<policy>/<name>.json inside the suite folder); refusing to touch it")
    base = root.resolve()
    for target in (root / rel, (root / rel).with_suffix(".npz")):
        resolved = target.resolve()
        if resolved != base and base not in resolved.parents:
            raise ValueError(f"{where}: path {rel!r} leads outside the suite folder {root} (to {resolved}); "
                             f"refusing to touch it")
    return rel


def _old_index(out: Path, regenerated: set[str]) -> dict | None:
    """The existing ``suite.json`` of ``out``, every field the merge uses checked (None if there is none).

    Checked before anything is generated: ``policies`` a list of names, every entry an
    object with a suite-file ``path``, a ``kind`` of ``vectors`` or ``e2e`` and a
    ``policy`` named in ``policies``, ``skipped`` a list. The files of the policies that
    are kept must match their checksums, the ``.npz`` of an end-to-end golden too: a merge
    never publishes a suite that fails them.
    """
    path = out / "suite.json"
    if not path.exists():
        return None
    where = str(path)
    index = read_json(path)
    check_header(index, SUITE_SCHEMA, where)
    policies = index.get("policies", [])
    if not isinstance(policies, list) or not all(isinstance(p, str) for p in policies):
        raise ValueError(f"{where}: policies must be a list of policy names, got {policies!r:.80}")
    files = require(index, "files", where)
    if not isinstance(files, list):
        raise ValueError(f"{where}: files must be a list")
    if not isinstance(index.get("skipped", []), list):
        raise ValueError(f"{where}: skipped must be a list, got {index['skipped']!r:.80}")
    for i, entry in enumerate(files):
        at = f"{where}: files[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{at} must be an object")
        _safe_path(out, require(entry, "path", at), at)
        policy = require(entry, "policy", at)
        if not isinstance(policy, str) or policy not in policies:
            raise ValueError(f"{at}: policy {policy!r:.80} is not one of the suite's policies")
        if entry.get("kind") not in ("vectors", "e2e"):
            raise ValueError(f"{at}: kind must be 'vectors' or 'e2e', got {entry.get('kind')!r:.80}")
    for entry in files:
        if entry["policy"] in regenerated:
            continue
        checked = [(out / entry["path"], entry.get("sha256"))]
        if entry["kind"] == "e2e":
            checked.append(((out / entry["path"]).with_suffix(".npz"), entry.get("npz_sha256")))
        for file, digest in checked:
            if not file.is_file() or sha256(file.read_bytes()) != digest:
                raise ValueError(f"{file}: missing or checksum mismatch with {where}, so the existing suite cannot "
                                 f"be merged into; regenerate policy {entry['policy']!r} too (or every policy)")
    return index


def _policy_names(policies) -> list[str]:
    if policies is None:
        return library_policies()
    if isinstance(policies, str):
        raise ValueError(f"policies must be a list of policy names, got the string {policies!r}")
    names = list(policies)
    if not names:
        raise ValueError("policies must name at least one policy, got none (leave it out for every policy)")
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"policies must be non-empty policy names, got {name!r}")
        policy_registry.policy_class(name)  # ValueError naming the unknown policy
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"policies lists {', '.join(map(repr, twice))} more than once")
    return names


# -- the transaction ---------------------------------------------------------------------------------------
def _remove_tree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _apply(out: Path) -> None:
    """Move a committed staging folder's files into place, suite.json last; remove the stale files.

    Idempotent: after an interruption it is run again and finishes the same move.
    """
    stage = out / STAGING
    where = str(stage / _COMMITTED)
    try:
        journal = read_json(stage / _COMMITTED)
        moves = [_safe_path(out, rel, where) for rel in _journal_list(journal, "files", where)]
        stale = [_safe_path(out, rel, where) for rel in _journal_list(journal, "remove", where)]
    except ValueError as err:
        # Nothing was moved yet: dropping the staging folder leaves the old suite as it was,
        # and no state that only deleting .refkv-generate by hand would repair.
        _remove_tree(stage)
        raise ValueError(f"{err} (the unfinished generation in {stage} was discarded; the suite is as "
                         f"before it)") from None
    for rel in moves:
        for name in (rel, rel[:-len(".json")] + ".npz"):
            src = stage / name
            if src.exists():
                (out / name).parent.mkdir(parents=True, exist_ok=True)
                os.replace(src, out / name)
    if (stage / "suite.json").exists():
        os.replace(stage / "suite.json", out / "suite.json")  # the new suite is published here
    for rel in stale:
        for name in (rel, rel[:-len(".json")] + ".npz"):
            (out / name).unlink(missing_ok=True)
    _remove_tree(stage)
    for folder in sorted({(out / rel).parent for rel in stale}, reverse=True):
        if folder != out and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def _journal_list(journal: dict, key: str, where: str) -> list:
    value = require(journal, key, where)
    if not isinstance(value, list):
        raise ValueError(f"{where}: {key} must be a list of suite files, got {type(value).__name__}")
    return value


def recover(out) -> bool:
    """Finish or discard a generation that was interrupted in folder ``out``.

    A staging folder with its commit record is rolled forward (its files were complete);
    one without is deleted (the old suite was never touched). Returns whether anything
    was found.
    """
    out = Path(out)
    stage = out / STAGING
    if not (stage.exists() or stage.is_symlink()):
        return False
    if stage.is_dir() and not stage.is_symlink() and (stage / _COMMITTED).is_file():
        _apply(out)
    else:
        _remove_tree(stage)
    return True


def _commit(out: Path, files: dict[str, bytes], index: dict, stale: list[str]) -> None:
    stage = out / STAGING
    _remove_tree(stage)
    for rel in sorted(rel for rel in files if rel.endswith(".json")) + stale:  # refused before anything is written
        _safe_path(out, rel, f"generating into {out}")
    for rel, data in files.items():
        atomic_write(stage / rel, data)
    atomic_write(stage / "suite.json", dumps(index).encode("utf-8"))
    manifests = sorted(rel for rel in files if rel.endswith(".json"))
    # The commit point: once this record exists the new suite is complete on disk.
    atomic_write(stage / _COMMITTED, dumps({"files": manifests, "remove": stale}).encode("utf-8"))
    _apply(out)


# -- the suite -----------------------------------------------------------------------------------------
def generate_suite(out, policies: list[str] | None = None, *, progress=None) -> dict:
    """Write a golden suite into folder ``out`` (or merge into the suite there); return its index.

    Parameters
    ----------
    out : path-like
        Created if needed. If it holds a suite, the named policies' files are added or
        replaced and every other policy's files are left untouched (their checksums must
        hold).
    policies : list of str, optional
        Default: :func:`library_policies`, every policy refkv itself registers. An empty
        list, an unknown name or a name given twice is a ValueError.
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
    :func:`generate_suite` (or :func:`recover`) finishes the move; :func:`read_suite` refuses
    the suite until then (a reader never writes). Either way a reader sees the old suite or
    the new one, never a mix that fails its checksums.
    """
    out = Path(out)
    names = _policy_names(policies)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    recover(out)
    old = _old_index(out, set(names))
    for name in names:  # every new file's folder stays inside out (a symlinked e2e/<policy> is refused now)
        for rel in (f"vectors/{name}.json", f"e2e/{name}/{name}.json"):
            _safe_path(out, rel, f"generating {name} into {out}")

    files: dict[str, bytes] = {}
    entries, skipped = [], []
    for name in names:
        doc, skips = policy_vectors(name)
        skipped += skips
        if doc is not None:
            rel = f"vectors/{name}.json"
            files[rel] = dumps(doc).encode("utf-8")
            entries.append({"path": rel, "kind": "vectors", "policy": name, "sha256": sha256(files[rel]),
                            "cases": doc["number_of_cases"]})
        n_runs = 0
        made = [policy_end_to_end(name, model) for model in E2E_MODELS] + [policy_schedules(name)]
        for runs, skips in made:
            skipped += skips
            n_runs += len(runs)
            for label, manifest, arrays in runs:
                rel = f"e2e/{name}/{label}.json"
                manifest, text, data = end_to_end_files(label, manifest, arrays)
                files[rel], files[rel[:-len(".json")] + ".npz"] = text, data
                entries.append({"path": rel, "kind": "e2e", "policy": name, "mode": manifest["mode"],
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
    all_names.sort(key=lambda n: (order.get(n, len(order)), n))
    rank = {n: i for i, n in enumerate(all_names)}
    index = {
        **header(SUITE_SCHEMA),
        "description": ("refkv golden suite: score-function test vectors (vectors/) and end-to-end goldens "
                        "(e2e/), one-shot and block mode. Check a candidate with: "
                        "refkv golden check CANDIDATE_DIR --against THIS_DIR"),
        "model": {"name": "tiny", "seed": MODEL_SEED},
        "models": list(E2E_MODELS),
        "prompt_seed": PROMPT_SEED,
        "regeneration": {
            "float_bound": {kind: dict(b) for kind, b in REGENERATION_BOUND.items()},
            "rule": ("regenerating on any machine must give identical decisions (kept positions, protected "
                     "masks, flags, counts, integers, strings) and floats with |a - b| <= bound[kind][dtype] "
                     "* max(1, max |a|) per array (kind: vectors or e2e); bit-identity is expected only on the "
                     "same machine"),
        },
        "policies": all_names,
        "files": sorted(kept_entries + entries, key=lambda e: (rank[e["policy"]], e["kind"] != "vectors")),
        "skipped": sorted(kept_skips + skipped, key=lambda s: rank.get(s["policy"], len(rank))),
    }
    written = {e["path"] for e in entries}
    stale = sorted(e["path"] for e in (old["files"] if old else []) if e["policy"] in names
                   and e["path"] not in written)
    _commit(out, files, index, stale)
    return index


def read_suite(directory, *, verify: bool = True) -> dict:
    """Read ``suite.json`` of a suite directory; with ``verify``, check every file's sha256.

    Never writes: a generation interrupted after its commit point (see
    :func:`generate_suite`) is refused, to be finished by the writer
    (:func:`recover`, which ``refkv golden generate`` runs first).

    Raises
    ------
    ValueError
        For an unknown schema version, a missing field, a missing file, or a file whose
        checksum differs from the index (edited or corrupted after generation).
    """
    directory = Path(directory)
    stage = directory / STAGING
    if (stage / _COMMITTED).exists() or (stage / _COMMITTED).is_symlink():
        # A reader never writes: finishing the publication (moving and deleting files) is
        # left to the writer, refkv golden generate, which checks the commit record first.
        raise ValueError(f"{directory}: a generation was interrupted while publishing its files "
                         f"({stage / _COMMITTED} exists); a check never writes, so finish it with refkv golden "
                         f"generate --out {directory} (or refkv.oracle.suite.recover) and check again")
    path = directory / "suite.json"
    if not path.exists():
        raise ValueError(f"{directory} is not a golden suite: it has no suite.json")
    where = str(path)
    index = read_json(path)
    check_header(index, SUITE_SCHEMA, where)
    require(index, "policies", where)
    for i, entry in enumerate(require(index, "files", where)):
        for key in ("path", "kind", "policy", "sha256"):
            require(entry, key, f"{where}: files[{i}]")
        if entry["kind"] not in ("vectors", "e2e"):
            raise ValueError(f"{where}: files[{i}]: kind must be 'vectors' or 'e2e', got {entry['kind']!r}")
        _safe_path(directory, entry["path"], f"{where}: files[{i}]")
        if verify:
            file = directory / entry["path"]
            if not file.exists():
                raise ValueError(f"{where}: lists {entry['path']}, which does not exist")
            if sha256(file.read_bytes()) != entry["sha256"]:
                raise ValueError(f"{file}: checksum mismatch with suite.json (edited or corrupted after "
                                 f"generation; regenerate with refkv golden generate)")
            npz = file.with_suffix(".npz")
            if "npz_sha256" in entry and (not npz.is_file() or sha256(npz.read_bytes()) != entry["npz_sha256"]):
                raise ValueError(f"{npz}: missing or checksum mismatch with suite.json (regenerate with refkv "
                                 f"golden generate)")
    return index


# -- regeneration: decisions identical, floats within a stated bound -------------------------------------
_VERSION_FIELDS = {"refkv_version", "numpy_version", "sha256", "npz_sha256"}


@dataclass
class Differences:
    """What changed between two generations of a suite (see :func:`regeneration_differences`).

    Attributes
    ----------
    decisions : list of str
        Every difference in a decision: a kept position, a protected mask, a flag, a count,
        an integer, a string, a file present on one side only. Must be empty.
    floats : list of tuple
        ``(where, scaled difference, dtype, first side, second side)`` for every float
        array or number that differs at all, the difference scaled as in
        :data:`REGENERATION_BOUND`; ``where`` starts with the file's path.
    """

    decisions: list
    floats: list

    @staticmethod
    def kind(where: str) -> str:
        return "vectors" if where.startswith("vectors/") else "e2e"

    def largest(self, dtype: str, kind: str | None = None) -> float:
        return max((f[1] for f in self.floats if f[2] == dtype and kind in (None, self.kind(f[0]))), default=0.0)

    def beyond(self, bound: dict) -> list:
        """The float differences above ``bound[kind][dtype]``."""
        return [f for f in self.floats if f[1] > bound[self.kind(f[0])][f[2]]]


def _scaled(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    same = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
    if same.all():
        return 0.0
    finite = np.isfinite(a64) & np.isfinite(b64)
    if not finite[~same].all():
        return math.inf  # a NaN or an infinity on one side only
    scale = max(1.0, float(np.abs(a64[np.isfinite(a64)]).max(initial=0.0)))
    return float(np.abs(a64 - b64)[~same].max()) / scale


def _json_diff(a, b, where: str, dtype: str, out: Differences) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) == {"dtype", "shape", "data"} and set(b) == set(a):  # an encoded array
            if a["dtype"] != b["dtype"] or a["shape"] != b["shape"]:
                out.decisions.append(f"{where}: dtype/shape {a['dtype']}{a['shape']} vs {b['dtype']}{b['shape']}")
            elif a["data"] != b["data"]:
                if np.dtype(a["dtype"]).kind == "f":
                    conv = [[{"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(x, x) if isinstance(x, str)
                             else x for x in side["data"]] for side in (a, b)]
                    x, y = (np.array(c, dtype=np.float64) for c in conv)
                    # Bounded by the coarser of the array's dtype and its case's: a float64
                    # array computed by a float32 run (H2O's accumulator) moves like float32.
                    coarser = "float32" if "float32" in (a["dtype"], dtype) else a["dtype"]
                    out.floats.append((where, _scaled(x, y), coarser, a["data"], b["data"]))
                else:
                    out.decisions.append(f"{where}: {a['data']!r} vs {b['data']!r}")
            return
        dtype = a["dtype"] if a.get("dtype") in ("float32", "float64") else dtype
        for key in sorted(set(a) | set(b)):
            if key in _VERSION_FIELDS:
                continue
            if key not in a or key not in b:
                out.decisions.append(f"{where}.{key}: only in one")
            else:
                _json_diff(a[key], b[key], f"{where}.{key}", dtype, out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _json_diff(x, y, f"{where}[{i}]", dtype, out)
    elif type(a) is float and type(b) is float:
        if a != b:
            out.floats.append((where, _scaled(np.array([a]), np.array([b])), dtype, a, b))
    elif a != b or type(a) is not type(b):
        out.decisions.append(f"{where}: {a!r} vs {b!r}")


def regeneration_differences(first, second) -> Differences:
    """Compare two generations of a suite: decisions exactly, floats as scaled differences.

    Version fields and checksums are ignored (they change with the refkv/NumPy versions and
    with any float). ``.npz`` arrays: integer and bool arrays are decisions, float arrays
    are compared in the dtype of their golden (float64 scores of a float32 run count as
    float32).
    """
    first, second = Path(first), Path(second)

    def files(root):
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}

    out = Differences([], [])
    a_files, b_files = files(first), files(second)
    for rel in sorted(a_files ^ b_files):
        out.decisions.append(f"{rel}: only in {first if rel in a_files else second}")
    for rel in sorted(a_files & b_files):
        if rel.endswith(".json"):
            _json_diff(read_json(first / rel), read_json(second / rel), rel, "float64", out)
            continue
        dtype = read_json((first / rel).with_suffix(".json")).get("dtype", "float64")
        a, b = read_npz(first / rel), read_npz(second / rel)
        for name in sorted(set(a) | set(b)):
            x, y = a.get(name), b.get(name)
            where = f"{rel}:{name}"
            if x is None or y is None or x.dtype != y.dtype or x.shape != y.shape:
                out.decisions.append(f"{where}: missing on one side, or dtype/shape changed")
            elif x.dtype.kind == "f":
                if not np.array_equal(x, y, equal_nan=True):
                    out.floats.append((where, _scaled(x, y), dtype, x, y))
            elif not np.array_equal(x, y):
                out.decisions.append(f"{where}: values differ: {x.tolist()} vs {y.tolist()}")
    return out
