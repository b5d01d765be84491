"""Each round of a schedule judged on the candidate's own state.

A backend in bfloat16 on a real checkpoint drifts away from the float64 reference: its
keys at round 3 are not the reference's keys, so whether it kept the right tokens cannot
be read off the reference's decision (any tolerance wide enough for the model's drift
accepts a random choice). What can be judged is each decision **on what the candidate had
at that step**. A candidate that records, per round and layer, the inputs of its eviction

* ``state_positions`` (R, L, Hkv, C) int: the positions of the rows it held before the
  round's eviction, the step's own tokens included (its candidates), ``-1`` padding;
* ``state_keys``, ``state_values`` (R, L, Hkv, C, d_head) float: those rows' keys and values;
* ``state_queries`` (R, L, H, W, d_head) float: the last ``W`` queries of the step, after
  RoPE, for a policy that reads rows of the attention weights (SnapKV's window, TOVA's
  last query: ``W = min(policy.attention_need().rows, tokens in the step)``);

is judged decision by decision: refkv builds the policy's :class:`~refkv.policies.View`
from those inputs (the rows sorted by position; attention weights recomputed from the
queries and keys, causal, in float64), computes its scores, protected set and kept set,
and compares the candidate's kept set with that decision -- a vector case
(:func:`refkv.oracle.cases.compare_case`) per round and layer. The tolerance is that
decision's own rounding in the candidate's dtype (:func:`refkv.oracle.tolerance.score_tolerance`:
the inputs rounded to the dtype and perturbed by its backward error), not the model's
accumulated drift. After an accepted tie the next round is judged on the candidate's own
branch, so no decision is left "downstream" and uncompared.

Whether the state itself is what the candidate's previous round left is checked too: the
positions of round ``r``'s state are round ``r - 1``'s kept positions plus the tokens fed
since, and (with ``row_keys``/``row_values``) each kept row holds, bit for bit, the key and
value its state held for that position.

Policies judged this way read keys, values, positions and rows of the attention weights,
and keep no per-token state across rounds (:func:`unjudgeable` says why another is not):
``keydiff``, ``knorm``, ``sink``, ``tova``, ``snapkv``, ``pyramidkv``, ``adakv`` and
``caote`` over such a base.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..cache import EMPTY
from ..model.config import ModelConfig
from ..policies import Policy
from .vectors import VectorCase, json_params

__all__ = ["STATE_ARRAYS", "TOKEN_ARRAYS", "OffBranch", "query_rows", "replay_layer", "replayable", "round_case",
           "state_given", "step_span", "step_spans", "tokens_given", "unjudgeable", "view_case"]

#: The arrays a schedule candidate gives for its decisions to be judged on its own state.
STATE_ARRAYS = ("state_positions", "state_keys", "state_values", "state_queries")


def state_given(candidate: dict) -> bool:
    """Whether ``candidate`` holds the state arrays (``state_queries`` only where needed)."""
    return all(name in candidate for name in STATE_ARRAYS[:3])


def unjudgeable(policy: Policy, config: ModelConfig) -> str | None:
    """None if a decision of ``policy`` can be recomputed from a round's state arrays, else why not."""
    if policy.evict_before_attention:
        return f"{policy.name} evicts before attention (its decision precedes the step's own tokens)"
    if policy.fields(config):
        return f"{policy.name} keeps per-token state across rounds ({', '.join(policy.fields(config))})"
    if "queries" in policy.needs:
        return f"{policy.name} reads the step's queries themselves, not rows of the attention weights"
    if "attention" in policy.needs:
        need = _need(policy)
        if need.whole or need.column_sums:
            return (f"{policy.name} reads {'every row' if need.whole else 'the column sums'} of the step's "
                    f"attention weights")
    return None


def query_rows(policy: Policy) -> int:
    """``W``: how many of a step's last queries a judged decision of ``policy`` reads (0: none)."""
    if "attention" not in policy.needs:
        return 0
    return int(_need(policy).rows or 0)


def _need(policy: Policy):
    """What ``policy`` reads of the weights; a wrapper that asks the engine for the whole matrix
    only to hand each head's slice to its base (AdaKV) reads what its base reads."""
    need = policy.attention_need()
    base = getattr(policy, "base_policy", None)
    return base.attention_need() if need.whole and isinstance(base, Policy) and "attention" in base.needs else need


