"""Building :class:`refkv.policies.View` objects by hand for policy unit tests.

Not a test module (no ``test_`` prefix); the policy tests import it.
"""

import numpy as np

from refkv.attention import attention_weights
from refkv.policies import View


def make_view(attention=None, *, n=None, values=None, keys=None, positions=None, fields=None,
              query_positions=None, budget=None, d=2, layer=0, n_layers=1):
    """A View around hand-written attention weights (Hkv, g, B, n).

    Everything not given is filled in consistently: positions ``0..n-1`` in every head,
    the block's queries at the last ``B`` positions, zero keys/values/queries of width ``d``.
    """
    if attention is not None:
        attention = np.asarray(attention)
        n_kv, g, b, n = attention.shape
    else:
        n_kv, g, b = 1, 1, 1
    if positions is None:
        positions = np.broadcast_to(np.arange(n, dtype=np.int64), (n_kv, n)).copy()
    if query_positions is None:
        query_positions = positions[0, -b:].copy()
    if keys is None:
        keys = np.zeros((n_kv, n, d))
    if values is None:
        values = np.zeros((n_kv, n, d))
    values = np.asarray(values)
    keys = np.asarray(keys)
    d = keys.shape[-1]
    queries = np.zeros((n_kv * g, b, d))
    return View(layer=layer, n_layers=n_layers, keys=keys, values=values, positions=positions,
                fields=dict(fields or {}), queries=queries, query_positions=np.asarray(query_positions),
                block_keys=keys[:, -b:], block_values=values[:, -b:], attention=attention, budget=budget)


def random_view(rng, *, n_kv=2, g=2, n=12, b=4, d=4, budget=None, dtype=np.float64, fields=None):
    """A View whose attention is the real causal softmax of random queries and keys."""
    keys = rng.standard_normal((n_kv, n, d)).astype(dtype)
    values = rng.standard_normal((n_kv, n, d)).astype(dtype)
    queries = rng.standard_normal((n_kv * g, b, d)).astype(dtype)
    positions = np.broadcast_to(np.arange(n, dtype=np.int64), (n_kv, n)).copy()
    query_positions = np.arange(n - b, n, dtype=np.int64)
    attention = attention_weights(queries, keys, query_positions, positions)
    return View(layer=0, n_layers=1, keys=keys, values=values, positions=positions, fields=dict(fields or {}),
                queries=queries, query_positions=query_positions, block_keys=keys[:, -b:],
                block_values=values[:, -b:], attention=attention, budget=budget)


def reference_keep(scores, positions, budget, protected=None):
    """Kept column indices per head by plain Python sorting: an independent route to ``select``.

    Protected first, then higher score, then larger position; returned in column order.
    """
    scores = np.asarray(scores)
    kept = []
    for h in range(scores.shape[0]):
        prot = np.zeros(scores.shape[1], bool) if protected is None else protected[h]
        order = sorted(range(scores.shape[1]),
                       key=lambda j: (bool(prot[j]), float(scores[h, j]), int(positions[h, j])), reverse=True)
        kept.append(sorted(order[:budget]))
    return np.array(kept, dtype=np.int64)
