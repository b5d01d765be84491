"""Hypothesis strategies for KV caches and eviction views.

* :func:`layouts` -- ``(n_heads, n_kv_heads, d_head)`` with grouped-query attention;
* :func:`dtypes`, :func:`block_sizes`, :func:`budgets`;
* :func:`kv_caches` -- per-token queries, keys and values of one layer, bounded floats,
  with optional adversarial features planted: ``"near-tie"`` (two keys equal but for a
  tiny offset), ``"zero-norm-key"``, ``"duplicate-keys"`` (a key and its value copied),
  ``"huge-logits"`` (one query-key logit above 30, a saturated softmax);
* :func:`views` -- the :class:`~refkv.policies.View` a given policy sees at its last
  eviction after block prompt processing of such a cache (per-token state included),
  via :func:`refkv.oracle.synthetic.replay`;
* :func:`selections` -- score tables with many exact ties, a protected mask and a budget:
  inputs of :func:`refkv.policies.select`.

Example::

    from hypothesis import given
    from refkv import policies
    from refkv.testing import assert_same_retention, strategies as kvst

    @given(kvst.views(policies.get("keydiff")))
    def test_my_keydiff_matches(view):
        policy = policies.get("keydiff")
        kept = my_keydiff_keep(view.keys, view.keep)
        assert_same_retention(kept, policy.keep_indices(view), policy.score(view),
                              positions=view.positions, rtol=1e-5, atol=1e-6)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ..oracle.synthetic import (
    Tokens,
    config_for,
    duplicate_key,
    near_duplicate_key,
    plant_huge_logit,
    replay,
    zero_key,
)
from ..policies import Policy

__all__ = ["ADVERSARIAL", "KVCache", "block_sizes", "budgets", "dtypes", "kv_caches", "layouts", "selections",
           "views"]

#: The adversarial features :func:`kv_caches` can plant.
ADVERSARIAL = ("near-tie", "zero-norm-key", "duplicate-keys", "huge-logits")

#: Offset between the two keys of a planted near tie, per dtype (relative to keys of
#: magnitude <= 4: well above rounding, well below any ordinary score gap).
NEAR_TIE_DELTA = {"float32": 2.0 ** -12, "float64": 2.0 ** -30}

# Token indices each feature needs (distinct indices keep features from overwriting each other).
_SLOTS = {"near-tie": 2, "zero-norm-key": 1, "duplicate-keys": 2, "huge-logits": 1}


def layouts(*, max_kv_heads: int = 3, max_group: int = 3, head_dims=(2, 4, 8, 16)):
    """``(n_heads, n_kv_heads, d_head)`` with ``n_heads = n_kv_heads * group``."""
    return st.tuples(st.integers(1, max_kv_heads), st.integers(1, max_group), st.sampled_from(head_dims)).map(
        lambda t: (t[0] * t[1], t[0], t[2]))


def dtypes():
    """float32 or float64."""
    return st.sampled_from([np.dtype(np.float32), np.dtype(np.float64)])


def block_sizes(max_size: int = 8):
    """Block sizes ``B`` in ``[1, max_size]`` (1 is the generation step)."""
    return st.integers(1, max_size)


def budgets(min_budget: int = 1, max_budget: int = 32):
    """Budgets ``N`` in ``[min_budget, max_budget]``."""
    return st.integers(min_budget, max_budget)


@dataclass(frozen=True)
class KVCache:
    """A drawn KV cache: per-token tensors of one layer and how to process them.

    Attributes
    ----------
    tokens : refkv.oracle.synthetic.Tokens
        ``queries`` (H, T, d), ``keys`` and ``values`` (Hkv, T, d).
    block_size, budget : int
    adversarial : tuple of str
        The features planted.
    planted : dict
        Where: ``"zero-norm-key": (head, index)``, ``"duplicate-keys": (head, source,
        target)``, ``"near-tie": (head, source, target, delta)``, ``"huge-logits":
        (query_head, query_index, key_index)``.
    """

    tokens: Tokens
    block_size: int
    budget: int
    adversarial: tuple
    planted: dict

    @property
    def queries(self) -> np.ndarray:
        return self.tokens.queries

    @property
    def keys(self) -> np.ndarray:
        return self.tokens.keys

    @property
    def values(self) -> np.ndarray:
        return self.tokens.values

    @property
    def layout(self) -> tuple[int, int, int]:
        h, _, d = self.tokens.queries.shape
        return h, self.tokens.keys.shape[0], d


def _as_strategy(value, default):
    if value is None:
        return default
    return value if isinstance(value, st.SearchStrategy) else st.just(value)


@st.composite
def kv_caches(draw, *, layout=None, dtype=None, min_tokens: int = 1, max_tokens: int = 24, block_size=None,
              budget=None, adversarial=None, bound: float = 4.0) -> KVCache:
    """Draw a :class:`KVCache`.

    Parameters
    ----------
    layout : tuple or strategy, optional
        ``(n_heads, n_kv_heads, d_head)``; default :func:`layouts`.
    dtype : dtype or strategy, optional
        Default :func:`dtypes`.
    min_tokens, max_tokens : int
        Range of the token count ``T`` (raised as needed by the adversarial features).
    block_size, budget : int or strategy, optional
        Default: ``B`` in ``[1, min(8, T)]``, ``N`` in ``[1, T + 2]``.
    adversarial : iterable of str, or None
        Features to plant (from :data:`ADVERSARIAL`); ``None`` draws up to two of them.
    bound : float
        Inputs are finite floats in ``[-bound, bound]``.
    """
    h, hkv, d = draw(_as_strategy(layout, layouts()))
    if h % hkv or min(h, hkv, d) < 1:
        raise ValueError(f"layout must be (n_heads, n_kv_heads, d_head) with n_kv_heads dividing n_heads, "
                         f"got {(h, hkv, d)}")
    dt = np.dtype(draw(_as_strategy(dtype, dtypes())))
    if adversarial is None:
        kinds = tuple(draw(st.lists(st.sampled_from(ADVERSARIAL), unique=True, max_size=2)))
    else:
        kinds = tuple(adversarial)
        unknown = set(kinds) - set(ADVERSARIAL)
        if unknown:
            raise ValueError(f"adversarial features must be among {ADVERSARIAL}, got {sorted(unknown)}")
    need = sum(_SLOTS[k] for k in kinds)
    t = draw(st.integers(max(min_tokens, need, 1), max(max_tokens, need, 1)))
    width = 32 if dt == np.float32 else 64
    elements = st.floats(-bound, bound, width=width, allow_nan=False, allow_infinity=False, allow_subnormal=False)

    def tensor(heads):
        return draw(hnp.arrays(dt, (heads, t, d), elements=elements))

    tokens = Tokens(tensor(h), tensor(hkv), tensor(hkv))
    slots = list(draw(st.permutations(range(t))))
    planted = {}
    for kind in kinds:
        head = draw(st.integers(0, hkv - 1))
        if kind == "zero-norm-key":
            index = slots.pop()
            tokens = zero_key(tokens, head, index)
            planted[kind] = (head, index)
        elif kind == "duplicate-keys":
            a, b = sorted((slots.pop(), slots.pop()))
            tokens = duplicate_key(tokens, head, a, b)
            planted[kind] = (head, a, b)
        elif kind == "near-tie":
            a, b = sorted((slots.pop(), slots.pop()))
            delta = NEAR_TIE_DELTA[dt.name]
            tokens = near_duplicate_key(tokens, head, a, b, delta)
            planted[kind] = (head, a, b, delta)
        else:  # huge-logits: the last query sees every key (causal mask)
            qh = draw(st.integers(0, h - 1))
            index = slots.pop()
            # magnitude**2 / sqrt(d) = 40 > 30 whatever d is
            tokens = plant_huge_logit(tokens, qh, t - 1, index, magnitude=float(np.sqrt(40.0 * np.sqrt(d))))
            planted[kind] = (qh, t - 1, index)
    b = draw(_as_strategy(block_size, st.integers(1, min(8, t))))
    n = draw(_as_strategy(budget, st.integers(1, t + 2)))
    return KVCache(tokens, b, n, kinds, planted)


def _smallest_budget(policy: Policy, layout, n_layers: int, limit: int = 128) -> int:
    cfg = config_for(*layout, n_layers)
    for n in range(1, limit + 1):
        try:
            policy.check(n, cfg)
        except ValueError:
            continue
        return n
    raise ValueError(f"{policy.describe()} accepts no budget up to {limit}")


@st.composite
def views(draw, policy: Policy, *, layout=None, dtype=None, adversarial=None, layer=None, n_layers: int = 4,
          max_block: int = 6, extra_budget: int = 8, max_extra_tokens: int = 10):
    """The :class:`~refkv.policies.View` of ``policy``'s last eviction of a drawn cache.

    The cache is processed in blocks through one layer exactly as the engine does
    (evict before attention if the policy does, append, attend, observe, evict), so the
    view's per-token state is what the policy itself accumulated. ``view.budget`` is
    ``N`` and ``view.keep`` the number of tokens that eviction keeps. Budgets the policy refuses are never
    drawn; views it refuses to decide on (a block that leaves too few places for its
    protected tokens; ``full`` with more tokens than the budget) are rejected.
    """
    lay = draw(_as_strategy(layout, layouts()))
    low = _smallest_budget(policy, lay, n_layers)
    n = draw(st.integers(low, low + extra_budget))
    max_b = min(max_block, n) if policy.evict_before_attention else max_block
    b = draw(st.integers(1, max_b))
    cache = draw(kv_caches(layout=lay, dtype=dtype, adversarial=adversarial, block_size=b, budget=n,
                           min_tokens=1, max_tokens=n + b + max_extra_tokens))
    lyr = draw(st.integers(0, n_layers - 1)) if layer is None else layer
    try:
        view = replay(policy, cache.tokens, block_size=b, budget=n, layer=lyr, n_layers=n_layers)
        policy.keep_indices(view)  # the policy can decide on it
    except ValueError:
        assume(False)
    return view


@st.composite
def selections(draw, *, max_kv_heads: int = 3, max_tokens: int = 16, levels: int = 4):
    """``(scores, positions, protected, budget)``: inputs of :func:`refkv.policies.select`.

    Scores take one of ``levels`` values per token, so exact ties are the rule, not the
    exception; positions increase along each row (not necessarily consecutively); the
    protected tokens fit in the budget.
    """
    hkv = draw(st.integers(1, max_kv_heads))
    n = draw(st.integers(1, max_tokens))
    values = draw(st.lists(st.floats(-2, 2, allow_nan=False, allow_subnormal=False), min_size=1,
                           max_size=levels, unique=True))
    scores = np.array(draw(st.lists(st.sampled_from(values), min_size=hkv * n, max_size=hkv * n))).reshape(hkv, n)
    gaps = np.array(draw(st.lists(st.integers(1, 3), min_size=hkv * n, max_size=hkv * n))).reshape(hkv, n)
    positions = np.cumsum(gaps, axis=1).astype(np.int64) - 1
    budget = draw(st.integers(1, n + 2))
    protected = np.zeros((hkv, n), dtype=bool)
    for h in range(hkv):
        count = draw(st.integers(0, min(budget, n)))
        protected[h, draw(st.permutations(range(n)))[:count]] = True
    return scores, positions, protected, budget
