"""``pyramidkv``: PyramidKV (Cai et al., 2024), a pyramid of per-layer budgets.

PyramidKV observes that attention funnels from broad in the low layers to a few tokens
in the high ones, and gives the low layers more cache and the high layers less, in an
arithmetic sequence with the same total as a uniform budget. With ``L`` layers, an
average of ``M`` tokens per head to share and the steepness ``beta``,

.. math:: k^{L-1} = \\frac{M}{\\beta}, \\qquad k^{0} = 2M - k^{L-1}, \\qquad
          k^{l} = k^{0} - \\frac{k^{0} - k^{L-1}}{L - 1}\\, l, \\qquad
          \\sum_{l=0}^{L-1} k^{l} = L M,

and each layer selects its tokens by SnapKV's pooled attention of the last ``w`` queries,
the ``w`` most recent tokens always kept. As in the authors' code (Zefan-Cai/KVCache-Factory
@c97f9d7, ``pyramidkv/pyramidkv_utils.py:360-370``) the schedule shares what the window
leaves, ``M = N - w`` (``max_capacity_prompt - window_size``), and every layer keeps its
window on top: layer ``l`` holds ``w + k^l`` tokens per head, ``N`` on average here. The
authors' code floors ``M / beta`` and the step, so its layers keep more (``N = 128, w = 8,
L = 32``: 4016 candidates against 3840), and below a prompt of ``2M`` it keeps ``M`` in every
layer (lines 373-406); see the documentation page.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType
from typing import Any

import numpy as np

from ..cache import FieldSpec
from ..model.config import ModelConfig
from ..validation import check_choice, check_float, check_int
from .adakv import build_base
from .base import AttentionNeed, Policy, View, register
from .card import PolicyCard

__all__ = ["FORMS", "PyramidKV", "factory_keep", "kvpress_schedule", "pyramid_schedule"]

#: ``"paper"``: :func:`pyramid_schedule` of ``N - w`` plus the window, summing to ``N * L``
#: exactly; ``"kvpress"``: :func:`kvpress_schedule`, kvpress's ``PyramidKVPress``;
#: ``"authors"``: the authors' ``PyramidKVCluster`` (:func:`factory_keep`, SnapKV's authors' form).
FORMS = ("paper", "kvpress", "authors")
#: The authors' code ``form="authors"`` reproduces.
AUTHORS_SOURCE = ("Zefan-Cai/KVCache-Factory@c97f9d706d63d1b56e980f8b81b2a924c21162b3:"
                  "pyramidkv/pyramidkv_utils.py:348-438 (PyramidKVCluster.update_kv, query-head path); with "
                  "base_params gqa_agg: lines 440-467 (_update_kv_kv_head, kv_cache_granularity='kv_head')")


def factory_keep(budget: int, window: int, n_layers: int, beta: float, layer: int, prompt: int) -> int:
    """Tokens per head the authors' ``PyramidKVCluster`` keeps in ``layer`` after a prompt of ``prompt``.

    KVCache-Factory@c97f9d7, ``pyramidkv/pyramidkv_utils.py:360-406``, with ``M = N - w``:
    ``min_num = M // beta``, ``max_num = 2M - min_num``; if ``max_num >= T - w`` then
    ``max_num = T - w`` and ``min_num = 2M - max_num``; ``steps = (max_num - min_num) // (L - 1)``.
    A prompt ``T < N`` is not compressed (``T``); ``N <= T < 2M`` keeps ``M`` candidates plus the
    window (``N``); otherwise ``max_num - layer * steps`` candidates plus the window. Python's
    floor division throughout, as the code's.

    Parameters
    ----------
    budget, window : int
        ``max_capacity_prompt`` and ``window_size``; ``budget > window >= 1``.
    n_layers : int
        ``L >= 2`` (the code divides by ``L - 1``).
    beta : float
    layer : int
    prompt : int
        ``T``, the prompt's length.
    """
    budget, window = check_int("budget", budget, 2), check_int("window", window, 1, budget - 1)
    n_layers = check_int("n_layers", n_layers, 2)
    layer, prompt = check_int("layer", layer, 0, n_layers - 1), check_int("prompt", prompt, 0)
    share = budget - window
    low = share // beta
    high = share * 2 - low
    if high >= prompt - window:
        high = prompt - window
        low = share * 2 - high
    steps = (high - low) // (n_layers - 1)
    if prompt < budget:
        return prompt
    if prompt < share * 2:
        return budget
    keep = high - layer * steps
    if not 0 <= keep <= prompt - window:
        raise ValueError(f"the authors' schedule gives layer {layer} {keep} candidates of {prompt - window} "
                         f"(budget={budget}, window={window}, beta={beta}): torch.topk would refuse it")
    return int(keep) + window


def pyramid_schedule(total: int, n_layers: int, beta: float) -> list[int]:
    """PyramidKV's arithmetic schedule of an average ``total`` tokens per layer, in integers.

    The real budgets :math:`k^l` of the module docstring (with ``M = total``), computed
    exactly (fractions), become integers that keep the sum and the order: every layer gets
    :math:`\\lfloor k^l \\rfloor` and the :math:`LM - \\sum_l \\lfloor k^l \\rfloor` tokens
    left (fewer than ``L``) go one each to the lowest layers, the ones with the most.

    Parameters
    ----------
    total : int
        ``M >= 0``: the average per layer.
    n_layers : int
        ``L >= 1``; one layer gets ``M``.
    beta : float
        ``>= 1``; ``beta = 1`` is uniform.

    Returns
    -------
    list of ``L`` ints, non-increasing, summing to ``L * M``.
    """
    total = check_int("total", total, 0)
    n_layers = check_int("n_layers", n_layers, 1)
    beta = check_float("beta", beta, 1.0)
    if n_layers == 1:
        return [total]
    top = Fraction(total) / Fraction(beta)
    bottom = 2 * Fraction(total) - top
    real = [bottom - (bottom - top) * layer / (n_layers - 1) for layer in range(n_layers)]
    floors = [int(np.floor(k)) for k in real]  # Fraction -> exact floor
    left = n_layers * total - sum(floors)
    return [f + (1 if layer < left else 0) for layer, f in enumerate(floors)]


def kvpress_schedule(budget: int, n_layers: int, beta: float, window: int, tokens: int | None = None) -> list[int]:
    """kvpress's ``PyramidKVPress.get_layer_budget``, every layer's budget for ``tokens`` in the cache.

    With ``N = budget`` (kvpress's ``q_len * (1 - compression_ratio)``, here an integer) and
    ``q = tokens`` (kvpress's ``q_len``, the tokens the layer holds when it compresses):

    * ``min = N / beta``, ``max = 2N - min`` (the window inside the budget);
    * **the cap**: if ``max >= q - window``, then ``max = q - window`` and ``min = 2N - max``
      (the bottom layer may not keep more than the prompt less the window; what it gives up
      goes to the top layers, the total staying ``N * L``);
    * every layer falls back to ``N`` unless ``q >= max >= min >= window``;
    * layer ``l`` keeps ``round(max - l (max - min) / (L - 1))`` (Python's ``round``, half
      to even); one layer keeps ``round(max)``.

    ``tokens=None`` is a prompt long enough never to cap (the engine's budget check, which
    knows no prompt). Read from kvpress 0.5.5, ``kvpress/presses/pyramidkv_press.py``
    (``get_layer_budget``); the comparisons ``>=`` and the rounding are kvpress's.
    """
    budget = check_int("budget", budget, 1)
    n_layers = check_int("n_layers", n_layers, 1)
    beta = check_float("beta", beta, 1.0)
    if tokens is not None:
        tokens = check_int("tokens", tokens, 1)
    low = budget / beta
    high = 2 * budget - low
    if tokens is not None and high >= tokens - window:
        high = tokens - window
        low = 2 * budget - high
    if not ((tokens is None or tokens >= high) and high >= low >= window):
        return [budget] * n_layers
    steps = (high - low) / (n_layers - 1) if n_layers > 1 else 0.0
    return [round(high - layer * steps) for layer in range(n_layers)]


@register
@dataclass(frozen=True)
class PyramidKV(Policy):
    """PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on
    Pyramidal Information Funneling"): per-layer budgets in a pyramid, over a base score.

    Layer ``l`` of ``L`` keeps ``w + k^l`` tokens per KV head (``form="paper"``,
    :func:`pyramid_schedule` of ``N - w``) or kvpress's :func:`kvpress_schedule`; within a
    layer every head keeps the same count, chosen by the base's scores and protected set.
    ``w`` is the base's observation window (SnapKV's ``window``; 0 for a base without one).

    Parameters
    ----------
    base : str or Policy, default "snapkv"
        The scorer (SnapKV's pooled window attention is the paper's); any base that evicts
        after attention, as kvpress allows.
    beta : float, default 20
        The steepness, ``>= 1``: the top layer gets ``1/beta`` of the average (the paper's
        and kvpress's default, 20).
    form : {"paper", "kvpress", "authors"}, default "paper"
        See :data:`FORMS`. ``"authors"`` reproduces KVCache-Factory@c97f9d7's ``PyramidKVCluster``
        (query-head path): a one-shot prompt of ``T >= N`` is compressed once, layer ``l``
        keeping :func:`factory_keep` tokens per head (floored schedule, uniform ``N`` for
        ``T < 2(N - w)``, the window on top), scored by SnapKV's authors' form (float32
        softmax); later evictions keep every token (the code never evicts while decoding).
        Needs ``base="snapkv"``. On GQA: per query head (the code's default) on
        :func:`refkv.model.heads.repeat_kv_heads` of the model; per KV head (its opt-in
        ``kv_head`` layout, ``gqa_score_agg``) with ``base_params={"gqa_agg": ...}``.
    base_params : dict, optional
        Parameters of the base when it is a name.

    Notes
    -----
    * **Total**: with ``form="paper"`` the layers' budgets sum to exactly ``N * L`` and are
      non-increasing in the layer (integers by :func:`pyramid_schedule`); kvpress rounds each
      layer on its own, so its total may miss ``N * L`` by up to ``L / 2``, and a one-layer
      model keeps ``2N - N/beta``.
    * **Window**: the authors' code reserves the window in every layer and schedules the rest
      (``M = N - w``); kvpress schedules the whole budget with the window inside, and falls
      back to ``N`` in every layer when the smallest layer would not hold the window.
    * **The prompt's length** (``form="kvpress"`` only): kvpress caps the bottom layer at the
      tokens the layer holds less the window, ``q - w``, and gives what it cut to the top
      layers; the engine hands each layer's token count to :meth:`layer_budget` (``tokens``)
      so the cap applies exactly where kvpress's does (at ``q = 4096``, ratio 0.25 the
      uncapped schedule would give the bottom layer 5990 tokens, more than the prompt).
    * **Budget check**: the base is checked at ``N``; a layer's budget may be as small as the
      window (the top layer then keeps only its window, as in the paper's code), never 0
      (refused: such a layer would hold nothing).
    * **Per-token state** and protected tokens are the base's; ``view.budget`` and ``view.keep``
      are the layer's own.
    """

    name = "pyramidkv"
    card = PolicyCard(
        summary="PyramidKV: per-layer budgets in an arithmetic pyramid (beta) summing to N x L, over a base score",
        paper="Cai et al. 2024, PyramidKV, the layer schedule with beta = 20 (base: snapkv by default)",
        label="PyramidKV",
        citation="PyramidKV (Cai et al. 2024), meta-policy",
        score_rule="a base's scores (SnapKV's by default); per-layer budgets in a pyramid",
        protects="the base's",
        implements="PyramidKV: the layer schedule (beta), total N x L, over any base; kvpress's PyramidKVPress as form",
        table_order=120,
        variants=({"base": "snapkv", "base_params": {"window": 4, "kernel": 3}, "beta": 4},
                  {"base": "tova", "beta": 2},
                  # kvpress's form pyramids only when N / beta >= w: a window of 1, beta 2
                  {"base": "snapkv", "base_params": {"window": 1, "kernel": 3}, "form": "kvpress", "beta": 2}),
    )
    in_experiments = False  # per-layer budgets: the experiments compare policies at one N in every layer
    needs = frozenset({"attention"})
    #: Each form's source and what proves it (``refkv policies --forms``).
    forms = MappingProxyType({
        "paper": {"source": "Cai et al. 2024, PyramidKV, the layer schedule (beta); exact integers summing to N x L "
                            "(refkv's rounding)",
                  "proven": "not proven against code: the authors' code floors the step and keeps more "
                            "(form='authors')"},
        "authors": {"source": AUTHORS_SOURCE,
                    "proven": "identical on 6 configurations without GQA and 8 with (tests/authors/pyramidkv/): "
                              "per query head on repeat_kv_heads(tiny) (model tiny-kv-repeated), per KV head with "
                              "base_params gqa_agg (the kv_head layout); max pooling up to exact torch.topk ties"},
        "kvpress": {"source": "kvpress 0.5.5 presses/pyramidkv_press.py (PyramidKVPress.get_layer_budget)",
                    "proven": "compared with kvpress in tests/interop/test_interop_grid.py"},
    })

    base: Any = "snapkv"
    beta: float = 20
    form: str = "paper"
    base_params: Any = None

    def __post_init__(self):
        check_float("beta", self.beta, 1.0)
        check_choice("form", self.form, FORMS)
        params = self.base_params
        if self.form == "authors":  # the code's scores are SnapKV's authors' form
            if self.base != "snapkv":
                raise ValueError(f"form='authors' runs over the authors' SnapKV scores: base must be 'snapkv', "
                                 f"got {self.base!r}")
            params = {**(params or {}), "form": "authors"}
        base = build_base(self.base, params, "pyramidkv", refuse=("adakv", "pyramidkv"))
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "needs", frozenset(base.needs))

    @property
    def base_policy(self) -> Policy:
        return self._base

    @property
    def window(self) -> int:
        """``w``: the base's observation window (0 if it has none)."""
        return int(getattr(self._base, "window", 0))

    def params(self) -> dict:
        if isinstance(self.base, Policy):
            return {"base": self._base.name, "beta": self.beta, "form": self.form, "base_params": self._base.params()}
        return {"base": self.base, "beta": self.beta, "form": self.form, "base_params": self.base_params}

    def layer_budgets(self, budget: int, n_layers: int, tokens: int | None = None) -> list[int]:
        """Every layer's budget per KV head under the engine's ``N = budget``.

        ``tokens``: the tokens a layer holds when it compresses (kvpress's ``q_len``), which
        ``form="kvpress"`` caps its bottom layer with (:func:`kvpress_schedule`); the paper's
        form does not depend on it.
        """
        if self.form == "kvpress":
            return kvpress_schedule(budget, n_layers, self.beta, self.window, tokens)
        if self.form == "authors":
            # when to evict: above N in every layer (the code compresses a prompt of at least N, and
            # one of exactly N keeps it whole); how many the layer keeps: head_budgets (factory_keep)
            return [budget] * n_layers
        w = min(self.window, budget)
        return [w + k for k in pyramid_schedule(budget - w, n_layers, self.beta)]

    def layer_budget(self, budget: int, layer: int, n_layers: int, tokens: int | None = None) -> int:
        return self.layer_budgets(budget, n_layers, tokens)[layer]

    def check(self, budget: int, config: ModelConfig) -> None:
        self._base.check(budget, config)
        budgets = self.layer_budgets(budget, config.n_layers)
        if min(budgets) < 1:  # a layer of budget 0 would hold nothing (kvpress's topk(0))
            raise ValueError(f"budget must leave every layer at least one token under beta={self.beta}: the "
                             f"schedule for budget={budget} is {budgets}")

    def attention_need(self) -> AttentionNeed:
        """The base's (the base's scores are all this policy reads of the weights)."""
        return self._base.attention_need()

    def fields(self, config: ModelConfig) -> dict[str, FieldSpec]:
        return self._base.fields(config)

    def observe(self, view: View) -> dict[str, np.ndarray]:
        return self._base.observe(view)

    def head_budgets(self, view: View) -> np.ndarray:
        """Even budgets (the base's default), or in ``form="authors"`` :func:`factory_keep` of the
        prompt for a one-shot prompt and every token while decoding (the code never evicts then)."""
        if self.form != "authors":
            return super().head_budgets(view)
        if not self._prompt(view):
            return view.head_lengths
        keep = factory_keep(view.budget, self.window, view.n_layers, self.beta, view.layer, view.n)
        return np.minimum(keep, view.head_lengths)

    @staticmethod
    def _prompt(view: View) -> bool:
        return len(view.query_positions) == view.n

    def score(self, view: View) -> np.ndarray:
        if self.form == "authors" and not self._prompt(view):
            return np.zeros(view.positions.shape)  # every token is kept (head_budgets): no decision
        return self._base.score(view)

    def protected(self, view: View) -> np.ndarray:
        if self.form == "authors" and not self._prompt(view):
            return np.zeros(view.positions.shape, dtype=bool)
        return self._base.protected(view)
