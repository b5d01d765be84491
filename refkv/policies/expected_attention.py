"""``expected_attention``: keys scored by the attention that future queries are expected to pay them.

ExpectedAttention is kvpress's question-agnostic press (NVIDIA kvpress,
``ExpectedAttentionPress``). It models the queries still to come as Gaussian, fitted to
the queries seen, and scores each key by the expected value of its unnormalised attention
weight. With :math:`\\tilde q_t` the queries *before* RoPE (one query head), over the
``m`` tokens after the first ``s`` (the sinks):

.. math::

    \\mu = \\frac1m \\sum_t \\tilde q_t, \\qquad
    \\Sigma = \\frac1m \\sum_t (\\tilde q_t - \\mu)(\\tilde q_t - \\mu)^\\top .

The next ``F`` positions' rotations are averaged, :math:`\\bar R = \\frac1F \\sum_{p=T}^{T+F-1}
R_p` (``T`` the next position), and moved onto the statistics:
:math:`\\mu' = \\bar R \\mu`, :math:`\\Sigma' = \\bar R \\Sigma \\bar R^\\top`. For
:math:`q \\sim \\mathcal N(\\mu', \\Sigma')` the Gaussian moment generating function gives

.. math::

    \\mathbb E\\left[e^{q \\cdot k_j / \\sqrt d}\\right]
      = \\exp\\left(\\frac{\\mu' \\cdot k_j}{\\sqrt d} + \\frac{k_j^\\top \\Sigma' k_j}{2 d}\\right)
      = e^{z_j},

and the score of key ``j`` (not a sink) is the softmax of :math:`z` over the non-sink keys,
averaged over the query heads of the KV group, times the value norm:

.. math:: s_j = \\left(\\frac1g \\sum_{h} \\mathrm{softmax}(z_h)_j + \\varepsilon\\right) \\lVert v_j \\rVert_2 .

The first ``s`` tokens are kept (kvpress pads their score with the maximum plus one).

Notes
-----
* **Queries before RoPE.** The engine shows the policy the queries after RoPE; they are
  rotated back by :math:`R_{p}^{-1} = R_{-p}` at their own positions with the model's
  RoPE (base and any frequency scaling, Llama 3.1's included), read from ``view.config``
  (the protocol's model facts): exact, since the rotation is orthogonal. A view without
  ``config`` is refused.
* **One-shot mode is kvpress's setting** (``B = None``): the statistics use every prompt
  query after the sinks and ``T`` is the prompt length. With blocks (an extension) they
  use the block's queries at positions ``>= s`` and ``T`` is the next position (kvpress
  would use the block length).
* **Which queries are sinks.** kvpress drops the first ``s`` hidden states of the forward
  pass; here, the queries at positions ``< s``: the same in one-shot mode.
* **Covariance** is the biased one (divide by ``m``), as kvpress; with ``m = 1`` it is 0.
* **GQA.** Statistics and softmax per query head, then the mean over the KV group: kvpress's
  order (it repeats the keys for each query head and averages after the softmax).
* **Sink scores.** The sinks are protected; their score is the maximum over every head's
  scores plus one, kvpress's value, so that the scores compare with the press's exactly.
* **Precision.** Computed in float64 whatever the model's dtype (exact to the definition).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from ..attention import softmax
from ..model.config import ModelConfig
from ..model.layers import apply_rope, rope_angles, rope_frequencies_of
from ..validation import MAX_CONTEXT, check_float, check_int
from .base import Policy, View, first_tokens, register
from .card import PolicyCard

__all__ = ["ExpectedAttention", "averaged_rotation", "expected_logits", "query_statistics", "unrotated_queries"]


def unrotated_queries(queries: np.ndarray, positions: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Queries before RoPE: ``queries`` (H, B, d) rotated back from ``positions`` (B,), float64."""
    cos, sin = rope_angles(-np.asarray(positions), config.d_head, config.rope_base, np.float64,
                           inv_freq=rope_frequencies_of(config))  # R_{-p}, the model's RoPE scaling included
    return apply_rope(np.asarray(queries, dtype=np.float64), cos, sin)  # (H, B, d)


