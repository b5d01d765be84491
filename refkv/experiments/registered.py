"""The registered verdict rule: from per-unit records to the verdict table, exactly as registered.

The design and its rule are fixed in ``docs/guide/registration.rst`` (machine-readable copy
``docs/experiment_registration.json``) before the run. This module applies that rule and
nothing else:

1. each primary comparison is tested on its units (prompts or texts), paired: passkey
   accuracy with the exact McNemar test and Newcombe's paired interval, perplexity and
   per-prompt measures with the paired t-test and its interval
   (:mod:`refkv.experiments.stats`);
2. p-values are Holm-adjusted within each claim (:func:`~refkv.experiments.stats.holm`);
3. the verdict is *holds* / *reversed* / *not resolved* from the adjusted p and the sign;
4. where the registration gives a paper effect, it is scaled to this model
   (:func:`paper_effect`) and the 95% interval is compared with it
   (:func:`versus_paper`).

The registration is passed in as a dict (the library never reads the docs folder).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..validation import shown
from .stats import Interval, holm, mcnemar_exact, newcombe_paired_difference, paired_t_test

__all__ = [
    "REGISTERED_HASHEVICT",
    "Comparison",
    "attention_loss_comparisons",
    "calibrated_length",
    "chosen_mat",
    "comparisons_from_units",
    "g1_all_queries",
    "geometry_comparisons",
    "mat_selection",
    "paper_effect",
    "passkey_comparisons",
    "perplexity_comparisons",
    "perplexity_design",
    "perplexity_token_losses",
    "read_registration",
    "step_losses",
    "unit_rows",
    "verdict_rows",
    "versus_paper",
]

#: HashEvict's registered hash seeds (the registration's ``hashevict_seeds``: 3), one side of H1 and A1.
REGISTERED_HASHEVICT = ("hashevict:seed=0", "hashevict:seed=1", "hashevict:seed=2")

#: Measures tested as paired binary outcomes; everything else is a paired mean.
BINARY_MEASURES = ("passkey accuracy",)

#: The claimed sides a registration may state.
DIRECTIONS = ("A - B > 0", "A - B < 0", "statistic > 0", "statistic < 0")
#: Largest registration file read, and most claims and comparisons per claim.
MAX_REGISTRATION_BYTES = 1 << 20
MAX_CLAIMS = 100


def read_registration(path) -> dict:
    """The registration file (``docs/experiment_registration.json``), read and validated.

    Read as every JSON input of refkv is (:func:`refkv.files.load_json`: a regular file of at
    most :data:`MAX_REGISTRATION_BYTES`, standard JSON without ``NaN``, depth-capped), then
    checked for every field the verdicts use: ``alpha`` a number in ``(0, 1)``,
    ``samples.passkey_ceiling_required`` in ``(0, 1]``, ``claims`` a non-empty list of at most
    :data:`MAX_CLAIMS` objects with distinct string ids, a known ``direction``
    (:data:`DIRECTIONS`), a string ``measure``, non-empty ``comparisons`` of ``[A, B]`` names
    (``B`` may be null), and a ``paper`` that is null or holds finite numbers.

    Raises
    ------
    ValueError
        One line naming the file and the key: ``REG.json: claims[2].id must be a non-empty string, got [1]``.
    """
    from ..files import load_json
    from ..validation import check_float

    reg = load_json(path, MAX_REGISTRATION_BYTES, what="registration file")

    def bad(key, what, value):
        return ValueError(f"{path}: {key} must be {what}, got {shown(value)}")

    def number(key, value, low=None, high=None, **open_):
        try:
            return check_float(key, value, low, high, **open_)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None

    if not isinstance(reg, dict):
        raise bad("the registration", "a JSON object", reg)
    number("alpha", reg.get("alpha"), 0.0, 1.0, low_open=True, high_open=True)
    samples = reg.get("samples")
    if not isinstance(samples, dict):
        raise bad("samples", "an object", samples)
    number("samples.passkey_ceiling_required", samples.get("passkey_ceiling_required"), 0.0, 1.0, low_open=True)
    claims = reg.get("claims")
    if not isinstance(claims, list) or not 1 <= len(claims) <= MAX_CLAIMS:
        raise bad("claims", f"a list of 1 to {MAX_CLAIMS} claims", claims)
    seen = set()
    for i, claim in enumerate(claims):
        key = f"claims[{i}]"
        if not isinstance(claim, dict):
            raise bad(key, "an object", claim)
        cid = claim.get("id")
        if not isinstance(cid, str) or not cid:
            raise bad(f"{key}.id", "a non-empty string", cid)
        if cid in seen:
            raise ValueError(f"{path}: {key}.id {cid!r} is given twice")
        seen.add(cid)
        if claim.get("direction") not in DIRECTIONS:
            raise bad(f"{key}.direction", f"one of {', '.join(map(repr, DIRECTIONS))}", claim.get("direction"))
        if not isinstance(claim.get("measure"), str):
            raise bad(f"{key}.measure", "a string", claim.get("measure"))
        pairs = claim.get("comparisons")
        if not isinstance(pairs, list) or not 1 <= len(pairs) <= MAX_CLAIMS or not all(
                isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
                and (pair[1] is None or isinstance(pair[1], str)) for pair in pairs):
            raise bad(f"{key}.comparisons", "a non-empty list of [A, B] names (B may be null)", pairs)
        _check_paper(claim.get("paper"), f"{key}.paper", number, bad)
    return reg


def _check_paper(paper, key: str, number, bad) -> None:
    """A claim's registered paper effect: null, or an object whose numbers are all finite."""
    if paper is None:
        return
    if not isinstance(paper, dict):
        raise bad(key, "an object or null", paper)
    for name in ("dense", "scale"):
        if name in paper:
            number(f"{key}.{name}", paper[name], 0.0 if name == "scale" else None, low_open=name == "scale")
    for name in ("values", "gaps"):
        table = paper.get(name)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise bad(f"{key}.{name}", "an object", table)
        for label, value in table.items():
            values = value if name == "gaps" and isinstance(value, list) and len(value) == 2 else [value]
            if name == "gaps" and len(values) != 2:
                raise bad(f"{key}.gaps.{label}", "[without, with]", value)
            for v in values:
                number(f"{key}.{name}.{label}", v)


