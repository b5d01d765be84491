"""Score-function test vectors: one JSON file per policy, cases grouped by parameters.

A case is one eviction decision of one layer: the candidates' keys, values, positions
and per-token state, the block's queries (and attention weights), the budget, and the
reference outputs: the scores, the protected mask and the kept column indices.
:func:`encode_case` turns a :class:`~refkv.policies.View` into a case; :class:`VectorCase`
reads one back and rebuilds the view (:meth:`VectorCase.view`).

Only what the policy reads is stored. The generator checks that claim: it recomputes the
outputs from a view where every array it did not store is NaN (and attention is
``None``); if they differ, it stores every input (see ``docs/oracle/format.rst``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..cache import EMPTY
from ..policies import Policy, View
from ..policies import get as get_policy
from .schema import (
    FLAGS,
    FLOAT_FORMAT,
    VECTORS_SCHEMA,
    check_header,
    decode_array,
    encode_array,
    header,
    require,
)
from .synthetic import config_for, max_abs_logit

__all__ = [
    "DEFAULT_TOLERANCE",
    "MODES",
    "EncodedCase",
    "VectorCase",
    "VectorFile",
    "as_vector_case",
    "boundary_gap",
    "candidate_document",
    "case_flags",
    "case_mode",
    "encode_case",
    "kept_rows",
    "read_vectors",
    "tolerance_for",
    "vectors_document",
]

#: Relative tolerance of score comparisons per dtype; the absolute tolerance is the same
#: number times ``max(1, largest finite |score|)`` (see :func:`tolerance_for`).
DEFAULT_TOLERANCE = {"float64": 1e-10, "float32": 1e-5}

# Signals -> the stored inputs that carry them (positions and fields are always stored).
_SIGNAL_INPUTS = {"keys": ("keys", "block_keys"), "values": ("values", "block_values"),
                  "queries": ("queries",), "attention": ("attention",), "positions": ()}
_ALL_INPUTS = ("keys", "values", "block_keys", "block_values", "queries", "attention")
STAGES = ("after-attention", "before-attention")
#: What a vectors file holding uneven cases (AdaKV) adds to its description.
UNEVEN_DESCRIPTION = (
    "A case with head_budgets keeps head_budgets[h] tokens in head h (their sum is layer_total): its kept",
    "rows end in -1, and -1 in inputs.positions marks an empty slot (a head holding fewer tokens).",
)
#: ``"oneshot"``: the whole prompt is one block (full square causal attention over all ``T``
#: tokens, then one eviction to ``N``: kvpress's regime); ``"block"``: block prompt processing
#: (the block size is ``sizes.block``). Files without the key are block mode.
MODES = ("oneshot", "block")


def tolerance_for(dtype, scores: np.ndarray) -> dict:
    """The per-case tolerance: ``rtol`` by dtype, ``atol = rtol * max(1, max |finite score|)``.

    An absolute floor scaled by the scores' magnitude covers scores near zero (a cosine
    close to 0 has an error of order ``eps * 1``, not ``eps * |cos|``).
    """
    rtol = DEFAULT_TOLERANCE[np.dtype(dtype).name]
    finite = np.abs(np.asarray(scores, dtype=np.float64))
    finite = finite[np.isfinite(finite)]
    scale = max(1.0, float(finite.max())) if finite.size else 1.0
    return {"rtol": rtol, "atol": rtol * scale}


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


def case_mode(view: View, stage: str) -> str:
    """``"oneshot"`` if the view's block is the whole prompt (it starts at position 0 and the
    candidates are exactly its tokens, after attention), else ``"block"``."""
    b = len(view.query_positions)
    whole = (stage == "after-attention" and b == view.n and b > 0 and int(view.query_positions[0]) == 0)
    return "oneshot" if whole else "block"


class EncodedCase(dict):
    """What :func:`encode_case` returns: a case's JSON object, written to files as it is.

    A ``dict`` that also remembers its policy's name and parameters (``policy_name``,
    ``params``; attributes, never written: a file states them once per group), so that
    :func:`refkv.testing.assert_case` and :func:`refkv.oracle.cases.compare_case` accept it
    in place of a :class:`VectorCase` (:func:`as_vector_case`).
    """

    def __init__(self, obj: dict, policy_name: str, params: dict):
        super().__init__(obj)
        self.policy_name = policy_name
        self.params = params


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
        ``{"rtol", "atol"}``; default :func:`tolerance_for`.
    mode : {"oneshot", "block"}, optional
        Default: read from the view (:func:`case_mode`); a ``"oneshot"`` that the view
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
    b = len(view.query_positions)
    stage = "before-attention" if policy.evict_before_attention else "after-attention"
    if stage == "after-attention" and not np.array_equal(
            np.take_along_axis(view.keys, _last_columns(view, b)[..., None], axis=1), view.block_keys):
        raise ValueError("after attention the block must be the last B columns of the cache (of each head's "
                         "tokens)")
    seen = case_mode(view, stage)
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


def json_params(params: dict) -> dict:
    """Policy parameters in JSON form (tuples become lists); ValueError if not representable."""
    def convert(x, where):
        if x is None or isinstance(x, (bool, int, float, str)):
            if isinstance(x, float) and not np.isfinite(x):
                raise ValueError(f"parameter {where} is not finite: {x!r}")
            return x
        if isinstance(x, np.generic):
            return convert(x.item(), where)
        if isinstance(x, (list, tuple)):
            return [convert(v, f"{where}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, dict):
            return {str(k): convert(v, f"{where}.{k}") for k, v in x.items()}
        raise ValueError(f"parameter {where} = {x!r} cannot be written to JSON")
    return {k: convert(v, k) for k, v in params.items()}


def python_params(params: dict) -> dict:
    """Policy parameters from JSON: top-level lists become tuples (frozen dataclass fields)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}


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
    from ..policies import policy_class

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