def query_statistics(queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean (H, d) and biased covariance (H, d, d) of ``queries`` (H, m, d) over the ``m`` tokens."""
    mu = queries.mean(axis=1)  # (H, d)
    centred = queries - mu[:, None, :]  # (H, m, d)
    cov = np.einsum("hti,htj->hij", centred, centred) / queries.shape[1]  # (H, d, d)
    return mu, cov


def averaged_rotation(start: int, count: int, config: ModelConfig) -> np.ndarray:
    """:math:`\\bar R = \\frac1F \\sum_{p=start}^{start+F-1} R_p`, (d, d), the RoPE rotations averaged.

    :math:`R_p x = \\cos_p \\odot x + \\sin_p \\odot \\mathrm{rotate\\_half}(x)` (the pairing of
    :func:`refkv.model.layers.apply_rope`), so :math:`\\bar R = \\mathrm{diag}(\\bar c) +
    \\mathrm{diag}(\\bar s) P` with :math:`P x = \\mathrm{rotate\\_half}(x)`.
    """
    d = config.d_head
    cos, sin = rope_angles(np.arange(start, start + count), d, config.rope_base, np.float64,
                           inv_freq=rope_frequencies_of(config))  # (F, d)
    half = d // 2
    rotate_half = np.zeros((d, d))  # P: (P x)[:half] = -x[half:], (P x)[half:] = x[:half]
    rotate_half[:half, half:] = -np.eye(half)
    rotate_half[half:, :half] = np.eye(half)
    return np.diag(cos.mean(axis=0)) + sin.mean(axis=0)[:, None] * rotate_half  # (d, d)


def expected_logits(keys: np.ndarray, mu: np.ndarray, cov: np.ndarray | None) -> np.ndarray:
    """:math:`z_{h,j} = \\mu'_h \\cdot k_j / \\sqrt d + k_j^\\top \\Sigma'_h k_j / (2 d)`.

    Parameters
    ----------
    keys : (Hkv, n, d)
    mu : (H, d)
        Rotated query means, ``H = g Hkv`` query heads grouped under their KV head.
    cov : (H, d, d) or None
        Rotated covariances; ``None`` leaves the second term out.

    Returns
    -------
    (Hkv, g, n) float64
    """
    hkv, _, d = keys.shape
    g = mu.shape[0] // hkv
    k = keys.astype(np.float64)
    mu_g = mu.reshape(hkv, g, d)  # (Hkv, g, d)
    z = np.einsum("hgd,hnd->hgn", mu_g, k) / math.sqrt(d)  # (Hkv, g, n)
    if cov is not None:
        cov_g = cov.reshape(hkv, g, d, d)  # (Hkv, g, d, d)
        z = z + np.einsum("hni,hgij,hnj->hgn", k, cov_g, k) / d / 2
    return z


@register
@dataclass(frozen=True)
class ExpectedAttention(Policy):
    """ExpectedAttention (kvpress): expected attention of future queries under a Gaussian model.

    Parameters
    ----------
    n_future_positions : int, default 512
        ``F``, how many next positions' RoPE rotations are averaged.
    n_sink : int, default 4
        ``s``: the first tokens are kept and their queries left out of the statistics.
    use_covariance : bool, default True
        Include the :math:`k^\\top \\Sigma' k / 2d` term.
    use_vnorm : bool, default True
        Multiply by :math:`\\lVert v_j \\rVert_2` (after adding ``epsilon``).
    epsilon : float, default 0.0
        :math:`\\varepsilon`, added to the averaged softmax before the value-norm product.
    """

    name = "expected_attention"
    card = PolicyCard(
        summary="ExpectedAttention: softmax of expected logits of future queries (Gaussian, RoPE-averaged) x |v|",
        paper="kvpress ExpectedAttentionPress (NVIDIA); F = 512, s = 4, covariance and value norm on",
        label="ExpectedAttention",
        citation="ExpectedAttention (kvpress, NVIDIA 2025)",
        score_rule=(r"softmax of :math:`\mu'\cdot k/\sqrt d + k^\top\Sigma' k/2d` (Gaussian future queries), "
                    r"times :math:`\lVert v\rVert`"),
        protects="first 4",
        implements=("ExpectedAttention (kvpress): Gaussian query statistics before RoPE, averaged future "
                    "rotation, expected attention x value norm"),
        table_order=65,
        variants=({"use_covariance": False}, {"use_vnorm": False, "n_future_positions": 16}),
    )
    forms = MappingProxyType({"paper": {"source": "kvpress 0.5.5 ExpectedAttentionPress (NVIDIA; no paper)",
                       "proven": "tests/interop/test_interop_kvpress.py (end to end)"}})
    needs = frozenset({"keys", "values", "queries", "positions"})
    nonnegative_scores = True

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self):
        check_int("n_future_positions", self.n_future_positions, 1, MAX_CONTEXT)
        check_int("n_sink", self.n_sink, 0)
        for flag in ("use_covariance", "use_vnorm"):
            if not isinstance(getattr(self, flag), (bool, np.bool_)):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        check_float("epsilon", self.epsilon, 0.0)

    def check(self, budget: int, config: ModelConfig) -> None:
        if budget <= self.n_sink:
            raise ValueError(f"budget must be > n_sink={self.n_sink} (room beside the sinks), got {budget}")

    def statistics(self, view: View) -> tuple[np.ndarray, np.ndarray | None]:
        """:math:`\\mu'` (H, d) and :math:`\\Sigma'` (H, d, d) (None without covariance) of this view."""
        if view.config is None:
            raise ValueError("expected_attention needs view.config (the model's RoPE base) to undo RoPE")
        used = view.query_positions >= self.n_sink
        if not used.any():
            raise ValueError(f"expected_attention needs a query after the first n_sink={self.n_sink} tokens")
        queries = unrotated_queries(view.queries[:, used], view.query_positions[used], view.config)  # (H, m, d)
        mu, cov = query_statistics(queries)
        rotation = averaged_rotation(int(view.query_positions[-1]) + 1, self.n_future_positions, view.config)
        mu = mu @ rotation.T  # R mu, (H, d)
        cov = rotation @ cov @ rotation.T if self.use_covariance else None  # R Sigma R^T, (H, d, d)
        return mu, cov

    def score(self, view: View) -> np.ndarray:
        sink = first_tokens(view, self.n_sink)  # (Hkv, n)
        if (sink != sink[:1]).any() or sink.all():
            raise ValueError(f"expected_attention needs the same sinks in every head and a token after them "
                             f"(n_sink={self.n_sink})")
        rest = ~sink[0]
        mu, cov = self.statistics(view)
        z = expected_logits(view.keys[:, rest], mu, cov)  # (Hkv, g, n - s)
        scores = softmax(z).mean(axis=1)  # (Hkv, n - s)
        if self.use_vnorm:
            scores = (scores + self.epsilon) * np.linalg.norm(view.values[:, rest].astype(np.float64), axis=-1)
        out = np.full(view.positions.shape, scores.max() + 1.0)  # kvpress's padding of the sinks
        out[:, rest] = scores
        return out

    def protected(self, view: View) -> np.ndarray:
        return first_tokens(view, self.n_sink)