@dataclass(frozen=True)
class Comparison:
    """The data of one registered primary comparison: A and B on the same units.

    Attributes
    ----------
    claim : str
        The claim's id in the registration (``"P1"``, ``"L1"``, ...).
    a, b : str
        The comparison's two sides, spelled as in the registration (``b`` is ``None`` for a
        one-sample statistic such as G1's correlation).
    a_values, b_values : (n,) arrays
        One value per unit, in the same unit order: booleans (answered correctly) for
        passkey accuracy, floats otherwise (per-text perplexity, per-prompt measure).
        ``b_values`` is ``None`` for a one-sample statistic.
    unit : str
        What one value is ("prompts" or "texts").
    reference : float or None
        The quantity a paper effect scales by: B's mean gap to the full cache (perplexity),
        or B's mean loss (attention loss); ``None`` where the effect needs no scaling.
    labels : tuple of str or None
        Each unit's name (``"pydoc_prose/3"`` for a text or the prompt it begins,
        ``"sample 12"`` for a passkey prompt), in the order of the values.
    full_values : (n,) array or None
        The full cache's per-text perplexity on the same units (perplexity claims), from
        which ``reference`` is computed; kept so the per-unit table can recompute it.
    """

    claim: str
    a: str
    b: str | None
    a_values: np.ndarray
    b_values: np.ndarray | None
    unit: str
    reference: float | None = None
    labels: tuple[str, ...] | None = None
    full_values: np.ndarray | None = None


def _direction(claim: dict) -> int:
    """+1 when the claim says the statistic is above 0, -1 when below."""
    return 1 if ">" in claim["direction"] else -1


