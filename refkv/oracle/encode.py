"""Writing score-function test vectors: an eviction view becomes a golden case, cases a file.

:func:`encode_case` turns a :class:`~refkv.policies.View` (as the engine or
:func:`refkv.oracle.synthetic.replay` passes it to a policy) into a case, with the flags
detected from its inputs and outputs (:func:`case_flags`); :func:`vectors_document` writes
a policy's cases as one vectors file, :func:`candidate_document` a candidate's outputs.
:mod:`refkv.oracle.vectors` reads them back.

Only what the policy reads is stored. :func:`encode_case` checks that claim: it recomputes
the outputs from a view where every array it did not store is NaN (and attention is
``None``); if they differ, it stores every input (see ``docs/oracle/format.rst``).
"""

from __future__ import annotations

import numpy as np

from ..cache import EMPTY
from ..policies import Policy, View, policy_class
from ..policies import get as get_policy
from .schema import FLAGS, FLOAT_FORMAT, VECTORS_SCHEMA, decode_array, encode_array, header
from .synthetic import max_abs_logit
from .tolerance import tolerance_for
from .vectors import MODES, EncodedCase, VectorCase, json_params, python_params

__all__ = [
    "boundary_gap",
    "candidate_document",
    "case_flags",
    "encode_case",
    "kept_rows",
    "vectors_document",
    "view_mode",
]

# Signals -> the stored inputs that carry them (positions and fields are always stored).
_SIGNAL_INPUTS = {"keys": ("keys", "block_keys"), "values": ("values", "block_values"),
                  "queries": ("queries",), "attention": ("attention",), "positions": ()}
_ALL_INPUTS = ("keys", "values", "block_keys", "block_values", "queries", "attention")

#: What a vectors file holding uneven cases (AdaKV) adds to its description.
UNEVEN_DESCRIPTION = (
    "A case with head_budgets keeps head_budgets[h] tokens in head h (their sum is layer_total): its kept",
    "rows end in -1, and -1 in inputs.positions marks an empty slot (a head holding fewer tokens).",
)


def boundary_gap(scores: np.ndarray, kept: np.ndarray, protected: np.ndarray,
                 empty: np.ndarray | None = None) -> list[float | None]:
    """Per KV head: lowest kept unprotected score minus highest evicted score (None if no boundary).

    ``0.0`` means an exact tie decided by the tie rule; equal infinities count as a tie.
    ``kept`` rows may end in ``-1`` (a head keeping fewer, uneven budgets); ``empty`` marks
    empty slots, which are no candidates.
    """
    gaps: list[float | None] = []
    n = scores.shape[1]
    for h in range(scores.shape[0]):
        row = np.asarray(kept[h])
        kept_mask = np.zeros(n, dtype=bool)
        kept_mask[row[row >= 0]] = True  # -1 pads a head that keeps fewer (uneven budgets)
        inside = scores[h][kept_mask & ~protected[h]]
        outside = scores[h][~kept_mask if empty is None else ~kept_mask & ~empty[h]]
        if inside.size == 0 or outside.size == 0:
            gaps.append(None)
            continue
        low, high = float(inside.min()), float(outside.max())
        gaps.append(0.0 if low == high else low - high)
    return gaps


