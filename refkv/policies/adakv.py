"""``adakv``: Ada-KV (Feng et al., 2024), head-adaptive budget allocation over a base score.

Ada-KV keeps a layer's total budget, ``N`` tokens per KV head times ``Hkv`` heads, but
lets the heads share it unevenly: the layer keeps the ``N * Hkv`` highest scores over all
its heads *jointly*, and each head keeps as many tokens as it has among them (Ada-KV
Algorithm 1). Its bound on the attention-output error of eviction is a sum over heads of
the attention mass each head evicts, which the joint top-``N * Hkv`` minimises for the
total. A safeguard keeps at least a fraction ``alpha`` of the uniform budget in every head.

With :math:`a_{h,j}` head ``h``'s scores normalised to a distribution (the paper's
attention weights), the protected tokens and each head's first
:math:`F = \\lfloor \\alpha N \\rfloor` tokens (in the head's own order: protected, then
score, then position) forced in, the layer keeps

.. math:: \\mathcal K = \\operatorname{top}_{N H_{kv}}
          \\{(\\mathrm{forced}_{h,j},\\, a_{h,j},\\, p_{h,j},\\, -h)\\},
          \\qquad B_h^* = |\\{j : (h, j) \\in \\mathcal K\\}|,
          \\qquad \\sum_h B_h^* = N H_{kv},

and head ``h`` keeps its own top :math:`B_h^*`, which is exactly :math:`\\mathcal K`
restricted to ``h`` (the order within a head is the same).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import numpy as np

from ..cache import EMPTY, FieldSpec
from ..model.config import ModelConfig
from ..validation import check_choice, check_float
from .base import Policy, View, available, get, policy_class, register
from .caote import normalise
from .card import PolicyCard
from .full import Full

__all__ = ["FORMS", "AdaKV", "allocate", "authors_allocation", "build_base", "head_view", "safeguard"]

#: ``"paper"``: each head's base scores normalised to sum to 1 (the attention weights the
#: paper's bound is stated for) and a safeguard of ``floor(alpha * N)``; ``"kvpress"``:
#: kvpress's ``AdaKVPress``, raw base scores compared across heads and a safeguard of at
#: least one token when ``alpha > 0``.
FORMS = ("paper", "kvpress", "authors")
#: The authors' code ``form="authors"`` reproduces (Ada-SnapKV, without ``gqa_support``).
AUTHORS_SOURCE = ("FFY0/AdaKV@efe4e2eea0099bf497f0c175ac5440a915d89f83:adaptive_snapkv/monkeypatch/snapkv_utils.py:"
                  "297-370, 507-610 (AdaptiveSnapKVCluster.update_kv_wo_gqa); with base_params gqa_agg: lines "
                  "335-358, 380-501 (update_kv_gqa, gqa_support=True)")
#: The group reductions the Ada-KV code's ``gqa_support`` path accepts (``gqa_func``, ``snapkv_utils.py:330``).
GQA_FUNCS = ("max", "mean")


def authors_allocation(candidates: np.ndarray, share: int, alpha: float) -> np.ndarray:
    """Candidates each head keeps in the authors' Ada-SnapKV: (Hkv,) int64.

    ``snapkv_utils.py:303-306, 564-578`` at efe4e2e: the joint top ``H * B'`` of every head's
    candidate scores (``B' = N - w``, the window excluded) counted per head, ``c_h``, then
    ``round((1 - alpha) * c_h + int(B' * alpha))`` in float32 (``torch.round``: half to even).
    Ties across heads are given to the lower head, then the earlier token (``torch.topk``
    orders equal values by no stable rule).

    Parameters
    ----------
    candidates : (Hkv, C) float array
        Each head's scores of its candidates (the tokens before the window).
    share : int
        ``B'``, at most ``C``.
    alpha : float
    """
    hkv, c = candidates.shape
    flat = candidates.ravel()
    heads = np.repeat(np.arange(hkv), c)
    order = np.lexsort((np.tile(np.arange(c), hkv), heads, -flat))
    counts = np.bincount(heads[order[:hkv * share]], minlength=hkv)
    floor = int(share * alpha)
    mixed = counts.astype(np.float32) * np.float32(1 - alpha) + np.float32(floor)
    return np.round(mixed).astype(np.int64)


def build_base(base, base_params, owner: str, refuse: tuple[str, ...] = ()) -> Policy:
    """The base policy of a meta-policy ``owner``: a registered name (with ``base_params``)
    or a policy object; ``full`` (nothing to evict), policies that evict before attention
    (the allocation is made after the block attends) and the names in ``refuse`` are refused."""
    if isinstance(base, Policy):
        if base_params:
            raise ValueError("base_params must be empty when base is a policy object")
        policy = base
    elif isinstance(base, str):
        params = {} if base_params is None else base_params
        if not isinstance(params, Mapping) or any(not isinstance(key, str) for key in params):
            raise ValueError(f"base_params must be a dict of parameter names to values, got {params!r}")
        policy = get(base, **params)
    else:
        raise ValueError(f"base must be a policy name or a Policy, got {type(base).__name__}")
    if policy.name in refuse:
        raise ValueError(f"{owner}: base={policy.name!r} is not allowed: these meta-policies do not nest in "
                         f"{owner} (their own budgets or infinite scores would be lost): {', '.join(refuse)}")
    if isinstance(policy, Full):
        raise ValueError(f"{owner}: base='full' never evicts (it protects every token); choose an evicting base")
    if policy.evict_before_attention:
        allowed = ", ".join(name for name in available() if policy_class(name).evicts
                            and not policy_class(name).evict_before_attention and name not in ("adakv", "pyramidkv"))
        raise ValueError(f"{owner}: base={policy.name!r} evicts before attention; the base must evict after the "
                         f"block attends: one of {allowed}")
    return policy


def safeguard(keep: int, alpha: float, form: str = "paper") -> int:
    """Tokens every head keeps whatever the other heads score: ``floor(alpha * keep)``.

    kvpress (``form="kvpress"``) computes ``int(keep * alpha)`` and raises it to 1 when
    ``alpha > 0`` and ``keep > 0``.
    """
    floor = int(np.floor(alpha * keep))
    if form == "kvpress" and alpha > 0 and keep > 0:
        floor = max(1, floor)
    return floor


def allocate(scores: np.ndarray, positions: np.ndarray, protected: np.ndarray, lengths: np.ndarray,
             total: int, floor: int) -> np.ndarray:
    """Ada-KV's allocation (Algorithm 1 with the safeguard): tokens each head keeps.

    Parameters
    ----------
    scores : (Hkv, n) float array
        Comparable across heads (normalised, or kvpress's raw scores). NaN is an error.
    positions : (Hkv, n) int array
    protected : (Hkv, n) bool array
        Tokens that must stay (counted in their head's share).
    lengths : (Hkv,) ints
        Real tokens per head (the first ``lengths[h]`` columns; the rest are empty slots).
    total : int
        Tokens the layer keeps, ``N * Hkv`` (at most ``lengths.sum()``).
    floor : int
        The safeguard: each head's first ``floor`` tokens in its own order are forced in.

    Returns
    -------
    (Hkv,) int64 counts summing to ``min(total, lengths.sum())``.
    """
    hkv = scores.shape[0]
    if np.isnan(scores).any():
        raise ValueError("scores contain NaN; a policy must return comparable scores")
    heads, forced, values, where = [], [], [], []
    for h in range(hkv):
        n_h = int(lengths[h])
        s, p, prot = scores[h, :n_h], positions[h, :n_h], protected[h, :n_h]
        order = np.lexsort((-p, -s, ~prot))  # the head's own order: protected, score, position
        force = prot.copy()
        force[order[:max(floor, int(prot.sum()))]] = True
        heads.append(np.full(n_h, h))
        forced.append(force)
        values.append(s)
        where.append(p)
    heads, forced = np.concatenate(heads), np.concatenate(forced)
    values, where = np.concatenate(values), np.concatenate(where)
    # lexsort sorts by its last key first: forced, then score, then position (all descending),
    # then the lower head (ascending) for a tie across heads at equal positions.
    order = np.lexsort((heads, -where, -values, ~forced))
    chosen = order[:min(int(total), len(order))]
    return np.bincount(heads[chosen], minlength=hkv).astype(np.int64)


def head_view(view: View, h: int) -> View:
    """Head ``h`` of ``view`` alone, without its empty slots: one KV head, its query group.

    What a base policy scores when the heads hold different counts, so that an empty slot
    never enters a real token's score (a mean of keys, a pooling window, a recent window).
    ``config`` is left as it is (it still describes the whole layer).
    """
    n_h = int(np.count_nonzero(view.positions[h] != EMPTY))
    g = view.group_size
    return replace(view, keys=view.keys[h:h + 1, :n_h], values=view.values[h:h + 1, :n_h],
                   positions=view.positions[h:h + 1, :n_h],
                   fields={name: a[h:h + 1, :n_h] for name, a in view.fields.items()},
                   queries=view.queries[h * g:(h + 1) * g], block_keys=view.block_keys[h:h + 1],
                   block_values=view.block_values[h:h + 1],
                   attention=None if view.attention is None else view.attention[h:h + 1, ..., :n_h])


def _uneven(view: View) -> bool:
    return bool((view.positions == EMPTY).any())


def _per_head(view: View, method, fill) -> np.ndarray:
    """``method`` of each head's own view, written back into the columns of its real tokens."""
    out = None
    for h in range(view.n_kv_heads):
        part = np.asarray(method(head_view(view, h)))[0]
        if out is None:
            out = np.full((view.n_kv_heads, view.n, *part.shape[1:]), fill, dtype=part.dtype)
        out[h, :part.shape[0]] = part
    return out


@register
@dataclass(frozen=True)
class AdaKV(Policy):
    """Ada-KV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
    Allocation for Efficient LLM Inference"), over any base policy's scores.

    Score of token ``j`` of head ``h`` (higher = keep): the base's score, normalised per
    head to sum to 1 (``form="paper"``) or as it is (``form="kvpress"``). Each eviction keeps
    ``view.keep * Hkv`` tokens in the layer, allocated across the heads by :func:`allocate`
    with the safeguard :func:`safeguard`; protected tokens and per-token state are the
    base's.

    Parameters
    ----------
    base : str or Policy, default "snapkv"
        The base score (Ada-SnapKV is the paper's main instance). With ``form="paper"`` its
        class must declare ``nonnegative_scores``; a base that evicts before attention is
        refused.
    alpha : float, default 0.2
        The safeguard fraction, ``0 <= alpha <= 1`` (kvpress's ``alpha_safeguard`` default).
    form : {"paper", "kvpress", "authors"}, default "paper"
        See :data:`FORMS`. ``"authors"``: FFY0/AdaKV@efe4e2e's Ada-SnapKV (``update_kv_wo_gqa``):
        for a one-shot prompt each head keeps :func:`authors_allocation`'s count of its
        candidates plus its window, scored by SnapKV's authors' form; later evictions keep
        every token. Needs ``base="snapkv"``. On GQA the code's default selects per query head
        (run it on :func:`refkv.model.heads.repeat_kv_heads` of the model); its
        ``gqa_support=True, gqa_func=F`` (``update_kv_gqa``: group reduced by ``F`` before
        pooling, one cache per KV head, ``H_kv B'`` allocated jointly) is
        ``base_params={"gqa_agg": F}``, ``F`` in :data:`GQA_FUNCS`.
    base_params : dict, optional
        Parameters of the base when ``base`` is a name (``adakv:base=snapkv`` and
        ``--param "base_params={'window': 8}"`` on the command line).

    Notes
    -----
    * **Normalisation**: the paper allocates over attention weights, each head's a
      distribution; ``form="paper"`` makes any non-negative base score one (divided by its
      sum over the head's candidates, CAOTE's :func:`~refkv.policies.caote.normalise`).
      kvpress compares the base's raw scores across heads (``form="kvpress"``), which for
      SnapKV differs from the paper's only by the window's per-head share of the mass, and
      for signed scores (KeyDiff, Knorm) is the only form.
    * **Safeguard**: ``floor(alpha * N)`` per head, the protected tokens counting towards it;
      kvpress raises it to at least 1 when ``alpha > 0``. This is kvpress's form of the
      safeguard; the authors' code (FFY0/AdaKV@efe4e2e, ``snapkv_utils.py:303-306, 564-578``)
      mixes the joint counts with the uniform budget instead, ``round((1 - alpha) c_h +
      floor(alpha (N - w)))``, over the candidates only, each head's window on top (see the
      documentation page).
    * **Ties across heads**: equal scores go to the larger position, then to the lower head.
    * **Budget**: ``view.keep`` per head on average: the layer keeps ``keep * Hkv``; a head
      may keep up to every token it holds. With uneven heads the cache holds empty slots
      (:mod:`refkv.cache`); the base then scores each head on its own real tokens
      (:func:`head_view`), so an empty slot never changes a real token's score.
    * **Layer budgets** are the base's (``adakv:base=pyramidkv`` is the paper's Ada-Pyramid).
    """

    name = "adakv"
    card = PolicyCard(
        summary="Ada-KV: a layer's N x Hkv budget allocated across its KV heads by the top scores of all heads",
        paper="Feng et al. 2024, Ada-KV, Algorithm 1 with the safeguard alpha = 0.2 (base: snapkv by default)",
        label="AdaKV",
        citation="Ada-KV (Feng et al. 2024), meta-policy",
        score_rule="a base's scores, normalised per head; top :math:`N H_{kv}` over the layer's heads",
        protects="the base's; :math:`\\lfloor\\alpha N\\rfloor` per head",
        implements="Ada-KV: head-adaptive budgets (Alg. 1, safeguard) over any base; kvpress's AdaKVPress as form",
        table_order=110,
        variants=({"base": "snapkv", "base_params": {"window": 4, "kernel": 3}},
                  {"base": "h2o"},
                  {"base": "keydiff", "form": "kvpress"}),
    )
    in_experiments = False  # uneven caches: the experiments read N real tokens per head
    shares_layer_budget = True  # one selection over the layer's heads (Eqs. 5-7)
    needs = frozenset({"attention"})
    #: Each form's source and what proves it (``refkv policies --forms``).
    forms = MappingProxyType({
        "paper": {"source": "Feng et al. 2024, Ada-KV, Algorithm 1 with the safeguard floor(alpha N) forced per head",
                  "proven": "not proven against code: the authors' code mixes the allocation with the uniform one "
                            "(form='authors')"},
        "authors": {"source": AUTHORS_SOURCE,
                    "proven": "identical on 5 configurations without GQA and 7 with (tests/authors/adakv/): per "
                              "query head on repeat_kv_heads(tiny) (model tiny-kv-repeated), per KV head with "
                              "base_params gqa_agg (gqa_support=True); max pooling up to exact torch.topk ties"},
        "kvpress": {"source": "kvpress 0.5.5 presses/adakv_press.py (AdaKVPress)",
                    "proven": "compared with kvpress in tests/interop/test_interop_grid.py"},
    })

    base: Any = "snapkv"
    alpha: float = 0.2
    form: str = "paper"
    base_params: Any = None

    def __post_init__(self):
        check_float("alpha", self.alpha, 0.0, 1.0)
        check_choice("form", self.form, FORMS)
        params = self.base_params
        if self.form == "authors":  # Ada-SnapKV: the SnapKV code's scores
            if self.base != "snapkv":
                raise ValueError(f"form='authors' is the authors' Ada-SnapKV: base must be 'snapkv', got {self.base!r}")
            params = {**(params or {}), "form": "authors"}
            if params.get("gqa_agg") not in (None, *GQA_FUNCS):  # snapkv_utils.py:328-330
                raise ValueError(f"adakv form='authors': the Ada-KV code's gqa_func (base_params gqa_agg) must be one "
                                 f"of {GQA_FUNCS}, got {params['gqa_agg']!r}")
        base = build_base(self.base, params, "adakv", refuse=("adakv", "caote"))
        # Ada-Pyramid: pyramidkv's scores are its own base's
        scorer = base.base_policy if base.name == "pyramidkv" else base
        if self.form == "paper" and not scorer.nonnegative_scores:
            raise ValueError(f"adakv: base={base.name!r} has signed scores, which form='paper' cannot normalise "
                             f"into a distribution per head; use form='kvpress' (raw scores across heads) or a "
                             f"base with non-negative scores")
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "needs", frozenset(base.needs))

    @property
    def base_policy(self) -> Policy:
        """The wrapped policy object."""
        return self._base

    def params(self) -> dict:
        """Plain parameters (a base given as an object appears as its name and parameters)."""
        if isinstance(self.base, Policy):
            return {"base": self._base.name, "alpha": self.alpha, "form": self.form,
                    "base_params": self._base.params()}
        return {"base": self.base, "alpha": self.alpha, "form": self.form, "base_params": self.base_params}

    def check(self, budget: int, config: ModelConfig) -> None:
        self._base.check(budget, config)

    def layer_budget(self, budget: int, layer: int, n_layers: int, tokens: int | None = None) -> int:
        return self._base.layer_budget(budget, layer, n_layers, tokens)

    def fields(self, config: ModelConfig) -> dict[str, FieldSpec]:
        return self._base.fields(config)

    def observe(self, view: View) -> dict[str, np.ndarray]:
        if not _uneven(view):
            return self._base.observe(view)
        out = {}
        for name, current in view.fields.items():
            array = np.array(current)  # empty slots keep what they hold (the field's fill)
            for h in range(view.n_kv_heads):
                part = self._base.observe(head_view(view, h)).get(name)
                if part is not None:
                    array[h, :part.shape[1]] = part[0]
            out[name] = array
        return out

    @staticmethod
    def _prompt(view: View) -> bool:
        return len(view.query_positions) == view.n

    def score(self, view: View) -> np.ndarray:
        """(Hkv, n) the base's scores, normalised per head (``form="paper"``); ``-inf`` in empty slots."""
        if self.form == "authors" and not self._prompt(view):
            # decoding: every token is kept (head_budgets); the base is not asked, since SnapKV's
            # authors' form refuses any block but the prompt
            return np.zeros(view.positions.shape)
        if _uneven(view):
            base = _per_head(view, self._base.score, -np.inf)
        else:
            base = np.asarray(self._base.score(view))
        if self.form in ("kvpress", "authors"):
            return base
        lengths = view.head_lengths
        out = np.full(base.shape, -np.inf, dtype=np.result_type(base.dtype, np.float32))
        for h, n_h in enumerate(lengths):
            out[h, :n_h] = normalise(base[h, :n_h])  # ValueError for a negative score
        return out

    def protected(self, view: View) -> np.ndarray:
        if self.form == "authors" and not self._prompt(view):
            return np.zeros(view.positions.shape, dtype=bool)
        if _uneven(view):
            return _per_head(view, self._base.protected, False)
        return np.asarray(self._base.protected(view), dtype=bool)

    def head_budgets(self, view: View) -> np.ndarray:
        """(Hkv,) tokens each head keeps: :func:`allocate` of the layer's ``view.keep * Hkv``."""
        lengths = view.head_lengths
        if self.form == "authors":
            return self._authors_budgets(view, lengths)
        return allocate(self.score(view), view.positions, self.protected(view), lengths,
                        view.keep * view.n_kv_heads, safeguard(view.keep, self.alpha, self.form))

    def _authors_budgets(self, view: View, lengths: np.ndarray) -> np.ndarray:
        """The authors' counts (window on top) for a one-shot prompt; every token otherwise."""
        window = int(self._base.window)
        share, n_candidates = view.keep - window, view.n - window
        if not self._prompt(view) or share > n_candidates:  # decoding, or snapkv_utils.py:557-560
            return lengths
        scores = np.asarray(self.score(view))[:, :n_candidates]
        return np.minimum(authors_allocation(scores, share, self.alpha) + window, lengths)
