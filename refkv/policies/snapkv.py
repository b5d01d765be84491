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
from types import MappingProxyType

import numpy as np

from ..model.config import ModelConfig
from ..validation import MAX_CONTEXT, check_choice
from .base import AttentionNeed, Policy, View, check_int, recent_tokens, register
from .card import PolicyCard

__all__ = ["FORMS", "GQA_AGGS", "POOLINGS", "SnapKV", "authors_window_sums", "group_reduce", "pool1d",
           "window_attention"]

#: Pooling modes of :func:`pool1d`.
POOLINGS = ("avg", "max")
#: ``"paper"``: the group-mean window attention of refkv's engine; ``"authors"``: the SnapKV
#: code's ``SnapKVCluster.update_kv`` (see :class:`SnapKV`).
FORMS = ("paper", "authors")
#: The authors' code this form reproduces.
AUTHORS_SOURCE = ("FasterDecoding/SnapKV@e216ddc84c5bd210378cbdbbba12ba02102aa640:"
                  "snapkv/monkeypatch/snapkv_utils.py:38-70 (SnapKVCluster.update_kv)")
#: The KV-head (GQA) path ``gqa_agg`` reproduces: KVCache-Factory's opt-in ``kv_cache_granularity="kv_head"``.
KV_HEAD_SOURCE = ("Zefan-Cai/KVCache-Factory@c97f9d706d63d1b56e980f8b81b2a924c21162b3:pyramidkv/pyramidkv_utils.py:"
                  "133-139, 236-298, 541-558 (SnapKVCluster._update_kv_kv_head, gqa_score_agg)")
#: How ``gqa_agg`` reduces a KV head's query group: KVCache-Factory's ``gqa_score_agg``
#: (``pyramidkv_utils.py:263-270``); Ada-KV's ``gqa_func`` takes the first two.
GQA_AGGS = ("mean", "max", "sum")