@dataclass(frozen=True)
class VectorCase:
    """One test vector, read back from JSON.

    Attributes
    ----------
    id : int
    comment : str
    flags : tuple of str
    params : dict
        The policy's parameters (the group's).
    dtype : str
    stage : str
        ``"after-attention"`` or ``"before-attention"``.
    mode : str
        ``"oneshot"`` (the whole prompt is one block) or ``"block"`` (:data:`MODES`).
    layer, n_layers, budget : int
    sizes : dict
        ``n_heads``, ``n_kv_heads``, ``d_head``, ``n`` (candidates), ``block``.
    tolerance : dict
        ``rtol``, ``atol``.
    inputs : dict of str to ndarray
        The stored inputs (``fields`` excluded).
    fields : dict of str to ndarray
        Per-token state.
    outputs : dict of str to ndarray
        ``scores``, ``protected``, ``kept`` (a candidate file may hold only ``kept``).
    head_budgets : tuple of int or None
        Tokens each KV head keeps, when the heads keep different counts (uneven budgets,
        AdaKV); ``kept`` is then as wide as the largest and each shorter row ends in ``-1``,
        and ``inputs["positions"]`` holds ``-1`` in a head's empty slots. ``None``: every
        head keeps ``min(budget, n)``.
    """

    id: int
    comment: str
    flags: tuple
    params: dict
    dtype: str
    stage: str
    layer: int
    n_layers: int
    budget: int
    sizes: dict
    tolerance: dict
    inputs: dict = field(repr=False)
    fields: dict = field(repr=False)
    outputs: dict = field(repr=False)
    policy_name: str = ""
    mode: str = "block"
    head_budgets: tuple | None = None

    def policy(self) -> Policy:
        """The policy object this case was generated with."""
        return get_policy(self.policy_name, **python_params(self.params))

    def view(self) -> View:
        """The :class:`~refkv.policies.View` of this case.

        Inputs the file does not hold (the policy does not read them) are NaN arrays of
        the right shape; attention is ``None`` when absent. After attention the block's
        keys and values are the last ``block`` columns of ``keys`` and ``values``.
        """
        s = self.sizes
        dtype = np.dtype(self.dtype)
        hkv, n, d, b = s["n_kv_heads"], s["n"], s["d_head"], s["block"]

        def get(name, shape):
            return self.inputs[name] if name in self.inputs else np.full(shape, np.nan, dtype=dtype)

        keys, values = get("keys", (hkv, n, d)), get("values", (hkv, n, d))
        positions = self.inputs["positions"]
        if (positions == -1).any():  # empty slots: a file's -1 is the cache's EMPTY
            positions = np.where(positions == -1, EMPTY, positions)
        if self.stage == "after-attention":
            # the block is each head's last b real tokens (the last b columns when no slot is empty)
            last = np.count_nonzero(positions != EMPTY, axis=1)[:, None] - b + np.arange(b)  # (Hkv, b)
            block_keys = np.take_along_axis(keys, last[..., None], axis=1)
            block_values = np.take_along_axis(values, last[..., None], axis=1)
        else:
            block_keys, block_values = get("block_keys", (hkv, b, d)), get("block_values", (hkv, b, d))
        return View(layer=self.layer, n_layers=self.n_layers, keys=keys, values=values,
                    positions=positions, fields=dict(self.fields),
                    queries=get("queries", (s["n_heads"], b, d)), query_positions=self.inputs["query_positions"],
                    block_keys=block_keys, block_values=block_values, attention=self.inputs.get("attention"),
                    budget=self.budget + (b if self.stage == "before-attention" else 0), keep=self.budget,
                    config=config_for(s["n_heads"], hkv, d, self.n_layers))

    @property
    def label(self) -> str:
        """``"keydiff case 7 [gqa, near-tie]"``: how reports name the case."""
        return f"{self.policy_name} case {self.id} [{', '.join(self.flags)}]"

    def __str__(self) -> str:
        """``"keydiff-7"``: a short id (for ``pytest.mark.parametrize(..., ids=str)``)."""
        return f"{self.policy_name}-{self.id}"


