"""The candidate reader's one gate: every array a candidate gives, checked before it is compared.

A comparison can only judge numbers: a NaN row key compares false with everything (so a
fingerprint check ``|got - want| > tol`` passes it), a complex key silently loses its
imaginary part, ``int(8.5)`` is 8, and a count of ``2**62`` slices every row whole. So
before any comparison each kind of golden's candidate goes through one function here:

* :func:`validate_case_candidate` -- a vectors case's ``scores``, ``protected``, ``kept``
  (what :func:`refkv.oracle.cases.compare_case` takes);
* :func:`validate_end_to_end_candidate` -- an end-to-end golden's ``kept``, ``kept_count``,
  ``logits``, per block or final only (:func:`refkv.oracle.walk.compare_end_to_end`);
* :func:`validate_schedule_candidate` -- a schedule golden's rounds
  (:func:`refkv.oracle.rounds.compare_schedule`): ``kept``, ``kept_count``, ``logits``,
  optional ``row_keys``/``row_values``, ``scores`` with ``score_positions`` (or
  ``candidates``), and the candidate's own pre-eviction state ``state_positions``,
  ``state_keys``, ``state_values``, ``state_queries``;

and :func:`validate_candidate` dispatches on the kind. The rules, the same for every kind:

* **floats** are real (a complex, bool, string or object array is refused), of the
  declared shape, and finite wherever they are judged (a kept row's key, a real
  candidate's score, a logit); where the reference's own value is infinite the candidate's
  may be the same infinity;
* **counts and positions** are integers: an integer array, or a float array holding
  integral values (converted); a fractional, NaN or infinite value is refused, and so is
  one out of range -- a count in ``[0, the row width]``, a position in
  ``[-1, tokens seen)`` (``-1`` pads);
* each refusal is a :class:`CandidateError` (a ``ValueError``) of one line naming the
  file (``source``), the array, the first offending element and what was expected, e.g.
  ``cand.npz: row_keys: 1 NaN value (round 0, layer 1, head 0, row 3); a candidate's
  floats must be finite``.

Validation returns the arrays converted: counts and positions as ``int64``; floats keep
their own float dtype (``bfloat16`` tensors become ``float32`` through
:func:`refkv.oracle.arrays.as_array`), so an exact-dtype check still sees what the
candidate computed in. Converted arrays validate again unchanged: a file checker validates
with its file's name and the comparison it calls validates what it is given.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .arrays import as_array
from .declare import Declarations

__all__ = ["KINDS", "CandidateError", "validate_candidate", "validate_case_candidate",
           "validate_end_to_end_candidate", "validate_schedule_candidate"]

#: The kinds of candidate :func:`validate_candidate` knows.
KINDS = ("vectors", "e2e", "final", "schedule")
#: The largest count or position accepted when the golden states no bound (exact in float64,
#: far below int64's range).
_NO_BOUND = 2 ** 53
_FLOATS = "a candidate's floats must be finite"


class CandidateError(ValueError):
    """A candidate the checker refuses to judge; the message is one line naming the array."""


class _Gate:
    """Where refusals come from (a file, a case) and how they are worded."""

    def __init__(self, source):
        self.prefix = f"{source}: " if source else ""

    def refuse(self, name: str, text: str):
        raise CandidateError(f"{self.prefix}{name}: {text}")


def _where(index, axes: Sequence[str]) -> str:
    """``(0, 1, 0, 3, 5)`` with axes ``("round", "layer", "head", "row")`` -> ``"round 0, layer 1, head 0, row 3"``."""
    parts = [f"{axis} {int(i)}" for axis, i in zip(axes, index) if axis != "d_head"]  # a row, not its element
    return ", ".join(parts) if parts else "index " + str(tuple(int(i) for i in index))


def _shape_text(shape, axes) -> str:
    return "(" + ", ".join(f"{a} {'*' if s is None else s}" for a, s in zip(axes, shape)) + ")"


def _read(gate: _Gate, name: str, value) -> np.ndarray:
    """``value`` as an array of numbers, or a refusal naming what it holds."""
    try:
        a = as_array(value, name)
    except TypeError as err:
        gate.refuse(name, f"cannot be read as an array of numbers ({err}); give a NumPy array, a list or a tensor")
    if a.dtype.kind == "c":
        gate.refuse(name, f"complex values (dtype {a.dtype}); a candidate's arrays must be real")
    if a.dtype.kind not in "biuf":
        gate.refuse(name, f"dtype {a.dtype} holds no numbers; expected a real numeric array")
    return a


def _check_shape(gate: _Gate, name: str, a: np.ndarray, shape, axes) -> None:
    ok = a.ndim == len(shape) and all(s is None or s == n for s, n in zip(shape, a.shape))
    if not ok:
        gate.refuse(name, f"shape {a.shape}, expected {_shape_text(shape, axes)}")


def _floats(gate: _Gate, name: str, value, shape, axes, judged=None, reference=None) -> np.ndarray:
    """A real float array of ``shape`` (``None``: any length), finite wherever ``judged``.

    ``reference``: the reference's values at the same indices (broadcast), or a function
    returning them (called only when a value is not finite); where one is infinite the
    candidate may hold the same infinity.
    """
    a = _read(gate, name, value)
    if a.dtype.kind == "b":
        gate.refuse(name, "bool values; expected real floats")
    _check_shape(gate, name, a, shape, axes)
    if a.dtype.kind != "f":
        return a  # integers are finite (and compare as numbers)
    bad = ~np.isfinite(a)
    if judged is not None:
        bad &= np.broadcast_to(judged, a.shape)
    if reference is not None and bad.any():
        ref = reference() if callable(reference) else reference
        ref = np.broadcast_to(np.asarray(ref, dtype=np.float64), a.shape)
        with np.errstate(invalid="ignore"):
            bad &= ~(np.isinf(ref) & (a == ref))
    if bad.any():
        n_nan = int((bad & np.isnan(a)).sum())
        n_inf = int(bad.sum()) - n_nan
        what = " and ".join(part for part in (f"{n_nan} NaN" if n_nan else "", f"{n_inf} infinite" if n_inf else "")
                            if part)
        plural = "s" if n_nan + n_inf > 1 else ""
        first = _where(np.argwhere(bad)[0], axes)
        gate.refuse(name, f"{what} value{plural} ({'first at ' if plural else ''}{first}); {_FLOATS}")
    return a


def _integers(gate: _Gate, name: str, value, shape, axes, low, high, what: str) -> np.ndarray:
    """An integer array (or float array of integral values) of ``shape`` with values in
    ``[low, high]`` (``high`` broadcast per element); returned as ``int64``."""
    a = _read(gate, name, value)
    if a.dtype.kind == "b":
        gate.refuse(name, f"bool values; {what} must be integers")
    _check_shape(gate, name, a, shape, axes)
    high = np.broadcast_to(np.asarray(high), a.shape)
    if a.dtype.kind == "f":
        bad = ~np.isfinite(a)
        if bad.any():
            i = tuple(np.argwhere(bad)[0])
            gate.refuse(name, f"{float(a[i])} ({_where(i, axes)}); {what} must be integers")
        bad = a != np.floor(a)
        if bad.any():
            i = tuple(np.argwhere(bad)[0])
            gate.refuse(name, f"fractional value {float(a[i])!r} ({_where(i, axes)}); {what} must be integers")
    bad = (a < low) | (a > high)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        shown = int(a[i]) if a.dtype.kind != "f" else f"{float(a[i]):.17g}"
        gate.refuse(name, f"value {shown} ({_where(i, axes)}) out of range; {what} must be integers in "
                          f"[{low}, {int(high[i])}]")
    return a.astype(np.int64)


def _require(gate: _Gate, candidate, names) -> None:
    if not isinstance(candidate, dict):
        raise CandidateError(f"{gate.prefix}the candidate must be a dict of arrays, got {type(candidate).__name__}")
    for name in names:
        if name not in candidate:
            gate.refuse(name, "missing; a candidate gives " + ", ".join(names))


# -- vectors -----------------------------------------------------------------------------------------------
def validate_case_candidate(candidate: dict, case, *, declare=None, source=None) -> dict:
    """A vectors case's candidate outputs, checked (module docstring) and converted.

    Parameters
    ----------
    candidate : dict
        Any of ``scores`` (Hkv, n) float, ``protected`` (Hkv, n) bool (or 0/1),
        ``kept`` (Hkv, m) integers, or one row per head of different lengths (uneven
        budgets); column indices or positions (``kept_as`` of :func:`~refkv.oracle.cases.compare_case`),
        ``-1`` padding.
    case : VectorCase
        The reference case.
    declare : dict or Declarations, optional
        Pinned columns' and, under ``kept_only``, all scores are not compared, so they need
        not be finite.
    source : str, optional
        The candidate's file (and case), prefixed to a refusal.
    """
    gate = _Gate(source)
    if not isinstance(candidate, dict):
        raise CandidateError(f"{gate.prefix}the candidate must be a dict of arrays, got {type(candidate).__name__}")
    decl = Declarations.parse(declare)
    positions = np.asarray(case.inputs["positions"])
    hkv, n = positions.shape
    axes = ("head", "column")
    out = dict(candidate)
    if "scores" in candidate:
        ref = np.asarray(case.outputs["scores"], dtype=np.float64)
        judged = (np.zeros(ref.shape, dtype=bool) if decl.kept_only
                  else np.isfinite(ref) & ~decl.pinned_mask(positions, case.outputs["protected"]))
        out["scores"] = _floats(gate, "scores", candidate["scores"], (hkv, n), axes, judged, ref)
    if "protected" in candidate:
        p = _read(gate, "protected", candidate["protected"])
        _check_shape(gate, "protected", p, (hkv, n), axes)
        if p.dtype.kind != "b" and not np.isin(p, (0, 1)).all():
            gate.refuse("protected", f"dtype {p.dtype} with values other than 0 and 1; expected a bool mask")
        out["protected"] = p
    if "kept" in candidate:
        # Columns or positions: which, and whether each names a candidate, the comparison says
        # (with a hint when columns look like positions); here only integers from -1 (padding) up.
        bound = _NO_BOUND
        kept = candidate["kept"]
        what = "kept columns (or positions)"
        if _is_ragged(kept):
            if len(kept) != hkv:
                gate.refuse("kept", f"{len(kept)} rows, expected one per KV head ({hkv})")
            out["kept"] = [_integers(gate, f"kept[{h}]", row, (None,), ("row",), -1, bound, what)
                           for h, row in enumerate(kept)]
        else:
            out["kept"] = _integers(gate, "kept", kept, (hkv, None), ("head", "row"), -1, bound, what)
    return out


def _is_ragged(kept) -> bool:
    """Rows of different lengths (a head keeping fewer tokens): a list, not one array."""
    return (isinstance(kept, (list, tuple)) and len(kept) > 0
            and all(isinstance(row, (list, tuple, np.ndarray)) for row in kept)
            and len({len(row) for row in kept}) > 1)


# -- end to end --------------------------------------------------------------------------------------------
def _tokens_seen(reference: dict, manifest) -> int | None:
    """How many tokens the golden's run saw (positions lie below it), if it says."""
    if "prompt" in reference:
        return int(np.asarray(reference["prompt"]).shape[0]) + (
            int(np.asarray(reference["decode"]).shape[0]) if "decode" in reference else 0)
    prompt = (manifest or {}).get("prompt")
    if isinstance(prompt, dict) and isinstance(prompt.get("length"), int):
        decode = (manifest or {}).get("decode")
        extra = decode.get("length", 0) if isinstance(decode, dict) else 0
        return prompt["length"] + (extra if isinstance(extra, int) else 0)
    return None