def case_flags(view: View, scores: np.ndarray, protected: np.ndarray, kept: np.ndarray,
               tolerance: dict, stage: str) -> list[str]:
    """The flags a case has, detected from its inputs and outputs (never merely intended)."""
    flags = []
    h, hkv = view.queries.shape[0], view.n_kv_heads
    flags.append("gqa" if h > hkv else "mha")
    if len(view.query_positions) == 1:
        flags.append("single-token")
    lengths = view.head_lengths
    if np.all(lengths <= (np.asarray(kept) >= 0).sum(axis=1)):
        flags.append("no-eviction")
    finite = np.asarray(scores, dtype=np.float64)
    for gap, row in zip(boundary_gap(finite, kept, protected, view.positions == EMPTY), range(hkv)):
        if gap is None:
            continue
        scale = np.abs(finite[row][np.isfinite(finite[row])])
        threshold = tolerance["atol"] + tolerance["rtol"] * (float(scale.max()) if scale.size else 0.0)
        if gap == 0.0 and "exact-tie" not in flags:
            flags.append("exact-tie")
        elif 0.0 < gap <= 100 * threshold and "near-tie" not in flags:
            flags.append("near-tie")
    keys = np.concatenate([view.keys, view.block_keys], axis=1) if stage == "before-attention" else view.keys
    real = [keys[i, :int(lengths[i]) + (keys.shape[1] - view.n)] for i in range(hkv)]  # empty slots are no keys
    if any(k.size and np.any(np.all(k == 0, axis=-1)) for k in real):
        flags.append("zero-norm-key")
    if any(len(np.unique(k, axis=0)) < k.shape[0] for k in real):
        flags.append("duplicate-keys")
    if max_abs_logit(view.queries, keys) > 30.0:
        flags.append("huge-logits")
    if view.fields:
        flags.append("stateful")
    if stage == "before-attention":
        flags.append("before-attention")
    if view.keys.dtype == np.float32:
        flags.append("float32")
    return flags


def kept_rows(kept) -> tuple[np.ndarray, list[int] | None]:
    """A policy's ``keep_indices`` as one (Hkv, m) int64 array and the per-head counts.

    An even choice (an array, or rows of one length) is returned as it is with ``None``;
    uneven rows (AdaKV) become an array as wide as the longest, each shorter row padded
    with ``-1``, and the list of the rows' lengths (the case's ``head_budgets``).
    """
    if not isinstance(kept, (list, tuple)):
        return np.asarray(kept, dtype=np.int64), None
    rows = [np.asarray(row, dtype=np.int64) for row in kept]
    counts = [len(row) for row in rows]
    if len(set(counts)) <= 1:
        return (np.stack(rows) if rows else np.zeros((0, 0), dtype=np.int64)), None
    out = np.full((len(rows), max(counts)), -1, dtype=np.int64)
    for h, row in enumerate(rows):
        out[h, :len(row)] = row
    return out, counts


def _outputs(policy: Policy, view: View) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scores = np.asarray(policy.score(view))
    protected = np.asarray(policy.protected(view), dtype=bool)
    kept, _ = kept_rows(policy.keep_indices(view))
    return scores, protected, kept


def _file_positions(positions: np.ndarray) -> np.ndarray:
    """Positions as a file writes them: ``-1`` for an empty slot (:data:`refkv.cache.EMPTY` in memory)."""
    positions = np.array(positions)
    positions[positions == EMPTY] = -1
    return positions


def _last_columns(view: View, b: int) -> np.ndarray:
    """Per head, the columns of the block after attention: the last ``b`` of its real tokens."""
    lengths = view.head_lengths
    return np.stack([np.arange(length - b, length) for length in lengths]) if b else np.zeros(
        (view.n_kv_heads, 0), dtype=np.int64)


def _rebuilt(view: View, stored: set[str], stage: str, b: int) -> View:
    """The view a reader rebuilds from a case storing only ``stored`` (via the JSON encoding)."""
    inputs = {name: decode_array(encode_array(getattr(view, name)), name)
              for name in ("query_positions", *sorted(stored))}
    inputs["positions"] = decode_array(encode_array(_file_positions(view.positions)), "positions")
    fields = {name: decode_array(encode_array(a), name) for name, a in view.fields.items()}
    case = VectorCase(id=0, comment="", flags=(), params={}, dtype=view.keys.dtype.name, stage=stage,
                      layer=view.layer, n_layers=view.n_layers, budget=view.keep,
                      sizes={"n_heads": view.queries.shape[0], "n_kv_heads": view.n_kv_heads,
                             "d_head": view.keys.shape[2], "n": view.n, "block": b},
                      tolerance={}, inputs=inputs, fields=fields, outputs={})
    return case.view()