def paper_effect(claim: dict, a: str, b: str | None, reference: float | None) -> float | None:
    """The registered paper effect of comparison (a, b) on this model's scale, or ``None``.

    The registration quotes the paper's own numbers; the effect is derived here by the
    arithmetic its ``kind`` states: an accuracy difference (``scale``); a fraction of B's
    gap to dense removed (``dense``), or of B's gap removed (``gaps``), carried over as
    minus that fraction times ``reference`` (B's mean gap here); a ratio of losses carried
    over as ``-(1 - ratio) x reference``; otherwise a difference carried over as it is.
    """
    paper = claim.get("paper")
    if not paper:
        return None
    key = a.split("@")[0]
    if "gaps" in paper:
        without, with_ = paper["gaps"][b]
        return -(without - with_) / without * _reference(reference, claim)
    values = paper["values"]
    if "dense" in paper:
        fraction = (values[key] - values[b]) / (paper["dense"] - values[b])
        return -fraction * _reference(reference, claim)
    if "scale" in paper:
        return (values[key] - values[b]) / paper["scale"]
    if claim["measure"] == "attention loss":
        return -(1 - values[key] / values[b]) * _reference(reference, claim)
    return values[key] - values[b]


def _reference(reference: float | None, claim: dict) -> float:
    if reference is None or not np.isfinite(reference):
        raise ValueError(f"claim {claim['id']}: its paper effect scales by B's mean gap or loss, "
                         f"which the comparison must give as a finite `reference`, got {reference!r}")
    return float(reference)


def versus_paper(interval: Interval, effect: float | None, direction: int) -> str:
    """Where the 95% interval lies against the scaled paper effect (the registered wording).

    On the claimed side (``direction`` +1 above 0, -1 below): *larger than the paper* when
    the whole interval lies beyond the effect, *smaller than the paper* when it lies wholly
    short of it, *consistent with the paper* when it contains it; empty without an effect.
    """
    if effect is None:
        return ""
    low, high = sorted((direction * interval.low, direction * interval.high))
    target = direction * effect
    if low > target:
        return "larger than the paper"
    if high < target:
        return "smaller than the paper"
    return "consistent with the paper"


def _test(claim: dict, comparison: Comparison) -> tuple[Interval, float]:
    a = np.asarray(comparison.a_values)
    if claim["measure"] in BINARY_MEASURES:
        b = np.asarray(comparison.b_values)
        return newcombe_paired_difference(a, b), mcnemar_exact(a, b)[2]
    b = np.zeros(a.shape) if comparison.b_values is None else np.asarray(comparison.b_values, dtype=float)
    return paired_t_test(np.asarray(a, dtype=float), b)


def verdict_rows(registration: dict, comparisons: list[Comparison], *, alpha: float | None = None) -> list[dict]:
    """The verdict table by the registered rule, one row per comparison, claims in registered order.

    Parameters
    ----------
    registration : dict
        The parsed registration (its ``claims`` and ``alpha``).
    comparisons : list of Comparison
        The data of the primary comparisons that were run. Every comparison must be
        registered; a registered comparison missing from the list is left out of the table
        (the page says which were not run).

    Returns
    -------
    list of dict
        ``claim, a, b, n, unit, estimate, low, high, p, p_holm, verdict, paper_effect,
        versus_paper`` per comparison; Holm's adjustment runs over the comparisons of a claim
        that are present.
    """
    alpha = registration["alpha"] if alpha is None else alpha
    claims = {claim["id"]: claim for claim in registration["claims"]}
    by_claim: dict[str, list[Comparison]] = {}
    for comparison in comparisons:
        claim = claims.get(comparison.claim)
        if claim is None:
            raise ValueError(f"comparison {comparison.a} vs {comparison.b}: claim {comparison.claim!r} "
                             f"is not registered (registered: {sorted(claims)})")
        if [comparison.a, comparison.b] not in [list(pair) for pair in claim["comparisons"]]:
            raise ValueError(f"claim {comparison.claim}: {comparison.a} vs {comparison.b} is not one of "
                             f"its registered comparisons {claim['comparisons']}")
        by_claim.setdefault(comparison.claim, []).append(comparison)
    rows = []
    for claim_id, claim in claims.items():
        present = by_claim.get(claim_id, [])
        if not present:
            continue
        tested = [_test(claim, comparison) for comparison in present]
        adjusted = holm([p for _, p in tested])
        direction = _direction(claim)
        for comparison, (interval, p), p_holm in zip(present, tested, adjusted):
            if p_holm < alpha:
                verdict = "holds" if direction * interval.estimate > 0 else "reversed"
            else:
                verdict = "not resolved"
            effect = paper_effect(claim, comparison.a, comparison.b, comparison.reference)
            rows.append({"claim": claim_id, "a": comparison.a, "b": comparison.b or "", "n": interval.n,
                         "unit": comparison.unit, "estimate": interval.estimate, "low": interval.low,
                         "high": interval.high, "p": p, "p_holm": float(p_holm), "verdict": verdict,
                         "paper_effect": effect, "versus_paper": versus_paper(interval, effect, direction)})
    return rows