@dataclass(frozen=True)
class VectorFile:
    """A vectors file: its header and its cases (in file order)."""

    path: str
    meta: dict
    policy: str
    cases: list

    def case(self, case_id: int) -> VectorCase:
        for c in self.cases:
            if c.id == case_id:
                return c
        raise KeyError(case_id)


def _int(obj, key, where, low=0):
    value = require(obj, key, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where}: {key} must be an integer >= {low}, got {value!r}")
    return value


def _read_case(obj: dict, params: dict, policy: str, where: str, candidate: bool) -> VectorCase:
    case_id = _int(obj, "id", where)
    where = f"{where} (id {case_id})"
    outputs_obj = require(obj, "outputs", where)
    if not isinstance(outputs_obj, dict) or not isinstance(obj.get("flags", []), list):
        raise ValueError(f"{where}: outputs must be an object and flags a list")
    if candidate:
        outputs = {name: decode_array(outputs_obj[name], f"{where}: outputs.{name}")
                   for name in ("scores", "protected", "kept") if name in outputs_obj}
        if "kept" not in outputs:
            raise ValueError(f"{where}: missing field 'outputs.kept'")
        return VectorCase(id=case_id, comment=obj.get("comment", ""), flags=tuple(obj.get("flags", ())),
                          params=params, dtype=obj.get("dtype", ""), stage=obj.get("stage", ""),
                          layer=obj.get("layer", 0), n_layers=obj.get("n_layers", 1), budget=obj.get("budget", 0),
                          sizes=obj.get("sizes", {}), tolerance=obj.get("tolerance", {}), inputs={}, fields={},
                          outputs=outputs, policy_name=policy,
                          mode=obj.get("mode", "block") if obj.get("mode") in MODES else "block")

    dtype = require(obj, "dtype", where)
    if dtype not in ("float32", "float64"):
        raise ValueError(f"{where}: dtype must be 'float32' or 'float64', got {dtype!r}")
    stage = require(obj, "stage", where)
    if stage not in STAGES:
        raise ValueError(f"{where}: stage must be one of {STAGES}, got {stage!r}")
    mode = obj.get("mode", "block")
    if mode not in MODES:
        raise ValueError(f"{where}: mode must be one of {MODES}, got {mode!r}")
    n_layers = _int(obj, "n_layers", where, 1)
    layer = _int(obj, "layer", where)
    if layer >= n_layers:
        raise ValueError(f"{where}: layer {layer} must be < n_layers {n_layers}")
    budget = _int(obj, "budget", where)
    sizes_obj = require(obj, "sizes", where)
    sizes = {k: _int(sizes_obj, k, f"{where}: sizes", 0 if k == "n" else 1)
             for k in ("n_heads", "n_kv_heads", "d_head", "n", "block")}
    h, hkv, d, n, b = (sizes[k] for k in ("n_heads", "n_kv_heads", "d_head", "n", "block"))
    if h % hkv:
        raise ValueError(f"{where}: sizes.n_heads ({h}) must be a multiple of sizes.n_kv_heads ({hkv})")
    tol_obj = require(obj, "tolerance", where)
    tolerance = {}
    for key in ("rtol", "atol"):
        value = require(tol_obj, key, f"{where}: tolerance")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{where}: tolerance.{key} must be a number >= 0, got {value!r}")
        tolerance[key] = float(value)

    inputs_obj = require(obj, "inputs", where)
    shapes = {"positions": (hkv, n), "query_positions": (b,), "keys": (hkv, n, d), "values": (hkv, n, d),
              "block_keys": (hkv, b, d), "block_values": (hkv, b, d), "queries": (h, b, d),
              "attention": (hkv, h // hkv, b, n)}
    inputs = {}
    for name, shape in shapes.items():
        if name in inputs_obj:
            inputs[name] = decode_array(inputs_obj[name], f"{where}: inputs.{name}", shape=shape)
        elif name in ("positions", "query_positions"):
            raise ValueError(f"{where}: missing field 'inputs.{name}'")
    for name in ("positions", "query_positions"):
        if inputs[name].dtype.kind not in "iu":
            raise ValueError(f"{where}: inputs.{name} must be integers, got {inputs[name].dtype}")
    for name in ("keys", "values", "block_keys", "block_values", "queries", "attention"):
        if name in inputs and inputs[name].dtype != np.dtype(dtype):
            raise ValueError(f"{where}: inputs.{name} has dtype {inputs[name].dtype}, the case's dtype is {dtype}")
    fields = {}
    for name, enc in require(inputs_obj, "fields", where).items():
        fields[name] = decode_array(enc, f"{where}: inputs.fields.{name}")
        if fields[name].shape[:2] != (hkv, n):
            raise ValueError(f"{where}: shape mismatch: inputs.fields.{name} must start with ({hkv}, {n}), "
                             f"got {fields[name].shape}")
    head_budgets = None
    if "head_budgets" in obj:
        head_budgets = obj["head_budgets"]
        if (not isinstance(head_budgets, list) or len(head_budgets) != hkv
                or any(isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= n for c in head_budgets)):
            raise ValueError(f"{where}: head_budgets must be {hkv} integers in [0, {n}], got {head_budgets!r}")
        total = _int(obj, "layer_total", where)
        if total != sum(head_budgets):
            raise ValueError(f"{where}: layer_total is {total} but head_budgets sum to {sum(head_budgets)}")
        head_budgets = tuple(head_budgets)
    m = min(budget, n) if head_budgets is None else max(head_budgets)
    outputs = {
        "scores": decode_array(require(outputs_obj, "scores", f"{where}: outputs"), f"{where}: outputs.scores",
                               shape=(hkv, n)),
        "protected": decode_array(require(outputs_obj, "protected", f"{where}: outputs"),
                                  f"{where}: outputs.protected", shape=(hkv, n)),
        "kept": decode_array(require(outputs_obj, "kept", f"{where}: outputs"), f"{where}: outputs.kept",
                             shape=(hkv, m)),
    }
    if outputs["protected"].dtype != bool:
        raise ValueError(f"{where}: outputs.protected must be bool, got {outputs['protected'].dtype}")
    kept = outputs["kept"]
    if head_budgets is None:
        if kept.dtype.kind not in "iu" or (kept.size and (kept.min() < 0 or kept.max() >= n)):
            raise ValueError(f"{where}: outputs.kept must be integer column indices in [0, {n - 1}]")
    else:
        for h, count in enumerate(head_budgets):
            row = kept[h]
            if kept.dtype.kind not in "iu" or (count and (row[:count].min() < 0 or row[:count].max() >= n)) or (
                    row[count:] != -1).any():
                raise ValueError(f"{where}: outputs.kept row {h} must hold head_budgets[{h}] = {count} column indices "
                                 f"in [0, {n - 1}], then -1")
    return VectorCase(id=case_id, comment=obj.get("comment", ""), flags=tuple(require(obj, "flags", where)),
                      params=params, dtype=dtype, stage=stage, layer=layer, n_layers=n_layers, budget=budget,
                      sizes=sizes, tolerance=tolerance, inputs=inputs, fields=fields, outputs=outputs,
                      policy_name=policy, mode=mode, head_budgets=head_budgets)


def as_vector_case(case, policy: Policy | None = None) -> VectorCase:
    """``case`` as a :class:`VectorCase`: one as it is, or a case's JSON object decoded.

    Parameters
    ----------
    case : VectorCase or dict
        A :class:`VectorCase` (:func:`read_vectors`, :func:`refkv.testing.load_cases`), what
        :func:`encode_case` returns, or a case object read from a vectors file.
    policy : Policy, optional
        The case's policy, for a plain dict (what :func:`encode_case` returns knows its own).

    Raises
    ------
    ValueError
        If ``case`` is neither, or a plain dict comes without ``policy``, or the object is
        not a valid case (the message names the field).
    """
    if isinstance(case, VectorCase):
        return case
    if not isinstance(case, dict):
        raise ValueError(f"case must be a VectorCase (load_cases, read_vectors) or a case dict from encode_case, "
                         f"got {type(case).__name__}")
    if policy is not None:
        name, params = policy.name, json_params(policy.params())
    elif isinstance(case, EncodedCase):
        name, params = case.policy_name, case.params
    else:
        raise ValueError("a case dict read from a file does not name its policy: use the VectorCase from "
                         "read_vectors or load_cases, or as_vector_case(case, policy)")
    return _read_case(case, params, name, "case", candidate=False)


def read_vectors(path, *, candidate: bool = False) -> VectorFile:
    """Read and validate a vectors file.

    Parameters
    ----------
    path : path-like
    candidate : bool
        Read a candidate's file: only ``id`` and ``outputs.kept`` are required per case
        (``outputs.scores`` and ``outputs.protected`` are compared when present).

    Raises
    ------
    ValueError
        For an unknown schema version, a missing field, a shape mismatch or a bad value;
        the message names the file, the case and the field.
    """
    from .io import read_json

    path = Path(path)
    where = str(path)
    doc = read_json(path)
    check_header(doc, VECTORS_SCHEMA, where)
    policy = require(doc, "policy", where)
    groups = require(doc, "groups", where)
    if not isinstance(groups, list):
        raise ValueError(f"{where}: groups must be a list")
    cases, seen = [], set()
    for g, group in enumerate(groups):
        gwhere = f"{where}: groups[{g}]"
        if not isinstance(group, dict):
            raise ValueError(f"{gwhere}: expected a JSON object, got {type(group).__name__}")
        params = require(group, "params", gwhere) if not candidate else group.get("params", {})
        group_cases = require(group, "cases", gwhere)
        if not isinstance(group_cases, list) or not isinstance(params, dict):
            raise ValueError(f"{gwhere}: cases must be a list and params an object")
        for i, case in enumerate(group_cases):
            c = _read_case(case, params, policy, f"{gwhere}.cases[{i}]", candidate)
            if c.id in seen:
                raise ValueError(f"{gwhere}.cases[{i}]: duplicate case id {c.id}")
            seen.add(c.id)
            cases.append(c)
    if not candidate:
        count = require(doc, "number_of_cases", where)
        if count != len(cases):
            raise ValueError(f"{where}: number_of_cases is {count} but the file holds {len(cases)} cases")
    meta = {k: v for k, v in doc.items() if k != "groups"}
    return VectorFile(path=where, meta=meta, policy=policy, cases=cases)