def _same(a: tuple, b: tuple) -> bool:
    return all(x.shape == y.shape and np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b))


def view_mode(view: View, stage: str) -> str:
    """``"oneshot"`` if the view's block is the whole prompt (it starts at position 0 and the
    candidates are exactly its tokens, after attention), else ``"block"``."""
    b = len(view.query_positions)
    whole = (stage == "after-attention" and b == view.n and b > 0 and int(view.query_positions[0]) == 0)
    return "oneshot" if whole else "block"



def encode_case(policy: Policy, view: View, *, case_id: int, comment: str, extra_flags=(),
                tolerance: dict | None = None, mode: str | None = None) -> EncodedCase:
    """One JSON case from an eviction view; the case's ``budget`` is ``view.keep``, the tokens kept.

    Parameters
    ----------
    policy : Policy
    view : View
        As the engine (or :func:`refkv.oracle.synthetic.replay`) passes it to
        ``policy.keep_indices``.
    case_id : int
    comment : str
    extra_flags : iterable of str
        Flags known from how the view was made (``"engine"``).
    tolerance : dict, optional
        ``{"rtol", "atol"}``; default :func:`refkv.oracle.tolerance.tolerance_for`.
    mode : {"oneshot", "block"}, optional
        Default: read from the view (:func:`view_mode`); a ``"oneshot"`` that the view
        contradicts is a ValueError.

    Examples
    --------
    A one-shot case (the whole prompt is one block) from synthetic tokens::

        from refkv import policies
        from refkv.oracle.synthetic import random_tokens, replay
        tokens = random_tokens(np.random.default_rng(0), 4, 2, 8, 24)  # H=4, Hkv=2, d=8, T=24
        policy = policies.get("tova")
        view = replay(policy, tokens, budget=16)  # block_size=None: one-shot
        case = encode_case(policy, view, case_id=1, comment="one-shot TOVA, T=24, N=16")
    """
    if view.keep is None:
        raise ValueError("view.keep must be the number of tokens the eviction keeps, got None")
    full = _outputs(policy, view)
    scores, protected, kept = full
    _, head_budgets = kept_rows(policy.keep_indices(view))
    if head_budgets is None and kept.shape[1] != min(view.keep, view.n):
        # every head keeps one count other than the budget (PyramidKV's authors' form: its floored
        # layer schedule, the window on top): stated as head_budgets, as uneven counts are
        head_budgets = [int(kept.shape[1])] * int(kept.shape[0])
    b = len(view.query_positions)
    stage = "before-attention" if policy.evict_before_attention else "after-attention"
    if stage == "after-attention" and not np.array_equal(
            np.take_along_axis(view.keys, _last_columns(view, b)[..., None], axis=1), view.block_keys):
        raise ValueError("after attention the block must be the last B columns of the cache (of each head's "
                         "tokens)")
    seen = view_mode(view, stage)
    if mode is None:
        mode = seen
    elif mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    elif mode == "oneshot" and seen != "oneshot":
        raise ValueError("mode='oneshot' needs a view whose block is the whole prompt (after attention, from "
                         "position 0, every candidate in the block): replay(..., block_size=None)")

    wanted = {"positions"}
    for signal in policy.needs:
        wanted.update(_SIGNAL_INPUTS[signal])
    stored = {name for name in wanted if name in _ALL_INPUTS}
    if stage == "after-attention":  # the block is keys[:, -B:]: nothing to store twice
        stored -= {"block_keys", "block_values"}
    # The promise of the format: the outputs follow from the file alone. Rebuild the view
    # from what would be written (through the JSON encoding) and recompute them.
    try:
        complete = _same(full, _outputs(policy, _rebuilt(view, stored, stage, b)))
    except (ValueError, FloatingPointError):
        complete = False
    if not complete:  # the policy reads more than its `needs` declare: store everything
        stored = set(_ALL_INPUTS) - ({"block_keys", "block_values"} if stage == "after-attention" else set())
        if view.attention is None:
            stored.discard("attention")

    if tolerance is None:
        tolerance = tolerance_for(view.keys.dtype, scores)
    flags = [*case_flags(view, scores, protected, kept, tolerance, stage), *extra_flags]
    inputs = {"positions": encode_array(_file_positions(view.positions)),
              "query_positions": encode_array(view.query_positions)}
    for name in _ALL_INPUTS:
        if name in stored:
            inputs[name] = encode_array(getattr(view, name))
    inputs["fields"] = {name: encode_array(array) for name, array in sorted(view.fields.items())}
    uneven = {} if head_budgets is None else {"head_budgets": head_budgets, "layer_total": int(sum(head_budgets))}
    return EncodedCase({
        "id": case_id,
        "comment": comment,
        "flags": flags,
        "dtype": view.keys.dtype.name,
        "stage": stage,
        "mode": mode,
        "layer": view.layer,
        "n_layers": view.n_layers,
        "budget": int(view.keep),
        **uneven,
        "sizes": {"n_heads": view.queries.shape[0], "n_kv_heads": view.n_kv_heads, "d_head": view.keys.shape[2],
                  "n": view.n, "block": b},
        "tolerance": {"rtol": float(tolerance["rtol"]), "atol": float(tolerance["atol"])},
        "inputs": inputs,
        "outputs": {"scores": encode_array(scores), "protected": encode_array(protected),
                    "kept": encode_array(kept)},
    }, policy.name, json_params(policy.params()))



