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

from .stats import Interval, holm, mcnemar_exact, newcombe_paired_difference, paired_t_test

__all__ = [
    "Comparison",
    "calibrated_length",
    "chosen_mat",
    "paper_effect",
    "passkey_comparisons",
    "perplexity_comparisons",
    "verdict_rows",
    "versus_paper",
]

#: Measures tested as paired binary outcomes; everything else is a paired mean.
BINARY_MEASURES = ("passkey accuracy",)


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
    """

    claim: str
    a: str
    b: str | None
    a_values: np.ndarray
    b_values: np.ndarray | None
    unit: str
    reference: float | None = None


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
                          np.array([answers[b_key][q] for q in prompts]), "prompts")

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
    from .perplexity import REGISTERED_BLOCK

    means = {}
    for r in _registered(records):
        p = r["params"]
        if p["policy"].startswith("mat") and p["block"] == REGISTERED_BLOCK:
            means.setdefault(p["policy"], []).append(r["result"]["ppl"])
    return min(sorted(means), key=lambda spec: float(np.mean(means[spec]))) if means else None


def perplexity_comparisons(records: list[dict]) -> list[Comparison]:
    """Claims L1, C1, H1 and M1 from the registered perplexity records, paired by text.

    Each unit is a verdict text; ``reference`` is B's mean per-text gap to the full cache on
    the same texts (what a paper's fraction of a gap scales). HashEvict's per-text value is
    its mean over the registered seeds; MAT is the spec :func:`chosen_mat` picks.
    """
    from .perplexity import REGISTERED_BLOCK, registered_texts

    texts = registered_texts("verdict")
    full = _per_text_ppl(records, "full", REGISTERED_BLOCK)

    def side(policy, block):
        if policy == "hashevict":
            seeds = [_per_text_ppl(records, f"hashevict:seed={s}", block) for s in range(3)]
            return {t: float(np.mean([seed[t] for seed in seeds])) for t in texts if all(t in seed for seed in seeds)}
        return _per_text_ppl(records, policy, block)

    def pair(claim, a_name, a, b_name, b):
        units = [t for t in texts if t in a and t in b and t in full]
        if len(units) < 2:
            return None
        b_values = np.array([b[t] for t in units])
        reference = float(np.mean(b_values - np.array([full[t] for t in units])))
        return Comparison(claim, a_name, b_name, np.array([a[t] for t in units]), b_values, "texts", reference)

    out = []
    for other in ("snapkv", "tova", "h2o"):
        out.append(pair("L1", "keydiff", side("keydiff", REGISTERED_BLOCK), other, side(other, REGISTERED_BLOCK)))
    for base in ("h2o", "tova", "snapkv"):
        out.append(pair("C1", f"caote:base={base}", side(f"caote:base={base}", REGISTERED_BLOCK), base,
                        side(base, REGISTERED_BLOCK)))
    out.append(pair("H1", "hashevict", side("hashevict", 1), "knorm:recent=10,sink=4",
                    side("knorm:recent=10,sink=4", 1)))
    mat = chosen_mat(records)
    if mat is not None:
        out.append(pair("M1", "mat@selected", side(mat, 1), "sink", side("sink", 1)))
    return [c for c in out if c is not None]
