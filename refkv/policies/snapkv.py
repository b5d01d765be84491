"""``snapkv``: SnapKV (Li et al., 2024), attention of an observation window, pooled.

SnapKV scores each token by the attention it receives from the last ``w`` queries (the
"observation window"), summed over those queries and smoothed along the tokens by a 1-D
pooling of kernel ``k``; the ``w`` most recent tokens are always kept. In the notation of
KeyDiff App. A.1,

.. math:: \\phi_{\\mathrm{SnapKV}}(A) = (A^\\top \\mathbf{1}) * K,

with :math:`K` the averaging kernel :math:`(1/k, \\dots, 1/k)` and ``A`` restricted to the
window's queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model.config import ModelConfig
from ..validation import MAX_CONTEXT
from .base import AttentionNeed, Policy, View, check_int, recent_tokens, register
from .card import PolicyCard

__all__ = ["POOLINGS", "SnapKV", "pool1d", "window_attention"]

#: Pooling modes of :func:`pool1d`.
POOLINGS = ("avg", "max")


def window_attention(attention_by_kv_head: np.ndarray, window: int) -> np.ndarray:
    """Attention summed over the last ``min(window, B)`` queries: :math:`A_{W}^\\top \\mathbf 1`.

    Parameters
    ----------
    attention_by_kv_head : (..., B, n) array
    window : int
        ``w >= 1``.

    Returns
    -------
    (..., n) array, the same dtype.
    """
    window = check_int("window", window, 1)
    return attention_by_kv_head[..., -window:, :].sum(axis=-2)


def pool1d(x: np.ndarray, kernel: int, mode: str = "avg") -> np.ndarray:
    """1-D pooling along the last axis, stride 1, output as long as the input.

    The padding rule is PyTorch's ``avg_pool1d`` / ``max_pool1d`` with
    ``padding=kernel // 2`` (what the SnapKV code calls): ``kernel // 2`` entries are
    added at both ends; for ``"avg"`` they are zeros and every output divides by
    ``kernel`` (``count_include_pad=True``), so the ends are damped; for ``"max"`` they are
    ``-inf``, so the ends take the maximum over the real entries in reach.

    Parameters
    ----------
    x : (..., L) float array
    kernel : int
        Odd, ``>= 1`` (an even kernel would shift the output by half a token);
        ``kernel = 1`` returns ``x``.
    mode : {"avg", "max"}

    Returns
    -------
    (..., L) array, the dtype of ``x``.
    """
    kernel = check_int("kernel", kernel, 1)
    if kernel % 2 == 0:
        raise ValueError(f"kernel must be odd (output aligned with the tokens), got {kernel}")
    if mode not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {mode!r}")
    x = np.asarray(x)
    half = kernel // 2
    if x.shape[-1] == 0 or kernel == 1:
        return x.copy()
    fill = 0.0 if mode == "avg" else -np.inf
    pad = [(0, 0)] * (x.ndim - 1) + [(half, half)]
    windows = np.lib.stride_tricks.sliding_window_view(np.pad(x, pad, constant_values=fill), kernel, axis=-1)
    if mode == "avg":
        return windows.sum(axis=-1) / kernel
    return windows.max(axis=-1)


@register
@dataclass(frozen=True)
class SnapKV(Policy):
    """SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before
    Generation"; KeyDiff App. A.1, B.2).

    With :math:`\\bar A` the block's attention averaged over each KV head's query group
    (KeyDiff App. B.2) and :math:`W` its last :math:`\\min(w, B)` queries,

    .. math:: s_j = \\sum_{t \\in W} \\bar A_{t, j}, \\qquad
              \\mathrm{score} = \\mathrm{pool}_k(s_{1..n-w}) \\text{ on the prefix}, \\quad
              s_j \\text{ on the window},

    and the last ``w`` tokens are protected. Higher = keep.

    Parameters
    ----------
    window : int, default 32
        ``w``: queries in the observation window and recent tokens protected (KeyDiff App.
        B.2). Must be smaller than the budget (:meth:`check`).
    kernel : int, default 7
        ``k``: pooling kernel, odd (KeyDiff App. B.2).
    pooling : {"avg", "max"}, default "avg"
        Average pooling (the seed papers) or max pooling (also offered by the SnapKV code).
        Padding rule: :func:`pool1d`.

    Notes
    -----
    * **Pooling range**: as in the SnapKV paper's listing, pooling runs over the
      candidates only, the tokens before the protected window (``attn[..., :-w]``), so the
      window's weights never leak into the neighbouring candidates' scores; KeyDiff's
      compact :math:`(A^\\top\\mathbf 1) * K` glosses over this boundary. The protected
      window's tokens get their unpooled sum :math:`s_j`: it never decides their fate,
      but it gives them a non-negative score on the same scale, which CAOTE's
      normalisation reads.
    * **Sum, not mean**, over the window's queries (the SnapKV paper); kvpress takes the
      mean, a positive factor that changes no ranking.
    * **GQA**: the group is averaged before pooling. For average pooling the order does not
      matter (both are linear); for max pooling this is the max of the group mean.
    * **Block mode**: the observation window is the block's last :math:`\\min(w, B)`
      queries. The paper assumes one-shot prefill (``B = T``), where this is exactly its
      window. When ``B < w`` only the ``B`` queries of the current block exist (earlier
      queries' attention was not kept), so the window shrinks; with ``B = 1`` (token
      generation) SnapKV becomes the last query's pooled attention, TOVA smoothed, while
      the last ``w`` tokens stay protected.
    * **Cost**: it reads the window's ``w`` rows of the weights (:meth:`attention_need`),
      so the engine forms the weights of the query tiles that hold them only; in one-shot
      prefill of ``T`` tokens that is ``O(T x max(w, tile))`` weights per head, not ``T^2``.
    """

    name = "snapkv"
    card = PolicyCard(
        summary="SnapKV: last-w-queries attention, pooled (kernel k); last w tokens protected",
        paper="Li et al. 2024, SnapKV; w = 32, k = 7 (KeyDiff App. B.2)",
        label="SnapKV",
        citation="SnapKV (Li et al. 2024)",
        score_rule="attention of the last :math:`w = 32` queries, average-pooled (:math:`k = 7`)",
        protects="last :math:`w`",
        implements="SnapKV (Li et al. 2024): observation window, pooled (avg or max)",
        table_order=40,
        variants=({"window": 4, "kernel": 3}, {"window": 4, "kernel": 3, "pooling": "max"}),
    )
    needs = frozenset({"attention"})
    #: Scores are pooled attention weights, >= 0 (CAOTE may wrap this policy).
    nonnegative_scores = True

    window: int = 32
    kernel: int = 7
    pooling: str = "avg"

    def __post_init__(self):
        check_int("window", self.window, 1, MAX_CONTEXT)
        check_int("kernel", self.kernel, 1, MAX_CONTEXT + 1)
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd (output aligned with the tokens), got {self.kernel}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")

    def check(self, budget: int, config: ModelConfig) -> None:
        if self.window >= budget:
            raise ValueError(f"window must be < budget={budget} (room for pooled candidates), got {self.window}")

    def attention_need(self) -> AttentionNeed:
        """The observation window's rows of the weights: the last ``w``."""
        return AttentionNeed(rows=self.window)

    def score(self, view: View) -> np.ndarray:
        summed = window_attention(view.attention_last_rows(self.window).mean(axis=1), self.window)
        prefix = max(summed.shape[-1] - self.window, 0)
        scores = summed.copy()
        scores[..., :prefix] = pool1d(summed[..., :prefix], self.kernel, self.pooling)
        return scores

    def protected(self, view: View) -> np.ndarray:
        return recent_tokens(view, self.window)