# -- from records to comparisons ----------------------------------------------------------------
def _labels(units: list[tuple[str, int]]) -> tuple[str, ...]:
    return tuple(f"{source}/{segment}" for source, segment in units)


def _registered(records: list[dict]) -> list[dict]:
    return [r for r in records if r["params"].get("design") == "registered" and "skipped" not in r["result"]]


def calibrated_length(records: list[dict], registration: dict) -> tuple[int | None, dict[int, tuple[int, int]]]:
    """The registered passkey length: the largest calibration length at which the full cache
    answered at least the registered ceiling (e.g. 57 of 60); ``None`` if none did.

    Returns the length and, per length, ``(correct, prompts)`` of the calibration.
    """
    need = registration["samples"]["passkey_ceiling_required"]
    tally: dict[int, list[int]] = {}
    for r in _registered(records):
        if r["params"].get("purpose") == "calibration":
            counts = tally.setdefault(r["params"]["length"], [0, 0])
            counts[0] += bool(r["result"]["correct"])
            counts[1] += 1
    passing = [length for length, (right, n) in tally.items() if n and right / n >= need]
    return (max(passing) if passing else None), {k: (v[0], v[1]) for k, v in sorted(tally.items())}


def passkey_comparisons(records: list[dict]) -> list[Comparison]:
    """Claims P1 (KeyDiff vs each attention-based policy, blocks) and P2 (each attention-based
    policy one-shot vs blocks) from the registered test records, paired by prompt."""
    answers: dict[tuple, dict[int, bool]] = {}      # (policy, block) -> {sample: correct}
    for r in _registered(records):
        p = r["params"]
        if p.get("purpose") == "test" and p["policy"] != "full":
            answers.setdefault((p["policy"], p["block"]), {})[p["sample"]] = bool(r["result"]["correct"])
    blocked = {policy: block for policy, block in answers if block is not None}

    def pair(claim, a_name, a_key, b_name, b_key):
        if a_key not in answers or b_key not in answers:
            return None
        prompts = sorted(set(answers[a_key]) & set(answers[b_key]))
        return Comparison(claim, a_name, b_name, np.array([answers[a_key][q] for q in prompts]),
                          np.array([answers[b_key][q] for q in prompts]), "prompts",
                          labels=tuple(f"sample {q}" for q in prompts))

    out = []
    for other in ("snapkv", "tova", "h2o"):
        if "keydiff" in blocked and other in blocked:
            out.append(pair("P1", "keydiff", ("keydiff", blocked["keydiff"]), other, (other, blocked[other])))
    for policy in ("snapkv", "tova", "h2o"):
        if policy in blocked:
            out.append(pair("P2", f"{policy}@oneshot", (policy, None), f"{policy}@blocks", (policy, blocked[policy])))
    return [c for c in out if c is not None]


def _per_text_ppl(records: list[dict], policy: str, block: int) -> dict[tuple, float]:
    return {(r["params"]["text"], r["params"]["segment"]): r["result"]["ppl"] for r in _registered(records)
            if r["params"]["policy"] == policy and r["params"]["block"] == block}


def chosen_mat(records: list[dict]) -> str | None:
    """MAT's spec with the lowest mean per-text perplexity on the selection texts (the only
    records of MAT in blocks); ties go to the spec that sorts first."""
    means = mat_selection(records)
    return min(sorted(means), key=lambda spec: means[spec][0]) if means else None


