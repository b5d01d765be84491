"""The policy axes of the experiment grids: default lists, baselines, MAT's grid, labels.

A policy is named on the command line and in the records by a *spec*: ``name`` or
``name:param=value,param=value`` (values are Python literals, or plain words taken as
strings), e.g. ``caote:base=h2o,fast=True``, read by :mod:`refkv.policies.spec`.
:func:`~refkv.policies.spec.canonical_spec` puts the parameters in sorted order so one
policy has one spec (and one cell key).
"""

from __future__ import annotations

import math

from .. import policies
from ..policies.spec import canonical_spec, make_policy, parse_spec

__all__ = [
    "COMPARABLE_BASELINES",
    "FAST_CAOTE",
    "best_of_grid",
    "configuration",
    "default_policies",
    "equal_memory_budget",
    "evicting_policies",
    "format_spec_label",
    "grid_axes",
    "mat_grid",
    "policy_cells",
]

#: The CAOTE variants of the default list with FastCAOTE (Eq. 22) instead.
FAST_CAOTE = tuple(f"{spec},fast=True" for spec in policies.policy_class("caote").card.experiment_specs)


def format_spec_label(spec: str) -> str:
    """A short human label: a policy's ``label`` (``keydiff`` -> ``KeyDiff``), ``caote:base=h2o`` ->
    ``H2O+CAOTE``; specs with other parameters unchanged."""
    name, params = parse_spec(spec)
    if name == "caote" and set(params) <= {"base", "fast"}:
        base = str(params.get("base", "h2o"))
        upper = (policies.policy_class(base).card.label or base) if base in policies.available() else base
        return f"{upper}+{'Fast' if params.get('fast') else ''}CAOTE"
    return (policies.policy_class(name).card.label or name) if spec == name else spec


def evicting_policies() -> list[str]:
    """The default specs of every evicting policy, in ``table_order``: each class's
    ``experiment_specs``, or its name (classes with ``in_experiments = False`` left out)."""
    classes = sorted((policies.policy_class(name) for name in policies.available()),
                     key=lambda cls: (cls.card.table_order, cls.name))
    return [spec for cls in classes if cls.evicts and cls.in_experiments
            for spec in (cls.card.experiment_specs or (cls.name,))]


def default_policies(extra: tuple[str, ...] = (), *, caote: bool = True) -> list[str]:
    """The default evicting policies (canonical specs), then ``extra``.

    ``caote=False`` leaves out the CAOTE variants of the default list (``extra`` is kept).
    """
    base = [spec for spec in evicting_policies() if caote or not spec.startswith("caote")]
    return [canonical_spec(spec) for spec in dict.fromkeys((*base, *extra))]


def grid_axes(settings, policies, budgets, blocks) -> tuple[list[str], list, list]:
    """The grid's policies (canonical specs), budgets and block sizes: the user's settings
    where given, else these defaults."""
    return ([canonical_spec(p) for p in (settings.policies or policies)], list(settings.budgets or budgets),
            list(settings.blocks or blocks))


def policy_cells(base: dict, policies, budgets, blocks) -> list[dict]:
    """One cell per evicting policy x budget x block size (``full`` left out), each ``base`` plus
    ``policy``, ``budget`` and ``block``."""
    return [{**base, "policy": policy, "budget": budget, "block": block}
            for policy in policies if policy != "full" for budget in budgets for block in blocks]


# -- comparable baselines (issue 16) -------------------------------------------------------
#: Baselines under the configurations the seed papers compare against, run beside each
#: policy's own default: L2 with HashEvict's protection (first 4 + last 10, HashEvict
#: Sec. 4); H2O as KeyDiff App. A.1 and CAOTE Sec. 2 score it (accumulated attention, no
#: recent window), with CAOTE and FastCAOTE over it; KeyDiff with a recent reserve of 25%
#: and 50% (KeyDiff Table 11). The defaults (L2 unprotected, H2O with ``r = N // 2``,
#: KeyDiff reserve 0) stay in the list, so every table shows both.
COMPARABLE_BASELINES = (
    "knorm:recent=10,sink=4",
    "h2o:recent=0",
    "caote:base=h2o,base_params={'recent': 0}",
    "caote:base=h2o,base_params={'recent': 0},fast=True",
    "keydiff:reserve=0.25",
    "keydiff:reserve=0.5",
)

#: MAT Sec. 5.1 grid-searches the anchor cache size beta; refkv also varies the shallow layers L_s.
MAT_BETAS = (8, 16, 32, 48, 64)
MAT_SHALLOW_LAYERS = (0, 2, 10)


def mat_grid(budget: int, n_layers: int | None, betas=MAT_BETAS, shallow=MAT_SHALLOW_LAYERS) -> list[str]:
    """MAT specs over ``beta`` x ``shallow_layers`` that can run at budget ``budget`` on a model of
    ``n_layers`` layers (None: any): ``beta < budget`` (room for the recent window) and
    ``L_s <= n_layers``."""
    return [canonical_spec(f"mat:beta={beta},shallow_layers={layers}")
            for beta in betas if beta < budget for layers in shallow if n_layers is None or layers <= n_layers]


def equal_memory_budget(spec: str, budget: int | None, block: int | None) -> int | None:
    """The budget at which ``spec`` holds at most as many keys at its peak as an evict-before
    policy at ``budget``: ``budget - block``. A policy that evicts after attention holds its
    ``N`` kept keys plus the block's ``B`` while the block attends; one that evicts before
    attention makes room for the block first, so it holds ``N`` in all (issue 16: equal
    peak memory). None when the modes already match (evict-before policy, no budget,
    ``B = 1``) or no budget would be left."""
    if budget is None or block is None or block <= 1 or make_policy(spec).evict_before_attention:
        return None
    matched = budget - block
    return matched if matched >= 1 else None


def configuration(spec: str) -> str:
    """Every parameter of the policy ``spec`` builds, defaults included: ``"recent=None"`` for
    plain ``h2o``, so a table row says its configuration even when the spec does not."""
    policy = make_policy(spec)
    # Every dataclass field (a policy may leave a default out of params()), then params()
    # (which spells a wrapped base out as plain values).
    params = {**{f: getattr(policy, f) for f in getattr(policy, "__dataclass_fields__", {})}, **policy.params()}
    return ", ".join(f"{k}={params[k]!r}" if isinstance(params[k], str) else f"{k}={params[k]}"
                     for k in sorted(params)) or "(no parameters)"


def best_of_grid(rows: list[dict], name: str, *, by: str, group=("budget", "block")) -> None:
    """Mark, per ``group``, the row of policy ``name`` with the lowest ``by`` (``best_of_grid``
    column True, other rows of that policy False): a grid search reported as its best cell,
    as MAT Sec. 5.1 reports its beta search. Rows without a value of ``by`` are not candidates."""
    best: dict[tuple, dict] = {}
    for row in rows:
        if parse_spec(row["policy"])[0] != name:
            continue
        row["best_of_grid"] = False
        value = row.get(by)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        key = tuple(row.get(k) for k in group)
        if key not in best or value < best[key][by]:
            best[key] = row
    for row in best.values():
        row["best_of_grid"] = True