def _logits(gate: _Gate, candidate: dict, reference: dict) -> np.ndarray:
    ref = np.asarray(reference["logits"], dtype=np.float64)
    return _floats(gate, "logits", candidate["logits"], ref.shape, ("token id",), None, ref)


def validate_end_to_end_candidate(candidate: dict, reference: dict, manifest=None, *, final_only: bool = False,
                                  source=None) -> dict:
    """An end-to-end golden's candidate (``kept``, ``kept_count``, ``logits``), checked and converted.

    Per block: ``kept`` of the golden's shape (blocks, layers, KV heads, K), ``kept_count``
    (blocks, layers) in ``[0, K]``. Final only: ``kept`` (layers, KV heads, K) or
    (b, layers, KV heads, K), ``kept_count`` (layers,) or (b, layers). Positions in
    ``[-1, tokens seen)``; logits the golden's shape, finite.
    """
    gate = _Gate(source)
    _require(gate, candidate, ("kept", "kept_count", "logits"))
    kept_r = np.asarray(reference["kept"])
    n_blocks, n_layers, hkv, width = kept_r.shape
    seen = _tokens_seen(reference, manifest)
    top = (_NO_BOUND if seen is None else seen) - 1
    out = dict(candidate)
    if final_only:
        kept = _read(gate, "kept", candidate["kept"])
        lead = kept.shape[:1] if kept.ndim == 4 else ()
        k_axes = (("block",) if lead else ()) + ("layer", "head", "row")
        c_axes = (("block",) if lead else ()) + ("layer",)
        out["kept"] = _integers(gate, "kept", kept, (*lead, n_layers, hkv, width), k_axes, -1, top, "positions")
        counts = _read(gate, "kept_count", candidate["kept_count"])
        c_lead = counts.shape[:1] if counts.ndim == 2 else ()
        out["kept_count"] = _integers(gate, "kept_count", counts, (*c_lead, n_layers), c_axes, 0, width, "counts")
    else:
        out["kept"] = _integers(gate, "kept", candidate["kept"], kept_r.shape, ("block", "layer", "head", "row"), -1,
                                top, "positions")
        out["kept_count"] = _integers(gate, "kept_count", candidate["kept_count"], (n_blocks, n_layers),
                                      ("block", "layer"), 0, width, "counts")
    out["logits"] = _logits(gate, candidate, reference)
    return out


