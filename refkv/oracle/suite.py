"""The golden suite: what ``refkv golden generate`` writes, and how it is read back.

Layout of a suite directory::

    suite.json                          index: versions, policies, every file with its sha256
    vectors/<policy>.json               score-function test vectors
    e2e/<policy>/N<N>-B<B>-<dtype>.json end-to-end manifest ...
    e2e/<policy>/N<N>-B<B>-<dtype>.npz  ... and its arrays

Every policy refkv registers is included (:func:`library_policies`: the registry's
policies whose class lives in the ``refkv`` package, so a test module or a plugin that
registers its own does not change the suite), and a new policy is picked up by the next
``refkv golden generate``. Cases a policy refuses -- a budget its
protected set does not fit, a block larger than the budget of a policy that evicts before
attention -- are skipped through the policy's own ValueError and listed in ``suite.json``
under ``skipped``; nothing here names a policy: :data:`VARIANTS`, the extra parameter sets
that widen the coverage of policies with options, are the policy classes' ``variants``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import policies as policy_registry
from ..engine import Engine
from ..model import builtin_model
from ..policies import Policy
from .endtoend import prompt_tokens, run_end_to_end, write_end_to_end
from .io import read_json, sha256, write_json
from .schema import SUITE_SCHEMA, check_header, header, require
from .synthetic import (
    Tokens,
    duplicate_key,
    huge_logits,
    near_duplicate_key,
    random_tokens,
    replay,
    zero_key,
)
from .vectors import DEFAULT_TOLERANCE, encode_case, json_params, vectors_document

__all__ = ["BUDGETS", "E2E_SETTINGS", "RECIPES", "VARIANTS", "Recipe", "Setting", "generate_suite",
           "library_policies", "read_suite"]

#: Budgets tried for vector cases, smallest first: a policy's cases use the smallest its
#: ``check`` accepts (small budgets make small files).
BUDGETS = (6, 8, 12, 16, 24, 40)

#: Extra parameter sets per policy (beyond the defaults), with a reduced set of recipes: each
#: policy class's ``variants``.
#: A set a policy rejects (ValueError/TypeError) is skipped and listed.
VARIANTS: dict[str, list[dict]] = {
    name: [dict(v) for v in policy_registry.policy_class(name).variants]
    for name in policy_registry.available() if policy_registry.policy_class(name).variants}


@dataclass(frozen=True)
class Recipe:
    """How to build one synthetic vector case.

    ``budget + block * (1 + extra)`` tokens are replayed through one layer in blocks of
    ``block`` (so earlier blocks evict too, and the last block is full); ``no_eviction``
    uses ``budget`` tokens; ``edit`` plants an adversarial feature.
    """

    comment: str
    dtype: str = "float64"
    n_heads: int = 4
    n_kv_heads: int = 2
    d_head: int = 4
    block: int = 3
    extra: int = 1
    layer: int = 3
    edit: str | None = None
    no_eviction: bool = False
    variants: bool = False  # also used for the variant parameter sets
    n_layers: int = 4


#: Synthetic recipes in priority order (see :data:`MAX_VECTOR_BYTES`); ``"engine"`` marks where
#: the two cases captured from the built-in model go.
RECIPES = (
    Recipe("random keys, GQA, block of 3, deepest layer", variants=True),
    Recipe("random keys, GQA, float32, layer 2", dtype="float32", layer=2, variants=True),
    Recipe("generation step: a block of one token", block=1, extra=4, variants=True),
    Recipe("near-duplicate key planted (near tie)", edit="near-tie"),
    Recipe("zero key planted", edit="zero-norm-key", layer=1),
    Recipe("duplicate key and value planted (exact tie for key-based scores)", edit="duplicate-keys"),
    Recipe("queries and keys scaled by 8 (saturated softmax)", edit="huge-logits", layer=2),
    Recipe("random keys, one query head per KV head, layer 0", n_heads=2, block=2, layer=0),
    Recipe("fewer tokens than the budget", no_eviction=True),
    Recipe("near-duplicate key planted (near tie), float32", dtype="float32", edit="near-tie", layer=2),
)
#: Engine captures of the default parameters: (dtype, layer), inserted after the third recipe.
ENGINE_CASES = (("float64", 3), ("float32", 1))
#: A vectors file stops taking cases once its cases exceed this many bytes of JSON (the
#: first :data:`MIN_CASES` always go in). Per-token state can be large (Scissorhands keeps
#: a 400-step history per token); the skipped cases are listed in ``suite.json``.
MAX_VECTOR_BYTES = 100_000
MIN_CASES = 4

#: Attempts (new positions) at planting an edit until its flag is detected.
_ATTEMPTS = 16


@dataclass(frozen=True)
class Setting:
    """One end-to-end run: budget ``N``, block size ``B`` (None: whole prompt), prompt length."""

    budget: int | None
    block_size: int | None
    prompt_length: int

    def label(self, dtype: str) -> str:
        b = "all" if self.block_size is None else self.block_size
        return f"N{self.budget if self.budget is not None else 'none'}-B{b}-{dtype}"


#: End-to-end settings, tried for every policy.
E2E_SETTINGS = (Setting(8, 4, 40), Setting(16, 1, 28), Setting(16, None, 40), Setting(24, 8, 40))
#: Tried when fewer than two of :data:`E2E_SETTINGS` run (policies with large protected sets).
E2E_FALLBACK = Setting(40, 8, 64)
#: Tried when no budgeted setting runs (``full``): the no-eviction baseline.
E2E_UNBOUNDED = Setting(None, 8, 40)

MODEL_SEED = 0
PROMPT_SEED = 1


def library_policies() -> list[str]:
    """Registered policies defined by refkv itself (the default contents of a suite)."""
    return [name for name in policy_registry.available()
            if policy_registry.policy_class(name).__module__.startswith("refkv.")]


# -- vectors ---------------------------------------------------------------------------------
def _smallest_budget(policy: Policy, recipe: Recipe) -> int | None:
    from .synthetic import config_for

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
    n_tokens = budget if recipe.no_eviction else budget + recipe.block * (1 + recipe.extra)
    base = random_tokens(rng, recipe.n_heads, recipe.n_kv_heads, recipe.d_head, n_tokens, recipe.dtype)
    attempts = _ATTEMPTS if recipe.edit else 1
    case = None
    for _ in range(attempts):
        tokens = _edit(base, recipe.edit, rng, recipe) if recipe.edit else base
        view = replay(policy, tokens, block_size=recipe.block, budget=budget, layer=recipe.layer,
                      n_layers=recipe.n_layers)
        case = encode_case(policy, view, case_id=case_id, comment=recipe.comment)
        if not recipe.edit or recipe.edit in case["flags"]:  # each edit is named after its flag
            break
    return case


class _ViewCatcher:
    """Stands in for an engine's policy and keeps the eviction views of one layer."""

    def __init__(self, policy: Policy, layer: int, sink: list):
        self._policy, self._layer, self._sink = policy, layer, sink

    def __getattr__(self, name):
        return getattr(self._policy, name)

    def keep_indices(self, view):
        if view.layer == self._layer:
            self._sink.append(view)
        return self._policy.keep_indices(view)


