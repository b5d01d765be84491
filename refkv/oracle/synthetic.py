"""Synthetic KV caches, adversarial edits, and a one-layer replay of the engine.

Used by the golden-suite generator (seeded NumPy) and by
:mod:`refkv.testing.strategies` (hypothesis), so both build their cases the same way.

:func:`replay` runs one layer of prompt processing (one-shot, or in blocks) on given
per-token queries, keys and values through the engine's own layer step
(:func:`refkv.engine.layer_step`): evict before attention (for ``evict_before_attention``
policies), append, attend, observe, evict. It returns the
:class:`~refkv.policies.View` of the *last* block's eviction, with the per-token state a
policy accumulated over the earlier blocks, so a stateful policy (H2O, HashEvict, MAT,
Scissorhands) is tested on state it produced itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..cache import LayerCache
from ..engine import decision_view, layer_step
from ..model.config import ModelConfig
from ..policies import Policy, View
from ..validation import check_int

__all__ = [
    "Tokens",
    "config_for",
    "duplicate_key",
    "huge_logits",
    "max_abs_logit",
    "near_duplicate_key",
    "plant_huge_logit",
    "random_tokens",
    "replay",
    "zero_key",
]


@dataclass(frozen=True)
class Tokens:
    """Per-token tensors of one layer, after RoPE.

    Attributes
    ----------
    queries : (H, T, d)
    keys, values : (Hkv, T, d)
    """

    queries: np.ndarray
    keys: np.ndarray
    values: np.ndarray

    def __post_init__(self):
        h, t, d = self.queries.shape
        hkv = self.keys.shape[0]
        if self.keys.shape != (hkv, t, d) or self.values.shape != (hkv, t, d):
            raise ValueError(f"keys and values must have shape (Hkv, {t}, {d}) like the queries' (H, T, d) "
                             f"= {self.queries.shape}; got {self.keys.shape} and {self.values.shape}")
        if hkv < 1 or h % hkv:
            raise ValueError(f"query heads ({h}) must be a positive multiple of KV heads ({hkv})")
        if not (self.queries.dtype == self.keys.dtype == self.values.dtype):
            raise ValueError("queries, keys and values must share one dtype")

    @property
    def n_tokens(self) -> int:
        return self.queries.shape[1]

    @property
    def dtype(self) -> np.dtype:
        return self.queries.dtype


def random_tokens(rng: np.random.Generator, n_heads: int, n_kv_heads: int, d_head: int, n_tokens: int,
                  dtype=np.float64, grid: int = 64) -> Tokens:
    """Standard normal tensors rounded to multiples of ``1 / grid``.

    Rounding to a power-of-two grid makes every input exactly representable in float32
    and float64 alike, with a short decimal form (small golden files).
    """
    def draw(heads):
        x = rng.standard_normal((heads, n_tokens, d_head))
        return (np.round(x * grid) / grid).astype(dtype)

    return Tokens(draw(n_heads), draw(n_kv_heads), draw(n_kv_heads))


# -- adversarial edits (each returns a new Tokens) ------------------------------------------
def zero_key(tokens: Tokens, head: int, index: int) -> Tokens:
    """Set key ``index`` of KV head ``head`` to the zero vector."""
    keys = tokens.keys.copy()
    keys[head, index] = 0
    return replace(tokens, keys=keys)


def duplicate_key(tokens: Tokens, head: int, source: int, target: int) -> Tokens:
    """Copy token ``source``'s key and value onto token ``target`` (KV head ``head``)."""
    keys, values = tokens.keys.copy(), tokens.values.copy()
    keys[head, target] = keys[head, source]
    values[head, target] = values[head, source]
    return replace(tokens, keys=keys, values=values)


def near_duplicate_key(tokens: Tokens, head: int, source: int, target: int, delta: float) -> Tokens:
    """Token ``target``'s key becomes ``source``'s plus ``delta`` on its first coordinate.

    Key-based scores of the two tokens then differ by O(delta): a near tie.
    """
    keys = duplicate_key(tokens, head, source, target).keys
    keys[head, target, 0] += delta
    return replace(tokens, keys=keys)


def huge_logits(tokens: Tokens, scale: float) -> Tokens:
    """Multiply queries and keys by ``scale``: the logits grow by ``scale ** 2``."""
    return replace(tokens, queries=tokens.queries * tokens.dtype.type(scale),
                   keys=tokens.keys * tokens.dtype.type(scale))