def mat_selection(records: list[dict]) -> dict[str, tuple[float, int]]:
    """``{spec: (mean per-text perplexity, texts)}`` of every MAT spec on the selection texts,
    the table :func:`chosen_mat` chooses from."""
    from .perplexity import REGISTERED_BLOCK

    ppl: dict[str, list[float]] = {}
    for r in _registered(records):
        p = r["params"]
        if p["policy"].startswith("mat") and p["block"] == REGISTERED_BLOCK:
            ppl.setdefault(p["policy"], []).append(r["result"]["ppl"])
    return {spec: (float(np.mean(values)), len(values)) for spec, values in ppl.items()}


def perplexity_design(records: list[dict]) -> list[tuple[str, str, tuple[str, ...], str, tuple[str, ...], int]]:
    """The registered perplexity comparisons as ``(claim, a, a_runs, b, b_runs, block)``.

    ``a_runs`` and ``b_runs`` are the policy specs whose runs make one side (HashEvict's
    registered hash seeds, averaged per text; one spec otherwise); ``block`` is the prefill
    block both sides ran with. M1 is absent until :func:`chosen_mat` has MAT's selection records.
    """
    from .perplexity import REGISTERED_BLOCK

    design = [("L1", "keydiff", ("keydiff",), other, (other,), REGISTERED_BLOCK) for other in ("snapkv", "tova", "h2o")]
    design += [("C1", f"caote:base={base}", (f"caote:base={base}",), base, (base,), REGISTERED_BLOCK)
               for base in ("h2o", "tova", "snapkv")]
    design.append(("H1", "hashevict", REGISTERED_HASHEVICT, "knorm:recent=10,sink=4", ("knorm:recent=10,sink=4",), 1))
    mat = chosen_mat(records)
    if mat is not None:
        design.append(("M1", "mat@selected", (mat,), "sink", ("sink",), 1))
    return design


def perplexity_comparisons(records: list[dict]) -> list[Comparison]:
    """Claims L1, C1, H1 and M1 from the registered perplexity records, paired by text.

    Each unit is a verdict text; ``reference`` is B's mean per-text gap to the full cache on
    the same texts (what a paper's fraction of a gap scales). HashEvict's per-text value is
    its mean over the registered seeds; MAT is the spec :func:`chosen_mat` picks
    (:func:`perplexity_design`).
    """
    from .perplexity import REGISTERED_BLOCK, registered_texts

    texts = registered_texts("verdict")
    full = _per_text_ppl(records, "full", REGISTERED_BLOCK)

    def side(runs, block):
        if len(runs) == 1:
            return _per_text_ppl(records, runs[0], block)
        per_run = [_per_text_ppl(records, run, block) for run in runs]
        return {t: float(np.mean([run[t] for run in per_run])) for t in texts if all(t in run for run in per_run)}

    out = []
    for claim, a_name, a_runs, b_name, b_runs, block in perplexity_design(records):
        a, b = side(a_runs, block), side(b_runs, block)
        units = [t for t in texts if t in a and t in b and t in full]
        if len(units) < 2:
            continue
        b_values = np.array([b[t] for t in units])
        full_values = np.array([full[t] for t in units])
        out.append(Comparison(claim, a_name, b_name, np.array([a[t] for t in units]), b_values, "texts",
                              float(np.mean(b_values - full_values)), _labels(units), full_values))
    return out


def perplexity_token_losses(records: list[dict], comparison: Comparison) -> tuple[np.ndarray, np.ndarray]:
    """The token losses of a perplexity comparison's two sides on its texts, each text its own
    document: ``(runs, texts, 1, tokens)`` arrays, the input of the registered two-stage
    bootstrap (:func:`refkv.experiments.phase2_analysis.document_bootstrap`)."""
    design = {(claim, a, b): (a_runs, b_runs, block) for claim, a, a_runs, b, b_runs, block
              in perplexity_design(records)}
    a_runs, b_runs, block = design[(comparison.claim, comparison.a, comparison.b)]
    units = [tuple(label.rsplit("/", 1)) for label in comparison.labels]
    nll = {}
    for r in _registered(records):
        p = r["params"]
        if p["block"] == block:
            nll[(p["policy"], p["text"], str(p["segment"]))] = r["result"]["nll"]
    out = []
    for runs in (a_runs, b_runs):
        array = [[[nll[(run, text, segment)]] for text, segment in units] for run in runs]
        lengths = {len(window[0]) for run in array for window in run}
        if len(lengths) != 1:
            raise ValueError(f"{comparison.claim} {comparison.a} vs {comparison.b}: the texts' token losses have "
                             f"lengths {sorted(lengths)}; the bootstrap needs one length")
        out.append(np.array(array, dtype=float))                      # (runs, texts, 1, tokens)
    return out[0], out[1]