def _engine_case(policy: Policy, budget: int, dtype: str, layer: int, case_id: int):
    """The last eviction of ``layer`` in a short run of the built-in model."""
    model = builtin_model(seed=MODEL_SEED, dtype=dtype)
    block = 2
    prompt = prompt_tokens(PROMPT_SEED, budget + 3 * block, model.config.vocab_size)
    engine = Engine(model, policy, budget)
    views: list = []
    engine.policy = _ViewCatcher(policy, layer, views)
    engine.prefill(prompt, block)
    if not views:
        raise ValueError(f"layer {layer} never evicted")
    comment = (f"built-in model (seed {MODEL_SEED}), prompt of {len(prompt)} tokens (seed {PROMPT_SEED}), "
               f"N={budget}, B={block}: last eviction of layer {layer}")
    return encode_case(policy, views[-1], case_id=case_id, comment=comment, extra_flags=("engine",))


def policy_vectors(name: str, *, seed: int = 0) -> tuple[dict | None, list[dict]]:
    """The vectors document of policy ``name`` and the list of skipped cases."""
    from .io import dumps

    skipped: list[dict] = []
    groups = []
    param_sets = [{}] + [dict(v) for v in VARIANTS.get(name, [])]
    case_id = 0
    for set_index, params in enumerate(param_sets):
        size, first_id = 0, case_id
        try:
            policy = policy_registry.get(name, **params)
        except (ValueError, TypeError) as err:
            skipped.append({"policy": name, "what": f"vectors with params {json_params(params)}", "reason": str(err)})
            continue
        rng = np.random.default_rng([seed, set_index])
        budget = _smallest_budget(policy, RECIPES[0])
        jobs = [("recipe", r) for r in RECIPES if set_index == 0 or r.variants]
        if set_index == 0:
            jobs[3:3] = [("engine", e) for e in ENGINE_CASES]
        cases = []
        for kind, job in jobs:
            if kind == "recipe":
                what = f"vectors {json_params(params)}: {job.comment}"
                b = _smallest_budget(policy, job)
            else:
                what = f"vectors {json_params(params)}: engine capture, {job[0]}, layer {job[1]}"
                b = budget
            if case_id - first_id >= MIN_CASES and size > MAX_VECTOR_BYTES:
                skipped.append({"policy": name, "what": what,
                                "reason": f"the file reached its size budget of {MAX_VECTOR_BYTES} bytes"})
                continue
            try:
                if b is None:
                    raise ValueError(f"no budget in {list(BUDGETS)} accepted")
                if kind == "recipe":
                    case = _synthetic_case(policy, job, b, rng, case_id + 1)
                else:
                    case = _engine_case(policy, b, job[0], job[1], case_id + 1)
            except ValueError as err:
                skipped.append({"policy": name, "what": what, "reason": str(err)})
                continue
            cases.append(case)
            case_id += 1
            size += len(dumps(case))
        if cases:
            groups.append((json_params(policy.params()), cases))
    if not groups:
        return None, skipped
    return vectors_document(name, groups), skipped


