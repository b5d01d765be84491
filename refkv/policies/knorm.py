"""``knorm``: keep the keys of lowest L2 norm (Devoto et al. 2024).

Devoto, Zhao, Scardapane and Minervini, "A Simple and Effective L2 Norm-Based Strategy for
KV Cache Compression" (EMNLP 2024), observe that a low key norm goes with a high attention
weight, and keep the keys of lowest norm:

.. math:: s_i = -\\lVert k_i \\rVert_2 .

HashEvict (Sec. 1, App. C-D) uses it as its attention-free baseline ("L2"). It needs
neither queries nor attention weights, only the keys.

Notes
-----
* **Skipped layers.** The authors' code leaves the caches of ``skip_layers`` uncompressed
  (their example skips layers 0 and 1). Under refkv's per-layer budget ``N`` a layer cannot
  keep everything, so a skipped layer here falls back to StreamingLLM's rule instead: the
  first ``skip_sink`` tokens and the most recent ``N - skip_sink`` (the
  :class:`~refkv.policies.sink.Sink` policy). That is the norm-free rule that keeps the
  budget guarantee; with ``N >= T`` nothing is evicted and the authors' behaviour is
  recovered.
* **Ties.** Equal norms keep the more recent token (the shared tie rule); the authors sort
  with ``torch.argsort``, whose order of equal norms is unspecified.
* **Budget.** The authors keep a ratio of the tokens once, after the prompt; refkv keeps
  ``N`` tokens per layer and KV head at every eviction (block prompt processing).
* **GQA.** Keys are per KV head; the query heads play no part.
* **Protected tokens (optional).** ``sink`` first tokens and ``recent`` most recent
  tokens can be protected, as HashEvict protects its first 4 and last 10 (HashEvict
  Sec. 4); the defaults (0, 0) are the authors' rule, which protects nothing. The option
  exists so experiments can compare L2 and HashEvict under the same protection.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from ..model.config import ModelConfig
from .base import Policy, View, check_int, first_tokens, recent_tokens, register
from .card import PolicyCard

__all__ = ["Knorm", "key_norm_scores"]


def key_norm_scores(keys: np.ndarray) -> np.ndarray:
    """``-||k_i||_2`` per key: ``(..., n, d)`` -> ``(..., n)``, higher = keep (low norm)."""
    keys = np.asarray(keys)
    if keys.ndim < 2:
        raise ValueError(f"keys must have shape (..., n, d), got {keys.shape}")
    return -np.linalg.norm(keys, axis=-1)


@register
@dataclass(frozen=True)
class Knorm(Policy):
    """L2 / Knorm (Devoto et al. 2024): keep, per KV head, the ``N`` keys of lowest L2 norm.

    Parameters
    ----------
    skip_layers : tuple of int, default ()
        Layers that do not use the norm rule; they keep the first ``skip_sink`` tokens and
        the most recent ``N - skip_sink`` (see Notes in the module docstring). The authors'
        example skips ``(0, 1)``.
    skip_sink : int, default 4
        Sink tokens of the skipped layers' fallback.
    sink : int, default 0
        First tokens protected on the norm-rule layers (HashEvict's setting: 4).
    recent : int, default 0
        Most recent tokens protected on the norm-rule layers (HashEvict's setting: 10).
        ``sink + recent`` must be smaller than the budget.
    """

    name = "knorm"
    card = PolicyCard(
        summary="L2 norm: keep the keys of lowest L2 norm; attention-free",
        paper="Devoto et al. 2024, A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
        label="L2 norm (knorm)",
        citation="L2 norm (Devoto et al. 2024)",
        score_rule=r":math:`-\lVert k_i\rVert`",
        protects="--",
        implements="L2 norm (Devoto et al. 2024), optional skipped layers",
        table_order=60,
        variants=({"skip_layers": (0, 3)},),
    )
    forms = MappingProxyType({
        "paper": {"source": "Devoto et al. 2024, Sec. 3 (keep the lowest key norms)", "proven": None},
        "authors": {"source": "alessiodevoto/l2compress@f93d6ca2702d85a2db97d2ef350b44d955609761:cache.py "
                              "(l2_compress, once after the prompt; = paper form with N = ceil(r T))",
                    "proven": "run: identical on 60 decisions of 5 configurations, GQA and not; at exact "
                              "ties their argsort keeps the older token (tests/authors/test_authors_knorm.py)"},
        "kvpress": {"source": "kvpress 0.5.5 KnormPress", "proven": "tests/interop/test_interop_kvpress.py"},
    })
    needs = frozenset({"keys", "positions"})

    skip_layers: tuple = ()
    skip_sink: int = 4
    sink: int = 0
    recent: int = 0

    def __post_init__(self):
        if isinstance(self.skip_layers, (str, bytes)) or not hasattr(self.skip_layers, "__iter__"):
            raise ValueError(f"skip_layers must be a sequence of layer indices, got {self.skip_layers!r}")
        layers = tuple(check_int("skip_layers entry", layer, 0) for layer in self.skip_layers)
        if len(set(layers)) != len(layers):
            raise ValueError(f"skip_layers must not repeat a layer, got {self.skip_layers!r}")
        object.__setattr__(self, "skip_layers", tuple(sorted(layers)))
        check_int("skip_sink", self.skip_sink, 0)
        check_int("sink", self.sink, 0)
        check_int("recent", self.recent, 0)

    def check(self, budget: int, config: ModelConfig) -> None:
        bad = [layer for layer in self.skip_layers if layer >= config.n_layers]
        if bad:
            raise ValueError(f"skip_layers must be in [0, {config.n_layers - 1}] for a model of "
                             f"{config.n_layers} layers, got {bad}")
        if self.skip_layers and budget <= self.skip_sink:
            raise ValueError(f"budget must be > skip_sink={self.skip_sink} (room for the skipped layers' "
                             f"recent window), got {budget}")
        if self.sink + self.recent and budget <= self.sink + self.recent:
            raise ValueError(f"budget must be > sink + recent = {self.sink + self.recent} (room for a "
                             f"norm-ranked token), got {budget}")

    def params(self) -> dict:
        """Parameters as a plain dict; ``sink`` and ``recent`` only when one is set, so the
        authors' rule has the parameters it had before the option existed (the golden files
        and the oracle's default-parameters filter compare these dicts)."""
        params = super().params()
        if not (self.sink or self.recent):
            del params["sink"], params["recent"]
        return params

    def skipped(self, layer: int) -> bool:
        """Whether ``layer`` uses the sink + window fallback instead of the norm rule."""
        return layer in self.skip_layers

    def score(self, view: View) -> np.ndarray:
        if self.skipped(view.layer):
            return view.positions.astype(np.float64)
        return key_norm_scores(view.keys)

    def protected(self, view: View) -> np.ndarray:
        if self.skipped(view.layer):
            return first_tokens(view, self.skip_sink) | recent_tokens(view, view.keep - self.skip_sink)
        return first_tokens(view, self.sink) | recent_tokens(view, self.recent)