def step_span(manifest: dict, r: int) -> tuple[int, int]:
    """``(first position, token count)`` of round ``r``'s forward call (a prefill block or one decoded token)."""
    info = manifest["rounds"][r]
    end = int(info["position"])
    if info["phase"] == "decode":
        return end - 1, 1
    block = manifest["schedule"].get("block_size")
    first = 0 if block is None else int(info["step"]) * int(block)
    return first, end - first


def round_case(policy: Policy, manifest: dict, r: int, layer: int, positions: np.ndarray, keys: np.ndarray,
               values: np.ndarray, queries: np.ndarray | None) -> VectorCase:
    """The vector case of round ``r``, layer ``layer`` built from the candidate's state.

    Parameters
    ----------
    positions : (Hkv, C) int
        The state's positions in the candidate's row order, ``-1`` padding.
    keys, values : (Hkv, C, d) float
    queries : (H, W, d) float or None
        The step's last ``W`` queries (:func:`query_rows`).

    Returns
    -------
    VectorCase
        Inputs in float64, rows sorted by position per head (empty slots last), outputs
        refkv's decision on them (its policy, budget and layer are the round's).
    """
    cfg = manifest["model"]["config"]
    n_layers, n_heads, hkv, d = (int(cfg[k]) for k in ("n_layers", "n_heads", "n_kv_heads", "d_head"))
    # Rows sorted by position, empty slots (-1) last: a View's positions increase along each row.
    sort_key = np.where(positions < 0, EMPTY, positions)
    order = np.argsort(sort_key, axis=1, kind="stable")                                  # (Hkv, C)
    pos = np.take_along_axis(positions, order, axis=1).astype(np.int64)
    real = pos >= 0
    width = int(real.sum(axis=1).max()) if pos.size else 0
    order, pos = order[:, :width], pos[:, :width]
    k = np.take_along_axis(np.asarray(keys, dtype=np.float64), order[..., None], axis=1)   # (Hkv, n, d)
    v = np.take_along_axis(np.asarray(values, dtype=np.float64), order[..., None], axis=1)
    first, count = step_span(manifest, r)
    w = min(query_rows(policy), count)
    inputs = {"positions": pos, "keys": k, "values": v,
              "query_positions": np.arange(first + count - w, first + count, dtype=np.int64)}
    if w:
        inputs["queries"] = np.asarray(queries, dtype=np.float64)[:, -w:]                # (H, W, d)
    # the layer's budget as the engine gives it (kvpress's PyramidKV caps it at the tokens held)
    budget = policy.layer_budget(int(manifest["rounds"][r]["budget"]), layer, n_layers, tokens=width)
    case = VectorCase(id=r * n_layers + layer, comment=f"round {r}, layer {layer} on the candidate's own state",
                      flags=("own state",), params=json_params(policy.params()), dtype="float64",
                      stage="after-attention", layer=layer, n_layers=n_layers, budget=budget,
                      sizes={"n_heads": n_heads, "n_kv_heads": hkv, "d_head": d, "n": width, "block": w},
                      tolerance={"rtol": 0.0, "atol": 0.0}, inputs=inputs, fields={}, outputs={},
                      policy_name=policy.name, mode="block")
    view = case.view()
    with np.errstate(all="ignore"):
        scores = np.asarray(policy.score(view), dtype=np.float64)
    protected = np.asarray(policy.protected(view), dtype=bool)
    kept = policy.keep_indices(view)
    head_budgets = None
    if isinstance(kept, list):  # uneven budgets: one row per head, padded with -1
        head_budgets = tuple(len(row) for row in kept)
        padded = np.full((hkv, max(head_budgets, default=0)), -1, dtype=np.int64)
        for h, row in enumerate(kept):
            padded[h, :len(row)] = row
        kept = padded
    case.outputs.update(scores=scores, protected=protected, kept=np.asarray(kept, dtype=np.int64))
    if head_budgets is not None:
        case = replace(case, head_budgets=head_budgets)
    return case



#: The arrays a schedule candidate gives for a policy with per-token state to be replayed:
#: every token's query, key and value at every layer, as the candidate computed them.
TOKEN_ARRAYS = ("token_queries", "token_keys", "token_values")


def tokens_given(candidate: dict) -> bool:
    """Whether ``candidate`` holds :data:`TOKEN_ARRAYS`."""
    return all(name in candidate for name in TOKEN_ARRAYS)


def replayable(policy: Policy, config: ModelConfig) -> bool:
    """Whether ``policy``'s decisions are judged by a replay of the candidate's tokens (a policy
    with per-token state, or one that evicts before attention), not from one round's state."""
    return policy.evict_before_attention or bool(policy.fields(config))