# -- end to end -----------------------------------------------------------------------------------
def policy_end_to_end(name: str) -> tuple[list[tuple[str, dict, dict]], list[dict]]:
    """``[(label, manifest, arrays)]`` of policy ``name`` (default parameters) and the skips."""
    out, skipped = [], []

    def attempt(setting: Setting, dtype: str) -> bool:
        what = f"e2e {setting.label(dtype)}"
        try:
            manifest, arrays = run_end_to_end(policy_registry.get(name), budget=setting.budget,
                                              block_size=setting.block_size, dtype=dtype,
                                              prompt_length=setting.prompt_length, model_seed=MODEL_SEED,
                                              prompt_seed=PROMPT_SEED)
        except ValueError as err:
            skipped.append({"policy": name, "what": what, "reason": str(err)})
            return False
        out.append((setting.label(dtype), manifest, arrays))
        return True

    ran = [s for s in E2E_SETTINGS if attempt(s, "float64")]
    if len(ran) < 2 and attempt(E2E_FALLBACK, "float64"):
        ran.append(E2E_FALLBACK)
    if not ran and attempt(E2E_UNBOUNDED, "float64"):
        ran.append(E2E_UNBOUNDED)
    if ran:
        attempt(ran[0], "float32")
    return out, skipped


# -- the suite -----------------------------------------------------------------------------------------
def generate_suite(out, policies: list[str] | None = None, *, progress=None) -> dict:
    """Write a golden suite into directory ``out``; return its index (``suite.json``).

    Parameters
    ----------
    out : path-like
        Created if needed. Files listed by a previous ``suite.json`` there and not
        written now are removed, so the directory always holds exactly one suite.
    policies : list of str, optional
        Default: :func:`library_policies`, every policy refkv itself registers.
    progress : callable, optional
        Called with a line of text per policy.
    """
    out = Path(out)
    names = library_policies() if policies is None else list(policies)
    for name in names:
        policy_registry.policy_class(name)  # ValueError for an unknown name
    old = set()
    if (out / "suite.json").exists():
        try:
            old = {e["path"] for e in read_json(out / "suite.json").get("files", [])}
        except (ValueError, KeyError, TypeError):
            old = set()
    files, skipped = [], []
    for name in names:
        doc, skips = policy_vectors(name)
        skipped += skips
        if doc is not None:
            rel = f"vectors/{name}.json"
            data = write_json(out / rel, doc)
            files.append({"path": rel, "kind": "vectors", "policy": name, "sha256": sha256(data),
                          "cases": doc["number_of_cases"]})
        runs, skips = policy_end_to_end(name)
        skipped += skips
        for label, manifest, arrays in runs:
            rel = f"e2e/{name}/{label}.json"
            manifest = write_end_to_end(out / rel, manifest, arrays)
            data = (out / rel).read_bytes()
            files.append({"path": rel, "kind": "e2e", "policy": name, "dtype": manifest["dtype"],
                          "sha256": sha256(data), "npz_sha256": manifest["arrays"]["sha256"]})
        if progress is not None:
            n_cases = doc["number_of_cases"] if doc else 0
            progress(f"{name}: {n_cases} vector cases, {len(runs)} end-to-end goldens, {len(skips)} skipped")
    index = {
        **header(SUITE_SCHEMA),
        "description": ("refkv golden suite: score-function test vectors (vectors/) and end-to-end goldens "
                        "of the built-in model (e2e/). Check a candidate with: "
                        "refkv golden check CANDIDATE_DIR --against THIS_DIR"),
        "model": {"name": "tiny", "seed": MODEL_SEED},
        "prompt_seed": PROMPT_SEED,
        "policies": names,
        "files": files,
        "skipped": skipped,
    }
    write_json(out / "suite.json", index)
    written = {f["path"] for f in files}
    for rel in sorted(old - written):
        for path in (out / rel, (out / rel).with_suffix(".npz")):
            if path.exists() and path.suffix in (".json", ".npz"):
                path.unlink()
    return index


def read_suite(directory, *, verify: bool = True) -> dict:
    """Read ``suite.json`` of a suite directory; with ``verify``, check every file's sha256.

    Raises
    ------
    ValueError
        For an unknown schema version, a missing field, a missing file, or a file whose
        checksum differs from the index (edited or corrupted after generation).
    """
    directory = Path(directory)
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
        if verify:
            file = directory / entry["path"]
            if not file.exists():
                raise ValueError(f"{where}: lists {entry['path']}, which does not exist")
            if sha256(file.read_bytes()) != entry["sha256"]:
                raise ValueError(f"{file}: checksum mismatch with suite.json (edited or corrupted after "
                                 f"generation; regenerate with refkv golden generate)")
    return index