def candidate_document(policy_name: str, outputs: dict) -> dict:
    """A candidate's vectors file: the header and, per case id, its outputs.

    Parameters
    ----------
    policy_name : str
    outputs : dict of int to dict
        ``{case_id: {"kept": (Hkv, m) ints, "scores": (Hkv, n), "protected": (Hkv, n) bool}}``;
        ``scores`` and ``protected`` are optional (compared when present).
    """
    cases = []
    for case_id, out in sorted(outputs.items()):
        if "kept" not in out:
            raise ValueError(f"outputs of case {case_id} must hold 'kept'")
        unknown = set(out) - {"kept", "scores", "protected"}
        if unknown:
            raise ValueError(f"outputs of case {case_id} hold unknown entries {sorted(unknown)}")
        cases.append({"id": int(case_id), "outputs": {k: encode_array(v) for k, v in out.items()}})
    return {**header(VECTORS_SCHEMA), "float_format": FLOAT_FORMAT, "policy": policy_name,
            "groups": [{"cases": cases}]}


def vectors_document(policy_name: str, groups: list[tuple[dict, list[dict]]]) -> dict:
    """A whole vectors file: the header, the flags' notes, and the groups of cases."""
    cls = policy_class(policy_name)
    used = sorted({f for _, cases in groups for case in cases for f in case["flags"]})
    n_cases = sum(len(cases) for _, cases in groups)
    sample = get_policy(policy_name, **python_params(groups[0][0])) if groups else cls()
    return {
        **header(VECTORS_SCHEMA),
        "float_format": FLOAT_FORMAT,
        "policy": policy_name,
        "summary": cls.card.summary,
        "paper": cls.card.paper,
        "needs": sorted(sample.needs),
        "evict_before_attention": bool(sample.evict_before_attention),
        "description": [
            "Score-function test vectors: each case is one eviction decision of one layer.",
            "Rebuild the View from inputs (arrays absent from inputs are not read by the policy), then",
            "scores = policy.score(view), protected = policy.protected(view),",
            "kept = policy.keep_indices(view, budget): column indices into the candidates, increasing.",
            "Compare scores with |actual - expected| <= atol + rtol * |expected|; kept tokens may differ",
            "from the expected ones only where the two tokens' expected scores are within that tolerance.",
            *UNEVEN_DESCRIPTION * any("head_budgets" in case for _, cases in groups for case in cases),
        ],
        "notes": {flag: FLAGS[flag] for flag in used},
        "number_of_cases": n_cases,
        "groups": [{"params": params, "cases": cases} for params, cases in groups],
    }

