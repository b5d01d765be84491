"""Score-function test vectors read back: one JSON file per policy, cases grouped by parameters.

A case is one eviction decision of one layer: the candidates' keys, values, positions
and per-token state, the block's queries (and attention weights), the budget, and the
reference outputs: the scores, the protected mask and the kept column indices.
:func:`read_vectors` reads a file (:mod:`refkv.oracle.encode` writes them);
:class:`VectorCase` holds one case and rebuilds its view (:meth:`VectorCase.view`);
:func:`as_vector_case` accepts a case in any of its forms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..attention import attention_weights
from ..cache import EMPTY
from ..policies import Policy, View, policy_class
from ..policies import get as get_policy
from .io import read_json
from .schema import VECTORS_SCHEMA, check_header, decode_array, require
from .synthetic import config_for

__all__ = [
    "MODES",
    "STAGES",
    "EncodedCase",
    "VectorCase",
    "VectorFile",
    "as_vector_case",
    "json_params",
    "python_params",
    "read_vectors",
]

#: When a case's eviction runs: after the block attended (the block is the last ``block``
#: columns of ``keys``) or before (the block's keys are stored apart).
STAGES = ("after-attention", "before-attention")
#: ``"oneshot"``: the whole prompt is one block (full square causal attention over all ``T``
#: tokens, then one eviction to ``N``: kvpress's regime); ``"block"``: block prompt processing
#: (the block size is ``sizes.block``). Files without the key are block mode.
MODES = ("oneshot", "block")


class EncodedCase(dict):
    """What :func:`~refkv.oracle.encode.encode_case` returns: a case's JSON object, written to files as it is.

    A ``dict`` that also remembers its policy's name and parameters (``policy_name``,
    ``params``; attributes, never written: a file states them once per group), so that
    :func:`refkv.testing.assert_case` and :func:`refkv.oracle.cases.compare_case` accept it
    in place of a :class:`VectorCase` (:func:`as_vector_case`). It lives here, beside
    :class:`VectorCase`, because reading accepts it; :mod:`refkv.oracle.encode` makes it.
    """

    def __init__(self, obj: dict, policy_name: str, params: dict):
        super().__init__(obj)
        self.policy_name = policy_name
        self.params = params


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
        queries = get("queries", (s["n_heads"], b, d))
        attention = self.inputs.get("attention")
        if (attention is None and "queries" in self.inputs and self.policy_name
                and "attention" in policy_class(self.policy_name).needs):
            # A case made from a candidate's own state (refkv.oracle.ownstate) stores the queries:
            # the weights are recomputed from them, so that a perturbed query or key moves them.
            attention = attention_weights(queries, keys, self.inputs["query_positions"], positions)
        return View(layer=self.layer, n_layers=self.n_layers, keys=keys, values=values,
                    positions=positions, fields=dict(self.fields),
                    queries=queries, query_positions=self.inputs["query_positions"],
                    block_keys=block_keys, block_values=block_values, attention=attention,
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
        :func:`~refkv.oracle.encode.encode_case` returns, or a case object read from a vectors file.
    policy : Policy, optional
        The case's policy, for a plain dict (what :func:`~refkv.oracle.encode.encode_case` returns knows its own).

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