# -- the per-prompt claims (A1, G1, G2, S1) -----------------------------------------------------
def _prompt_values(records: list[dict], kind: str, value) -> dict[str, dict[tuple, float]]:
    """``{policy or "": {(text, segment): value(result)}}`` of the registered cells of ``kind``."""
    out: dict[str, dict[tuple, float]] = {}
    for r in _registered(records):
        p = r["params"]
        if p.get("kind") == kind:
            out.setdefault(p.get("policy", ""), {})[(p["text"], p["segment"])] = float(value(r["result"]))
    return out


def _paired(claim: str, a_name: str, a: dict, b_name: str | None, b: dict | None, *,
            reference: bool = False) -> Comparison | None:
    """A and B on the prompts both ran, in the registered prompts' order (``b`` None: one sample);
    ``reference``: B's mean over those prompts (what a loss ratio scales)."""
    from .perplexity import registered_texts

    units = [t for t in registered_texts("verdict") if t in a and (b is None or t in b)]
    if len(units) < 2:
        return None
    b_values = None if b is None else np.array([b[t] for t in units])
    return Comparison(claim, a_name, b_name, np.array([a[t] for t in units]), b_values, "prompts",
                      float(np.mean(b_values)) if reference else None, _labels(units))


def step_losses(records: list[dict]) -> dict[str, dict[tuple, float]]:
    """``{policy: {(text, segment): mean_loss}}`` of the registered attention-loss cells that ran."""
    return _prompt_values(records, "step_loss", lambda result: result["mean_loss"])


def attention_loss_comparisons(records: list[dict]) -> list[Comparison]:
    """Claim A1 from the registered per-step attention-loss records, paired by prompt.

    A prompt's value is the cell's ``mean_loss`` (over steps, KV heads and layers);
    HashEvict's is the mean over its registered seeds (the seed is a nuisance, the prompt
    the unit). ``reference`` is B's mean loss, which HashEvict Table 3's ratios scale.
    """
    from .attention_loss import REGISTERED_STEP_POLICIES

    loss = step_losses(records)
    seeds = [policy for policy in REGISTERED_STEP_POLICIES if policy.startswith("hashevict")]
    hashevict = {t: float(np.mean([loss[s][t] for s in seeds])) for t in loss.get(seeds[0], {})
                 if all(t in loss.get(s, {}) for s in seeds)}
    out = [_paired("A1", "hashevict", hashevict, "knorm", loss.get("knorm", {}), reference=True),
           _paired("A1", "h2o", loss.get("h2o", {}), "hashevict", hashevict, reference=True)]
    return [c for c in out if c is not None]


def geometry_comparisons(records: list[dict]) -> list[Comparison]:
    """Claims G1, S1 and G2 from the registered geometry records, one value per prompt.

    * G1: the Spearman correlation between a key's cosine similarity to the mean (unit) key
      and the attention it receives, on the common query set of
      :func:`~refkv.experiments.geometry.common_query_statistics` (the last 25% of queries
      against the first 75% of keys, so the attention is not confounded by position), mean
      over layers and KV heads. The cell stores it for *distinctiveness* (minus the mean
      cosine to the other keys, which ranks keys exactly as minus the cosine to the mean unit
      key), so the registered statistic is its negative.
    * S1: Pearson r between attention and inverted Hamming distance at 32 and at 8 bits,
      mean over layers and query heads.
    * G2: the mean over layers and KV heads of ``log det(K^T K)`` of the kept keys.
    """
    from .geometry import REGISTERED_RETENTION_POLICIES

    cosine = _prompt_values(records, "cosine",
                            lambda result: -np.nanmean(np.asarray(result["common_queries"]["spearman"], float)))
    pearson = {bits: _prompt_values(records, "hamming",
                                    lambda result, b=bits: np.nanmean(np.asarray(result["pearson"][str(b)], float)))
               for bits in (32, 8)}
    volume = _prompt_values(records, "retention", lambda result: np.mean(np.asarray(result["log_volume"], float)))
    out = [_paired("G1", "spearman", cosine.get("", {}), None, None),
           _paired("S1", "bits=32", pearson[32].get("", {}), "bits=8", pearson[8].get("", {}))]
    out += [_paired("G2", "keydiff", volume.get("keydiff", {}), other, volume.get(other, {}))
            for other in REGISTERED_RETENTION_POLICIES if other != "keydiff"]
    return [c for c in out if c is not None]