def plant_huge_logit(tokens: Tokens, query_head: int, query_index: int, key_index: int,
                     magnitude: float = 12.0) -> Tokens:
    """Make one query-key logit large: both vectors become ``magnitude`` times the first axis.

    The logit ``q . k / sqrt(d)`` is then ``magnitude ** 2 / sqrt(d)`` (36 for the default
    and ``d = 16``), whatever the other inputs are.
    """
    q, k = tokens.queries.copy(), tokens.keys.copy()
    kv_head = query_head // (q.shape[0] // k.shape[0])
    q[query_head, query_index] = 0
    q[query_head, query_index, 0] = magnitude
    k[kv_head, key_index] = 0
    k[kv_head, key_index, 0] = magnitude
    return replace(tokens, queries=q, keys=k)


def max_abs_logit(queries: np.ndarray, keys: np.ndarray) -> float:
    """Largest ``|q . k| / sqrt(d)`` between any query head and the keys of its KV head."""
    h, _, d = queries.shape
    hkv = keys.shape[0]
    if keys.shape[1] == 0 or queries.shape[1] == 0:
        return 0.0
    qg = queries.reshape(hkv, h // hkv, -1, d).astype(np.float64)
    logits = qg @ keys.astype(np.float64)[:, None].swapaxes(-1, -2) / float(np.sqrt(d))
    return float(np.abs(logits).max())


# -- one layer of the engine -----------------------------------------------------------------
def config_for(n_heads: int, n_kv_heads: int, d_head: int, n_layers: int = 1) -> ModelConfig:
    """A model config with these attention shapes (for ``policy.fields`` and ``policy.check``)."""
    return ModelConfig(vocab_size=16, d_model=n_heads * d_head, n_layers=n_layers, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, d_head=d_head, d_ff=16, name="synthetic")


def replay(policy: Policy, tokens: Tokens, *, block_size: int | None = None, budget: int, layer: int = 0,
           n_layers: int = 1) -> View:
    """Prompt processing of ``tokens`` through one layer; the view of the last block's eviction.

    Each block goes through :func:`refkv.engine.layer_step`, the step the engine itself
    runs, so the replay cannot drift from the engine.

    Parameters
    ----------
    policy : Policy
    tokens : Tokens
        The layer's queries, keys and values for every prompt token (after RoPE).
    block_size : int or None
        ``B``; the last block may be shorter. ``None`` (default): **one-shot**, the whole
        prompt is one block -- full square causal attention over all ``T`` tokens, then one
        eviction to ``N`` (kvpress's regime).
    budget : int
        ``N``.
    layer, n_layers : int
        What the view reports (layer-dependent policies such as MAT read them).

    Returns
    -------
    View
        The view the engine passes to ``policy.keep_indices`` at the last block, with
        ``view.budget = N`` and ``view.keep`` the number of tokens that eviction keeps
        (``N``, or ``N - B`` before attention). If the last block needs no eviction the view is the one the
        engine would have used had it evicted.

    Raises
    ------
    ValueError
        If the policy refuses ``budget`` (``policy.check``) or the block size: a policy
        that evicts before attention (HashEvict, MAT) has no one-shot form, since its block
        attends to at most ``N`` tokens.
    """
    budget = check_int("budget", budget, 1)
    if not isinstance(tokens, Tokens):
        raise ValueError(f"tokens must be a refkv.oracle.synthetic.Tokens, got {type(tokens).__name__}")
    h, t, d = tokens.queries.shape
    if t < 1:
        raise ValueError("tokens must hold at least one token")
    block_size = t if block_size is None else check_int("block_size", block_size, 1)
    n_layers = check_int("n_layers", n_layers, 1)
    layer = check_int("layer", layer, 0, n_layers - 1)
    hkv = tokens.keys.shape[0]
    config = config_for(h, hkv, d, n_layers)
    policy.check(budget, config)
    limit = policy.max_block(budget, config)
    if limit is not None and block_size > limit:
        raise ValueError(f"block size must be <= {limit} for {policy.name} with budget={budget} (it evicts "
                         f"before attention); got a block of {block_size}")
    cache = LayerCache(hkv, d, tokens.dtype, policy.fields(config))
    last_start = (t - 1) // block_size * block_size

    def evict(view: View, keep: int, stage: str) -> None:
        decided = decision_view(view, keep)
        if int(view.query_positions[0]) == last_start:
            raise _Captured(decided)  # the last block's decision is the caller's to make
        cache.keep(policy.keep_indices(decided))

    for start in range(0, t, block_size):
        stop = min(start + block_size, t)
        q, k, v = tokens.queries[:, start:stop], tokens.keys[:, start:stop], tokens.values[:, start:stop]
        try:
            layer_step(policy, cache, q, k, v, layer=layer, n_layers=n_layers, budget=budget, evict=evict,
                       evict_always=stop == t, config=config)
        except _Captured as captured:
            return captured.view
    raise AssertionError("the last block always reaches its eviction")  # evict_always=True


class _Captured(Exception):
    """Carries the view of the last block's eviction out of :func:`layer_step`."""

    def __init__(self, view: View):
        super().__init__("captured")
        self.view = view