# -- schedules ---------------------------------------------------------------------------------------------
_ROUND_AXES = ("round", "layer", "head")


def validate_schedule_candidate(candidate: dict, reference_arrays: dict, manifest: dict, source=None, *,
                                declare=None) -> dict:
    """A schedule golden's candidate (:mod:`refkv.oracle.rounds`), checked and converted.

    ========================  ==========================  =================================================
    array                     shape                       checked
    ========================  ==========================  =================================================
    ``kept``                  (R, L, Hkv, K)              integers in ``[-1, tokens seen at the round)``
    ``kept_count``            (R, L)                      integers in ``[0, K]``
    ``logits``                the golden's (vocab,)       real, finite (where the reference's are)
    ``row_keys``,             (R, L, Hkv, K, d_head)      real, finite in every row ``kept`` names
    ``row_values``                                        (below ``kept_count``)
    ``scores`` with           (R, L, Hkv, C) both         positions as ``kept``; scores real, finite at
    ``score_positions``                                   every real position (not under ``kept_only``)
    (or ``candidates``)
    ``state_positions``       (R, L, Hkv, C)              positions as ``kept``
    ``state_keys``,           (R, L, Hkv, C, d_head)      real, finite where ``state_positions >= 0``
    ``state_values``
    ``state_queries``         (R, L, H, W, d_head)        real, finite
    ``token_queries``         (L, H, P, d_head)           real, finite (``P``: the tokens fed)
    ``token_keys``,           (L, Hkv, P, d_head)         real, finite
    ``token_values``
    ========================  ==========================  =================================================

    ``R``, ``L``, ``Hkv``, ``H``, ``d_head`` are the golden's; ``K``, ``C``, ``W`` the
    candidate's own. Arrays not listed pass through unchecked. ``declare``: under
    ``kept_only`` the scores are not compared, so they need not be finite.
    """
    gate = _Gate(source)
    _require(gate, candidate, ("kept", "kept_count", "logits"))
    decl = Declarations.parse(declare)
    kept_r = np.asarray(reference_arrays["kept"])
    n_rounds, n_layers, hkv = kept_r.shape[:3]
    cfg = manifest["model"]["config"]
    d_head, n_heads = int(cfg["d_head"]), int(cfg.get("n_heads", hkv))
    if "round_position" in reference_arrays:  # tokens seen by each round: its positions lie below
        top = np.asarray(reference_arrays["round_position"], dtype=np.int64).reshape(n_rounds, 1, 1, 1) - 1
    else:
        seen = _tokens_seen(reference_arrays, manifest)
        top = (_NO_BOUND if seen is None else seen) - 1
    out = dict(candidate)
    kept = out["kept"] = _integers(gate, "kept", candidate["kept"], (n_rounds, n_layers, hkv, None),
                                   (*_ROUND_AXES, "row"), -1, top, "positions")
    width = kept.shape[3]
    counts = out["kept_count"] = _integers(gate, "kept_count", candidate["kept_count"], (n_rounds, n_layers),
                                           ("round", "layer"), 0, width, "counts")
    out["logits"] = _logits(gate, candidate, reference_arrays)
    # The rows a comparison reads: below the layer's count, holding a position.
    held = (kept >= 0) & (np.arange(width) < counts[..., None, None])
    row_axes = (*_ROUND_AXES, "row")
    for name in ("row_keys", "row_values"):
        if name in candidate:
            out[name] = _floats(gate, name, candidate[name], (n_rounds, n_layers, hkv, width, d_head), (*row_axes,
                                "d_head"), held[..., None])
    if "score_positions" in candidate or "scores" in candidate:
        pos_name = "score_positions" if "score_positions" in candidate or "candidates" not in candidate \
            else "candidates"
        if ("scores" in candidate) != (pos_name in candidate):
            gate.refuse("scores", "scores and score_positions go together: give both or neither")
        pos = out[pos_name] = _integers(gate, pos_name, candidate[pos_name], (n_rounds, n_layers, hkv, None),
                                        (*_ROUND_AXES, "candidate"), -1, top, "positions")
        judged = np.zeros(pos.shape, dtype=bool) if decl.kept_only else pos >= 0
        out["scores"] = _floats(gate, "scores", candidate["scores"], pos.shape, (*_ROUND_AXES, "candidate"), judged,
                                lambda: _reference_scores_at(pos, reference_arrays))
    if "state_keys" in candidate or "state_values" in candidate:
        if "state_positions" not in candidate:
            gate.refuse("state_keys" if "state_keys" in candidate else "state_values",
                        "given without state_positions (which position each state row holds)")
    if "state_positions" in candidate:
        s_pos = out["state_positions"] = _integers(gate, "state_positions", candidate["state_positions"],
                                                   (n_rounds, n_layers, hkv, None), (*_ROUND_AXES, "row"), -1, top,
                                                   "positions")
        for name in ("state_keys", "state_values"):
            if name in candidate:
                out[name] = _floats(gate, name, candidate[name], (*s_pos.shape, d_head), (*row_axes, "d_head"),
                                    (s_pos >= 0)[..., None])
    if "state_queries" in candidate:
        out["state_queries"] = _floats(gate, "state_queries", candidate["state_queries"],
                                       (n_rounds, n_layers, n_heads, None, d_head),
                                       ("round", "layer", "query head", "query", "d_head"))
    # Every token's query, key and value (a replay of a policy with per-token state).
    n_tokens = int(manifest["prompt"]["length"]) + int(manifest.get("decode", {}).get("length", 0))
    for name, heads, axis in (("token_queries", n_heads, "query head"), ("token_keys", hkv, "KV head"),
                              ("token_values", hkv, "KV head")):
        if name in candidate:
            out[name] = _floats(gate, name, candidate[name], (n_layers, heads, n_tokens, d_head),
                                ("layer", axis, "token", "d_head"))
    return out