def g1_all_queries(records: list[dict]) -> Comparison | None:
    """G1's all-queries statistic, the display the registration promised beside G1 (no verdict).

    As G1 (:func:`geometry_comparisons`), but with the mean attention a key receives from every
    query that sees it rather than from the common query set (the last 25% of queries against
    the first 75% of keys), so position is not held apart from distinctiveness. The cell
    stores the Spearman correlation of *distinctiveness* (minus the cosine to the mean unit
    key) with that attention, per layer and KV head, as ``spearman_anchor``; the prompt's
    value is minus its mean, so the sign reads as G1's. None without 2 prompts.
    """
    anchor = _prompt_values(records, "cosine",
                            lambda result: -np.nanmean(np.asarray(result["spearman_anchor"], float)))
    return _paired("G1-all", "spearman_all", anchor.get("", {}), None, None)


# -- the per-unit table, and back ----------------------------------------------------------------
UNIT_COLUMNS = ["claim", "a", "b", "unit", "value_a", "value_b", "value_full"]


def unit_rows(comparisons: list[Comparison]) -> list[dict]:
    """One row per comparison and unit: everything :func:`verdict_rows` needs, at full
    precision (``repr`` of each float), so the verdict table can be recomputed from it alone
    (:func:`comparisons_from_units`)."""
    def text(x):
        if x is None:
            return None
        return str(bool(x)) if isinstance(x, (bool, np.bool_)) else repr(float(x))

    rows = []
    for c in comparisons:
        labels = c.labels or tuple(str(i) for i in range(len(c.a_values)))
        for i, label in enumerate(labels):
            rows.append({"claim": c.claim, "a": c.a, "b": c.b, "unit": label, "value_a": text(c.a_values[i]),
                         "value_b": None if c.b_values is None else text(c.b_values[i]),
                         "value_full": None if c.full_values is None else text(c.full_values[i])})
    return rows


def comparisons_from_units(rows: list[dict], registration: dict) -> list[Comparison]:
    """The comparisons of a per-unit table (:func:`unit_rows`, read back as strings), in its
    order, with each ``reference`` recomputed as the records' code computes it: B's mean gap
    to the full cache where the full cache's values are given, B's mean for an attention
    loss, none otherwise."""
    claims = {claim["id"]: claim for claim in registration["claims"]}
    grouped: dict[tuple, list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["claim"], row["a"], row["b"] or None), []).append(row)
    out = []
    for (claim_id, a, b), group in grouped.items():
        claim = claims[claim_id]
        if claim["measure"] in BINARY_MEASURES:
            def parse(x):
                return x == "True"
        else:
            parse = float
        a_values = np.array([parse(r["value_a"]) for r in group])
        b_values = None if b is None else np.array([parse(r["value_b"]) for r in group])
        full = (np.array([float(r["value_full"]) for r in group]) if all(r.get("value_full") for r in group)
                else None)
        if full is not None:
            reference = float(np.mean(b_values - full))
        elif claim["measure"] == "attention loss":
            reference = float(np.mean(b_values))
        else:
            reference = None
        unit = "texts" if claim["measure"] == "perplexity" else "prompts"
        out.append(Comparison(claim_id, a, b, a_values, b_values, unit, reference,
                              tuple(r["unit"] for r in group), full))
    return out
