"""``sink``: StreamingLLM's attention sinks plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from ..model.config import ModelConfig
from .base import Policy, View, check_int, first_tokens, recent_tokens, register
from .card import PolicyCard

__all__ = ["Sink"]


@register
@dataclass(frozen=True)
class Sink(Policy):
    """StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with
    Attention Sinks"): keep the first ``sink`` tokens and the most recent ``N - sink``.

    Score is recency (the position); both groups are protected, so exactly ``N``
    tokens are protected and the score never decides anything. Keys keep their
    original RoPE positions (the seed papers' setting), not StreamingLLM's
    positions-within-cache.

    Parameters
    ----------
    sink : int, default 4
        Number of initial tokens kept (4, following StreamingLLM and KeyDiff App. B.2).
    """

    name = "sink"
    card = PolicyCard(
        summary="StreamingLLM: first s tokens (attention sinks) + recent window",
        paper="Xiao et al. 2024, StreamingLLM; default s = 4 (KeyDiff App. B.2)",
        label="sink (StreamingLLM)",
        citation="StreamingLLM (Xiao et al. 2024)",
        score_rule="recency",
        protects="first :math:`s = 4`, last :math:`N - s`",
        implements="StreamingLLM (Xiao et al. 2024): first 4 tokens + recent window",
        table_order=10,
        variants=({"sink": 1},),
    )
    forms = MappingProxyType({
        "paper": {"source": "Xiao et al. 2024, StreamingLLM Sec. 3.2 (first s + last N - s)", "proven": None},
        "authors": {"source": "mit-han-lab/streaming-llm@2e5042606d69933d88fbf909bd77907456b9b4dd:"
                              "streaming_llm/kv_cache.py (StartRecentKVCache; = paper form)",
                    "proven": "run: identical on 128 decisions of 8 configurations (__call__ and "
                              "evict_for_space, GQA and not) (tests/authors/test_authors_sink.py)"},
        "kvpress": {"source": "kvpress 0.5.5 StreamingLLMPress (kept sets)",
                    "proven": "tests/interop/test_interop_kvpress.py"},
    })
    nonnegative_scores = True
    needs = frozenset({"positions"})

    sink: int = 4

    def __post_init__(self):
        check_int("sink", self.sink, 0)

    def check(self, budget: int, config: ModelConfig) -> None:
        if budget <= self.sink:
            raise ValueError(f"budget must be > sink={self.sink} (room for a recent window), got {budget}")

    def score(self, view: View) -> np.ndarray:
        return view.positions.astype(np.float64)

    def protected(self, view: View) -> np.ndarray:
        return first_tokens(view, self.sink) | recent_tokens(view, view.keep - self.sink)