def step_spans(manifest: dict) -> list[tuple[int, int]]:
    """``(first position, token count)`` of every forward call of a schedule golden: the
    prompt's blocks (one block in one-shot prefill), then one call per decoded token."""
    t = int(manifest["prompt"]["length"])
    block = manifest["schedule"].get("block_size")
    b = t if block is None else int(block)
    spans = [(first, min(b, t - first)) for first in range(0, t, b)]
    return spans + [(t + i, 1) for i in range(int(manifest["decode"]["length"]))]


class OffBranch(ValueError):
    """The candidate's kept set at round ``round`` names a position its replayed cache does not hold."""

    def __init__(self, message: str, round: int):
        super().__init__(message)
        self.round = round


def replay_layer(policy: Policy, manifest: dict, layer: int, queries: np.ndarray, keys: np.ndarray,
                 values: np.ndarray, kept: np.ndarray, counts: np.ndarray):
    """Yield ``(round, view)`` of every round of one layer, replayed on the candidate's tokens.

    The layer's cache is rebuilt step by step from the candidate's own queries, keys and
    values (``(H, P, d)``, ``(Hkv, P, d)`` for the ``P`` tokens fed) through
    :func:`refkv.engine.layer_step` -- the step the engine runs, so per-token state (H2O's
    accumulated attention, HashEvict's codes) is computed as refkv computes it -- and after
    each round it keeps what the **candidate** kept (``kept`` (R, Hkv, K) positions,
    ``counts`` (R,)): the next round is judged on the candidate's own branch. The view is the
    one refkv's policy decides on at that round (also when the cache fits its budget).
    Raises ``OffBranch`` if the candidate keeps a position its cache cannot hold.
    """
    from ..cache import LayerCache
    from ..engine import decision_view, layer_step
    from ..model.config import ModelConfig

    cfg = ModelConfig(**manifest["model"]["config"])
    cache = LayerCache(cfg.n_kv_heads, cfg.d_head, np.float64, policy.fields(cfg))
    rounds = {int(info["step"]): r for r, info in enumerate(manifest["rounds"])}
    for step, (first, count) in enumerate(step_spans(manifest)):
        r = rounds.get(step)
        seen: list = []

        def evict(view, keep, stage, r=r, seen=seen, first=first):
            seen.append((decision_view(view, keep), stage))
            # before attention the step's own tokens are appended after the eviction
            cache.keep(_candidate_columns(view.positions, kept[r], int(counts[r]), r,
                                          first if stage == "before-attention" else None))

        span = slice(first, first + count)
        layer_step(policy, cache, np.asarray(queries[:, span], dtype=np.float64),
                   np.asarray(keys[:, span], dtype=np.float64), np.asarray(values[:, span], dtype=np.float64),
                   layer=layer, n_layers=cfg.n_layers, evict=evict, evict_always=r is not None, config=cfg,
                   budget=None if r is None else int(manifest["rounds"][r]["budget"]), attention="matrix")
        if r is not None:
            yield r, seen[0][0]


def _candidate_columns(positions: np.ndarray, kept: np.ndarray, count: int, r: int, block_first: int | None = None):
    """Columns of ``positions`` (Hkv, n; EMPTY in empty slots) holding the candidate's kept positions
    (those before ``block_first``, the step's first token, when the eviction precedes the step's tokens)."""
    rows = []
    for h in range(positions.shape[0]):
        want = np.sort(kept[h, :count][kept[h, :count] >= 0])
        if block_first is not None:
            want = want[want < block_first]
        column = {int(p): c for c, p in enumerate(positions[h]) if p != EMPTY}
        missing = [int(p) for p in want if int(p) not in column]
        if missing:
            raise OffBranch(f"head {h}: the candidate keeps position {missing[0]} after round {r}, which its own "
                            f"cache did not hold at that round", r)
        rows.append(np.array([column[int(p)] for p in want], dtype=np.int64))
    if len({len(row) for row in rows}) == 1:
        return np.stack(rows)
    return rows


def view_case(policy: Policy, view, case_id: int, comment: str) -> VectorCase:
    """The vector case of a replayed decision: refkv's outputs on the candidate's inputs
    (:func:`refkv.oracle.encode.encode_case`, so the case holds what its outputs follow from)."""
    from .encode import encode_case
    from .vectors import as_vector_case

    return as_vector_case(encode_case(policy, view, case_id=case_id, comment=comment, extra_flags=("replayed",)))
