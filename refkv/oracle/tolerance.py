"""Every tolerance of the oracle: the rules, what each is for, and the precision they derive from.

==============================  ==============================================================
rule                            what it is for
==============================  ==============================================================
:func:`score_tolerance`         checking a candidate's scores and kept tokens against a
                                vectors case: a per-score tolerance derived from the dtype the
                                candidate computed in (below)
:data:`DEFAULT_TOLERANCE`,      the ``tolerance`` a vectors case states (``rtol`` by dtype,
:func:`tolerance_for`           ``atol`` scaled by the scores): what the file tells a reader
                                who compares by hand, and the scale of the ``near-tie`` flag
:data:`DEFAULT_E2E_TOLERANCE`,  the ``tolerance`` an end-to-end golden states for its logits,
:func:`e2e_tolerance`           scores and fingerprints (a whole model runs: looser)
:func:`e2e_rtol`,               that stated ``rtol`` for the candidate's dtype: kept for the
:data:`E2E_RTOL`                same or a finer dtype, measured for bfloat16 and float16
                                (the model's amplification of their rounding, times 4)
:func:`scaled_atol`             a stated ``atol`` scaled as its ``rtol`` was (fingerprints)
:func:`decision_tolerance`      per-candidate tolerance of one end-to-end decision's scores,
                                from that ``rtol`` (and :func:`score_tolerance`'s fallback for
                                a policy this process does not know)
:func:`scale_floor`             ``max(1, largest finite |value|)``: the scale of every
                                absolute tolerance above that is not per value
:func:`tie_rule_meaningless`    whether a tolerance is so wide that any swap is a tie
:func:`tolerance_rule`          how a report names the rule that accepted a tie
==============================  ==============================================================

The derivation of :func:`score_tolerance` is in ``docs/oracle/tolerances.rst``; in short:

* A candidate computing in a dtype with unit roundoff ``u`` (:data:`UNIT_ROUNDOFF`)
  rounds its inputs to that dtype (a relative error ``<= u`` per element) and then
  evaluates dot products of length ``d``, softmax normalisations over ``n`` tokens, sums
  over the ``g * B`` queries of a KV head's group and norms. These are backward stable:
  with a tree (pairwise or blocked) reduction, what the candidate computes is the exact
  function of inputs perturbed relatively by at most ``eta`` (:func:`backward_error`),
  ``eta = u * (2 + sum of ceil(log2 m))`` over the reductions it evaluates on what the
  case stores (:func:`reductions`: ``d``, ``n``, ``g B``).
* How far that moves each score is the score's own conditioning at this case. It is
  measured with the reference policy itself, in float64: the inputs rounded to the
  candidate's dtype (exactly what an emulated kernel does), all inputs scaled by
  ``1 + eta`` (exact first-order bound for scores that are non-negative combinations of
  attention weights), and :data:`RANDOM_TRIALS` seeded random-sign perturbations of size
  ``eta`` (doubled, as random signs estimate a worst case from below).
* ``tol_i = max(rounding, positive, 2 * random signs) + eta |s_i| + (eta / u) tiny / 2
  + |s_i(float64) - s_i(reference)|``: the perturbations, the forward rounding of the
  score's own last operations, the absolute rounding of subnormal results (``tiny``, the
  dtype's smallest subnormal, half a spacing per rounding step) and the reference's own
  rounding (for float32 cases).

So the tolerance of a score is at the score's own scale (``|s_i|`` for an attention
weight, the cosine's computation scale for a cosine near zero), never
``max(1, max |s|)``, and a swap of two tokens is a tie only when
``|s_i - s_j| <= tol_i + tol_j``.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..validation import check_choice

__all__ = [
    "DEFAULT_E2E_TOLERANCE",
    "DEFAULT_TOLERANCE",
    "DTYPES",
    "E2E_MARGIN",
    "E2E_RTOL",
    "RANDOM_TRIALS",
    "SMALLEST_SUBNORMAL",
    "UNIT_ROUNDOFF",
    "backward_error",
    "check_dtype_name",
    "decision_tolerance",
    "e2e_rtol",
    "e2e_tolerance",
    "reductions",
    "round_to",
    "scale_floor",
    "scaled_atol",
    "score_tolerance",
    "tie_rule_meaningless",
    "tolerance_for",
    "tolerance_rule",
]

#: Unit roundoff ``u`` (half the machine epsilon) of each dtype a candidate may declare.
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
DTYPES = tuple(UNIT_ROUNDOFF)
#: Smallest positive (subnormal) number of each dtype: rounding near zero has an absolute
#: error of up to half of it (the standard model's underflow term).
SMALLEST_SUBNORMAL = {"float64": 2.0 ** -1074, "float32": 2.0 ** -149, "bfloat16": 2.0 ** -133, "float16": 2.0 ** -24}
#: Seeded random-sign perturbations per case (besides the rounding and the all-positive one).
RANDOM_TRIALS = 4
#: ``rtol`` a vectors case states, per dtype; its ``atol`` is the same number times the
#: scores' :func:`scale_floor` (see :func:`tolerance_for`).
DEFAULT_TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
#: ``rtol`` an end-to-end golden states for its logits, scores and fingerprints, per dtype
#: (a whole model runs before each value: looser than :data:`DEFAULT_TOLERANCE`); ``atol`` as
#: there (see :func:`e2e_tolerance`).
DEFAULT_E2E_TOLERANCE = {"float64": 1e-8, "float32": 1e-4}

#: ``rtol`` of an end-to-end check for a candidate computing in bfloat16 or float16 (a
#: float32 or float64 golden): :data:`E2E_MARGIN` times the largest deviation of what the
#: check compares (eviction scores at their decision's scale, key fingerprints, logits)
#: measured between a float64 and a bfloat16 / float16 run of the same model and prompt in
#: ``transformers`` (:mod:`refkv.interop.kvpress.amplification`; ``docs/oracle/tolerances.rst``
#: has the table). ``built-in``: the oracle's tiny models (tiny, llama3, qwen2, qwen3 at 48 and
#: 200 tokens: largest 0.062 in bfloat16, 0.0177 in float16); ``checkpoint``: a real model
#: (SmolLM2-135M at 256 tokens of prose: 0.657 and 0.0654, its attention weights in 30 layers
#: deviating by up to two thirds of their row's median). Scaling the float32 goldens' rtol by
#: the ratio of unit roundoffs instead gave 6.55 in bfloat16, so wide that every swap was a tie.
E2E_RTOL = {"built-in": {"bfloat16": 0.25, "float16": 0.071},
            "checkpoint": {"bfloat16": 2.7, "float16": 0.27}}
#: The margin of :data:`E2E_RTOL` over the measured deviation (prompts and checkpoints not
#: measured move differently; the float32 goldens' 1e-4 is 3.8 times SmolLM2's float32 deviation).
E2E_MARGIN = 4

_BF16_MAX = (2.0 - 2.0 ** -7) * 2.0 ** 127


def check_dtype_name(dtype) -> str | None:
    """``dtype`` as one of :data:`DTYPES` (NumPy dtypes and ``"bf16"``-style names accepted), or None."""
    if dtype is None:
        return None
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "fp64": "float64",
               "single": "float32", "double": "float64"}
    name = str(dtype).removeprefix("torch.")
    try:
        name = np.dtype(name).name
    except TypeError:
        pass
    return check_choice("dtype", aliases.get(name, name), DTYPES)


def round_to(x, dtype) -> np.ndarray:
    """Round float data to the precision of ``dtype``, in pure NumPy.

    Parameters
    ----------
    x : array_like
        Float data (any float dtype; integers are converted).
    dtype : {"bfloat16", "float16", "float32", "float64"}

    Returns
    -------
    ndarray
        float32 for bfloat16, float16 and float32 (the values are exact there), float64
        for float64. Rounding is to nearest, ties to even, with bfloat16's and float16's
        exponent ranges: overflow gives infinity, tiny values round to their subnormals.
        NaN stays NaN.

    Examples
    --------
    >>> import numpy as np
    >>> from refkv.testing import round_to
    >>> round_to(np.array([1 + 2**-9, 1 + 3 * 2**-9, 70000.0]), "bfloat16").tolist()
    [1.0, 1.0078125, 70144.0]
    >>> round_to(np.array([70000.0]), "float16").tolist()
    [inf]
    """
    name = check_dtype_name(dtype)
    a = np.asarray(x, dtype=np.float64)
    if name == "float64":
        return a.copy()
    if name == "float32":
        return a.astype(np.float32)
    if name == "float16":
        with np.errstate(over="ignore"):
            return a.astype(np.float16).astype(np.float32)
    # bfloat16: 8 significant bits, float32's exponent range (subnormal step 2**-133).
    with np.errstate(over="ignore", invalid="ignore"):
        _, e = np.frexp(a)
        step = np.ldexp(1.0, np.maximum(e, -125) - 8)
        out = np.round(a / step) * step  # np.round: half to even
        out = np.where(np.abs(out) > _BF16_MAX, np.copysign(np.inf, a), out)
        out = np.where(np.isfinite(a), out, a)
    return out.astype(np.float32)


def reductions(case) -> tuple[int, ...]:
    """Lengths of the reductions a candidate evaluates on what ``case`` stores.

    Keys or values stored: norms and dot products (``d``) and means over the tokens
    (``n``); queries stored: the candidate computes attention itself (``d``, ``n``) and
    sums it over the group's queries (``g B``); attention stored: only that last sum.
    """
    s = case.sizes
    d, n, gb = s["d_head"], s["n"], (s["n_heads"] // s["n_kv_heads"]) * s["block"]
    lengths = set()
    stored = set(case.inputs)
    if stored & {"keys", "values", "block_keys", "block_values", "queries"}:
        lengths.update(("d", "n"))
    if stored & {"queries", "attention"}:
        lengths.add("gB")
    return tuple(sorted({"d": d, "n": n, "gB": gb}[k] for k in lengths))


def backward_error(dtype, lengths=()) -> float:
    """``eta``: relative input perturbation equivalent to computing in ``dtype``.

    ``u`` times: one rounding of each input, one of each elementwise operation (exp,
    division, the output), and ``ceil(log2 m)`` for a tree reduction of each length
    ``m`` in ``lengths`` (:func:`reductions`).
    """
    u = UNIT_ROUNDOFF[check_dtype_name(dtype)]
    return u * (2 + sum(math.ceil(math.log2(max(int(m), 1))) for m in lengths))


def _float_inputs(case, transform):
    """The case with every float input and field replaced by ``transform(name, float64 array)``."""
    def conv(name, a):
        return transform(name, a.astype(np.float64)) if a.dtype.kind == "f" else a
    inputs = {k: conv(k, v) for k, v in case.inputs.items()}
    fields = {k: conv("fields." + k, v) for k, v in case.fields.items()}
    return replace(case, dtype="float64", inputs=inputs, fields=fields)


def _scores(policy, case) -> np.ndarray | None:
    try:
        with np.errstate(all="ignore"):
            return np.asarray(policy.score(case.view()), dtype=np.float64)
    except (ValueError, FloatingPointError, ZeroDivisionError):
        return None


def score_tolerance(case, dtype=None) -> np.ndarray:
    """Per-score tolerance ``(Hkv, n)`` of a candidate computing ``case`` in ``dtype``.

    Parameters
    ----------
    case : refkv.oracle.VectorCase
        A reference case (its inputs and its policy).
    dtype : str, optional
        The candidate's precision (:data:`DTYPES`); default the case's own dtype.

    Returns
    -------
    ndarray of float64, the shape of ``case.outputs["scores"]``; 0 where the reference
    score is not finite (those must match exactly).
    """
    name = check_dtype_name(dtype) or case.dtype
    u = UNIT_ROUNDOFF[name]
    eta = backward_error(name, reductions(case))
    ref = np.asarray(case.outputs["scores"], dtype=np.float64)
    try:
        policy = case.policy()
    except (ValueError, TypeError):
        # A policy this process does not know: no reference code to measure the
        # conditioning with, so the magnitude model of end-to-end goldens, with a
        # doubled eta (e2e goldens store no inputs either).
        rows = [decision_tolerance(row, 2.0 * eta) for row in ref]
        return np.stack(rows) + u * np.where(np.isfinite(ref), np.abs(ref), 0.0) if rows else np.zeros(ref.shape)
    base = _scores(policy, _float_inputs(case, lambda _, a: a))
    if base is None or base.shape != ref.shape:
        base = ref
    finite = np.isfinite(ref) & np.isfinite(base)

    def deviation(transform) -> np.ndarray:
        got = _scores(policy, _float_inputs(case, transform))
        if got is None or got.shape != ref.shape:
            return np.zeros(ref.shape)
        with np.errstate(invalid="ignore"):
            dev = np.abs(got - base)
        return np.where(finite & np.isfinite(dev), dev, 0.0)

    rounded = deviation(lambda _, a: round_to(a, name).astype(np.float64))
    positive = deviation(lambda _, a: a * (1.0 + eta))
    signed = np.zeros(ref.shape)
    seed = [int(case.id), DTYPES.index(name), sum(map(ord, case.policy_name))]
    rng = np.random.default_rng(seed)
    for _ in range(RANDOM_TRIALS):
        signs = {}

        def random_sign(key, a, signs=signs):
            signs.setdefault(key, rng.choice([-1.0, 1.0], size=a.shape))
            return a * (1.0 + eta * signs[key])
        signed = np.maximum(signed, deviation(random_sign))
    with np.errstate(invalid="ignore"):
        own = np.where(finite, np.abs(base - ref), 0.0)
        # The score's own last operations (a division by a norm product, a square root, a
        # normalisation) each round relatively: a forward error of up to eta |s_i|. The
        # input perturbations above cannot show it when the score is invariant to them
        # (a key's cosine with an anchor made of that key alone is exactly -1 under any
        # perturbation of the shared key, yet a bf16 kernel returns -1.0078).
        # Below the smallest normal number rounding is absolute: each of the eta / u rounding
        # steps can lose up to half a subnormal spacing (float16: 2**-25), whatever |s_i| is.
        output = eta * np.where(finite, np.abs(ref), 0.0) + 0.5 * (eta / u) * SMALLEST_SUBNORMAL[name]
        tol = np.maximum.reduce([rounded, positive, 2.0 * signed]) + output + own
    return np.where(np.isfinite(ref), tol, 0.0)


def scale_floor(values) -> float:
    """``max(1, largest finite |value|)`` (1 when none is finite): the scale of an absolute tolerance.

    A value near zero is computed from values of order one or of the largest one (a cosine
    close to 0 has an error of order ``eps * 1``, not ``eps * |cos|``).
    """
    v = np.abs(np.asarray(values, dtype=np.float64))
    v = v[np.isfinite(v)]
    return max(1.0, float(v.max())) if v.size else 1.0


def tolerance_for(dtype, scores: np.ndarray) -> dict:
    """The tolerance a vectors case states: ``rtol`` from :data:`DEFAULT_TOLERANCE` by dtype,
    ``atol = rtol * scale_floor(scores)``."""
    rtol = DEFAULT_TOLERANCE[np.dtype(dtype).name]
    return {"rtol": rtol, "atol": rtol * scale_floor(scores)}


def e2e_tolerance(dtype, values) -> dict:
    """The tolerance an end-to-end golden states for ``values`` (its logits, scores or
    fingerprints): ``rtol`` from :data:`DEFAULT_E2E_TOLERANCE`, ``atol = rtol * scale_floor(values)``."""
    rtol = DEFAULT_E2E_TOLERANCE[np.dtype(dtype).name]
    return {"rtol": rtol, "atol": rtol * scale_floor(values)}


def scaled_atol(stated: dict, rtol: float) -> float:
    """A golden's stated ``{"rtol", "atol"}`` with ``rtol`` replaced by ``rtol`` (from
    :func:`e2e_rtol`, times an override): the ``atol`` that goes with it, scaled by the same
    factor (a schedule golden's fingerprints, compared with ``atol + rtol |want|``)."""
    return rtol / max(stated["rtol"], 1e-300) * stated["atol"]


def decision_tolerance(scores: np.ndarray, rtol: float) -> np.ndarray:
    """Per-candidate tolerance of one end-to-end decision's scores: ``rtol * max(|s_i|, m)``.

    ``m`` is the median magnitude of the decision's finite scores (a score near zero is
    computed from values of the typical magnitude); any shape; NaN padding gives 0.
    """
    s = np.abs(np.asarray(scores, dtype=np.float64))
    finite = np.isfinite(s)
    typical = float(np.median(s[finite])) if finite.any() else 0.0
    return np.where(finite, rtol * np.maximum(s, typical), 0.0)


def tolerance_rule(dtype: str, factor: float, factor_name: str = "--tolerance-factor") -> str:
    """How a report names the rule that accepted a tie: ``"float32 tolerance at the two
    scores' own scale"``, and ``", times --tolerance-factor 2"`` (``factor_name`` and the
    factor) after an explicit override."""
    rule = f"{dtype} tolerance at the two scores' own scale"
    if factor == 1.0:
        return rule
    return rule + f", times {factor_name + ' ' if factor_name else ''}{factor:g}"


def tie_rule_meaningless(scores: np.ndarray, tol: np.ndarray, candidates: np.ndarray | None = None) -> bool:
    """True if every pair of (finite, distinct) scores of a row is within tolerance: any swap is a tie."""
    s, t = np.asarray(scores, dtype=np.float64), np.asarray(tol, dtype=np.float64)
    keep = np.isfinite(s) if candidates is None else (np.isfinite(s) & candidates)
    s, t = s[keep], t[keep]
    if s.size < 2 or s.max() == s.min():
        return False
    return bool(np.all(np.abs(s[:, None] - s[None, :]) <= t[:, None] + t[None, :]))


def e2e_rtol(stored_rtol: float, golden_dtype: str, dtype=None, *, checkpoint: bool = False) -> float:
    """Relative tolerance of an end-to-end golden's scores and logits for a candidate in ``dtype``.

    The golden states the tolerance of its own dtype, which a candidate in the same or a
    finer dtype keeps. A float32 candidate of a float64 golden gets the float32 goldens'
    ``rtol`` (1e-4). A bfloat16 or float16 candidate gets :data:`E2E_RTOL`: the measured
    amplification of that dtype's rounding through the model (built-in tiny models, or a
    real ``checkpoint``), times a golden's own loosening of its stated ``rtol`` if any.
    """
    name = check_dtype_name(dtype) or golden_dtype
    if name in E2E_RTOL["built-in"] and UNIT_ROUNDOFF[name] > UNIT_ROUNDOFF[golden_dtype]:
        default = DEFAULT_E2E_TOLERANCE.get(golden_dtype, stored_rtol)
        return E2E_RTOL["checkpoint" if checkpoint else "built-in"][name] * max(1.0, stored_rtol / default)
    if golden_dtype == "float64" and UNIT_ROUNDOFF[name] > UNIT_ROUNDOFF["float64"]:
        # A float64 golden's tolerance is tight for float64 (1e-8 for u = 1e-16): a float32
        # candidate gets the float32 goldens' own.
        return DEFAULT_E2E_TOLERANCE["float32"]
    return stored_rtol