def _reference_scores_at(positions: np.ndarray, reference: dict) -> np.ndarray:
    """The reference's score of each position a candidate scores (NaN where the reference
    did not score it, or records no scores)."""
    out = np.full(positions.shape, np.nan)
    if "scores" not in reference or "candidates" not in reference:
        return out
    ref_pos, ref_s = np.asarray(reference["candidates"]), np.asarray(reference["scores"], dtype=np.float64)
    lead = positions.shape[:3]
    if ref_pos.shape[:3] != lead:
        return out
    for idx in np.ndindex(*lead):
        p, rp = positions[idx], ref_pos[idx]
        if not (p >= 0).any():
            continue
        col = {int(q): i for i, q in enumerate(rp) if q >= 0}
        for j in np.flatnonzero(p >= 0):
            i = col.get(int(p[j]))
            if i is not None:
                out[(*idx, j)] = ref_s[(*idx, i)]
    return out


# -- one entry ---------------------------------------------------------------------------------------------
def validate_candidate(kind: str, arrays: dict, reference_arrays, manifest=None, *, source=None,
                       declare=None) -> dict:
    """Check a candidate of ``kind`` (:data:`KINDS`) before comparison; return its arrays converted.

    ``"vectors"``: ``reference_arrays`` is the :class:`~refkv.oracle.vectors.VectorCase`;
    ``"e2e"`` / ``"final"``: an end-to-end golden's arrays per block / final cache only;
    ``"schedule"``: a schedule golden's. Raises :class:`CandidateError` (a ``ValueError``)
    with one line naming ``source``, the array and what was expected.
    """
    if kind == "vectors":
        return validate_case_candidate(arrays, reference_arrays, declare=declare, source=source)
    if kind in ("e2e", "final"):
        return validate_end_to_end_candidate(arrays, reference_arrays, manifest, final_only=kind == "final",
                                             source=source)
    if kind == "schedule":
        return validate_schedule_candidate(arrays, reference_arrays, manifest, source, declare=declare)
    raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r:.60}")