def group_reduce(sums: np.ndarray, group: int, how: str) -> np.ndarray:
    """Per-query-head scores ``(H, n)`` reduced over each KV head's query group: ``(H / g, n)``.

    Query head ``h`` belongs to KV head ``h // g`` (``repeat_kv``'s layout), so the heads of a
    group are consecutive: ``(H, n) -> (Hkv, g, n)`` and ``how`` over the ``g`` axis, in the
    scores' dtype (KVCache-Factory@c97f9d7, ``pyramidkv_utils.py:252-270``; FFY0/AdaKV@efe4e2e,
    ``snapkv_utils.py:351-358``).
    """
    check_choice("gqa_agg", how, GQA_AGGS)
    grouped = sums.reshape(sums.shape[0] // group, group, *sums.shape[1:])
    if how == "max":
        return grouped.max(axis=1)
    total = grouped.sum(axis=1)
    return total / sums.dtype.type(group) if how == "mean" else total


def authors_window_sums(queries: np.ndarray, keys: np.ndarray, window: int) -> np.ndarray:
    """The SnapKV code's window attention, summed over the window's queries: (H, n).

    ``snapkv_utils.py:45-55`` at e216ddc: logits of the last ``w`` queries against every key,
    ``q k^T / sqrt(d)`` in the model dtype; ``finfo(dtype).min`` added above the diagonal of
    the window's own ``w x w`` block (the causal mask, lines 46-52); softmax **in float32**
    (``softmax(..., dtype=torch.float32)``) cast back to the model dtype (line 54); summed
    over the window's queries. One key head per query head (the code repeats the KV heads
    before it is called: ``repeat_kv``, ``mistral_hijack_4_37.py:97-98``).

    Parameters
    ----------
    queries : (H, T, d)
        The prompt's queries (after RoPE), ``T >= window``.
    keys : (H, T, d)
        One key head per query head.
    window : int

    Returns
    -------
    (H, T) array of the queries' dtype; the last ``window`` columns are the window's own.
    """
    dtype = queries.dtype
    q = queries[:, -window:, :]
    logits = (q @ np.swapaxes(keys, -1, -2)) / dtype.type(np.sqrt(queries.shape[-1]))  # (H, w, T)
    future = np.triu(np.ones((window, window), dtype=bool), k=1)  # mask_cond < (mask_cond + 1).T
    block = logits[..., -window:]
    logits[..., -window:] = np.where(future, block + np.finfo(dtype).min, block)
    with np.errstate(over="ignore"):  # the mask's float64 minimum overflows float32 to -inf: weight 0, as theirs
        x = logits.astype(np.float32)
    x = np.exp(x - x.max(axis=-1, keepdims=True))
    weights = (x / x.sum(axis=-1, keepdims=True)).astype(dtype)
    return weights.sum(axis=-2)


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
    form : {"paper", "authors"}, default "paper"
        ``"authors"``: the decisions of the SnapKV code (below).
    gqa_agg : {None, "mean", "max", "sum"}, default None
        ``form="authors"`` only. ``None``: the SnapKV code's selection **per query head**, which
        on a GQA model needs :func:`refkv.model.heads.repeat_kv_heads` (one KV head per query
        head, the code's own regime). A reduction: the KV-head path of KVCache-Factory
        (``kv_cache_granularity="kv_head"``, its ``gqa_score_agg``) and of Ada-KV
        (``gqa_support=True``, its ``gqa_func``): each query head's window sums are reduced
        over its KV head's group (:func:`group_reduce`) **before** the pooling, and one set
        is kept per KV head.

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
    * **Authors' form** (``form="authors"``, FasterDecoding/SnapKV@e216ddc,
      ``snapkv_utils.py:38-70``): the prompt is compressed once, when it is processed
      (``q_len >= max_capacity_prompt``, line 42; decoding never evicts), **per query head**
      (the KV heads are repeated before the call, ``mistral_hijack_4_37.py:97-98``), with
      the weights recomputed as :func:`authors_window_sums` does (a float32 softmax); the
      top ``N - w`` pooled candidates (``topk``, line 62) plus the window are kept. refkv's
      cache holds one row per KV head, so the form needs one query head per KV head
      (``g = 1``; a GQA cache is refused: the code's cache there is one per query head, which
      is :func:`refkv.model.heads.repeat_kv_heads` of the model, or set ``gqa_agg``) and
      the whole prompt as one block (a later eviction is refused). Ties: ``torch.topk``'s
      order among equal values is not a documented or stable rule (on torch 2.13 CPU,
      ``topk`` of five equal values with ``k = 2`` returns indices 2 and 4), so refkv keeps
      its own tie rule; exact ties (frequent with max pooling) are accepted as ties by
      ``refkv golden check``.
    * **Authors' form on GQA** (``gqa_agg``): the SnapKV code has no KV-head path (its
      ``update_kv`` takes the repeated keys); KVCache-Factory@c97f9d7 added an opt-in one
      (``maybe_repeat_kv_before_cache``, ``pyramidkv_utils.py:133-139``; ``SnapKVCluster.
      _update_kv_kv_head``, lines 541-558): the window's float32-softmax weights of every query
      head, summed over the window, are reduced over the group by ``gqa_score_agg`` (mean by
      default, max or sum; lines 273-298), then pooled and selected per KV head with the same
      window arithmetic. ``gqa_agg`` reproduces it; with one query head per KV head it changes
      nothing.
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
    #: Each form's source and what proves it (``refkv policies --forms``).
    forms = MappingProxyType({
        "paper": {"source": "Li et al. 2024, SnapKV, Sec. 4 and Listing 1 (window, pooling, top-k); "
                            "KeyDiff App. A.1, B.2 (w = 32, k = 7, GQA group mean)",
                  "proven": "the SnapKV code selects per query head (see form='authors'); with average pooling "
                            "the paper form kept what the code keeps on one query head per KV head, and on GQA "
                            "what KVCache-Factory's kv_head path (gqa_score_agg='mean') keeps, on the committed "
                            "candidates of tests/authors/snapkv/ (the float32 softmax aside)"},
        "authors": {"source": f"{AUTHORS_SOURCE}; gqa_agg: {KV_HEAD_SOURCE}",
                    "proven": "identical on the average-pooling configurations of tests/authors/snapkv/ (max pooling "
                              "up to exact torch.topk ties): MHA, GQA per query head on repeat_kv_heads(tiny) "
                              "(model tiny-kv-repeated) and GQA per KV head (gqa_agg, KVCache-Factory's "
                              "SnapKVCluster)"},
    })

    window: int = 32
    kernel: int = 7
    pooling: str = "avg"
    form: str = "paper"
    gqa_agg: str | None = None

    def __post_init__(self):
        check_int("window", self.window, 1, MAX_CONTEXT)
        check_int("kernel", self.kernel, 1, MAX_CONTEXT + 1)
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd (output aligned with the tokens), got {self.kernel}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        check_choice("form", self.form, FORMS)
        if self.gqa_agg is not None:
            check_choice("gqa_agg", self.gqa_agg, GQA_AGGS)
            if self.form != "authors":
                raise ValueError(f"gqa_agg is a parameter of form='authors' (the authors' KV-head path); the paper "
                                 f"form averages each group's weights already: leave gqa_agg out, got "
                                 f"{self.gqa_agg!r}")
        if self.form == "authors":  # the code recomputes the weights from queries and keys
            object.__setattr__(self, "needs", frozenset({"queries", "keys"}))

    def params(self) -> dict:
        """The dataclass fields; ``gqa_agg`` only when set, so goldens written before it existed
        (their manifests list every parameter) still name the same policy."""
        params = super().params()
        if self.gqa_agg is None:
            del params["gqa_agg"]
        return params

    def check(self, budget: int, config: ModelConfig) -> None:
        if self.window >= budget:
            raise ValueError(f"window must be < budget={budget} (room for pooled candidates), got {self.window}")

    def attention_need(self) -> AttentionNeed:
        """The observation window's rows of the weights: the last ``w``."""
        return AttentionNeed(rows=self.window)

    def score(self, view: View) -> np.ndarray:
        if self.form == "authors":
            summed = self._authors_sums(view)
        else:
            summed = window_attention(view.attention_last_rows(self.window).mean(axis=1), self.window)
        prefix = max(summed.shape[-1] - self.window, 0)
        scores = summed.copy()
        scores[..., :prefix] = pool1d(summed[..., :prefix], self.kernel, self.pooling)
        return scores

    def _authors_sums(self, view: View) -> np.ndarray:
        """:func:`authors_window_sums` of the view, in the code's regime only (see Notes): (Hkv, n)."""
        b, group = len(view.query_positions), view.group_size
        if group != 1 and self.gqa_agg is None:
            raise ValueError(f"snapkv form='authors' selects per query head (the SnapKV code repeats the KV heads "
                             f"first), which a cache of {view.n_kv_heads} KV heads for {view.queries.shape[0]} query "
                             f"heads cannot hold: run it on refkv.model.heads.repeat_kv_heads(model) (one KV head "
                             f"per query head, the code's regime), or set gqa_agg to one of {GQA_AGGS} "
                             f"(KVCache-Factory's KV-head path)")
        if b != view.n or b < self.window:
            raise ValueError(f"snapkv form='authors' compresses the prompt once, as one block of at least window="
                             f"{self.window} tokens (the SnapKV code never evicts while decoding); got a block of {b} "
                             f"over {view.n} cached tokens: prefill one-shot and leave decoding uncompressed")
        keys = np.repeat(view.keys, group, axis=0) if group > 1 else view.keys  # (H, n, d): repeat_kv's layout
        sums = authors_window_sums(view.queries, keys, self.window)  # (H, n)
        return group_reduce(sums, group, self.gqa_agg) if group > 1 else sums

    def protected(self, view: View) -> np.ndarray:
        return recent_tokens(view, self.window)
