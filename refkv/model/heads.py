"""A grouped-query model with its KV heads repeated: one KV head per query head.

Several authors' codes select cache entries *per query head* on a grouped-query (GQA) model:
they repeat each KV head for the ``g = H / Hkv`` query heads it serves (``repeat_kv``) before
the selection, so their cache holds ``H`` rows per token instead of ``Hkv`` (SnapKV's
``mistral_hijack_4_37.py:97-98``, PyramidKV's and Ada-KV's query-head paths). refkv's cache
holds one row per KV head, so that regime is the same model with its KV projections
repeated: :func:`repeat_kv_heads`. Query head ``h`` of the original reads KV head
``h // g``; in the repeated model it reads its own copy, KV head ``h``, which holds the
same key and value. Without eviction the two models compute the same function; with a
policy that decides per KV head, the repeated model decides per query head.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .config import ModelConfig
from .decoder import Model
from .weights import ModelWeights

__all__ = ["repeat_kv_heads"]


def _repeat_heads(matrix: np.ndarray | None, n_kv_heads: int, group: int, d_head: int) -> np.ndarray | None:
    """Columns (or entries) of ``Hkv`` heads of ``d_head``, each head repeated ``group`` times in place."""
    if matrix is None:
        return None
    # (..., Hkv * d) -> (..., Hkv, d) -> (..., Hkv, g, d) -> (..., Hkv * g * d)
    heads = matrix.reshape(*matrix.shape[:-1], n_kv_heads, 1, d_head)
    repeated = np.broadcast_to(heads, (*matrix.shape[:-1], n_kv_heads, group, d_head))
    return np.ascontiguousarray(repeated.reshape(*matrix.shape[:-1], n_kv_heads * group * d_head))


def repeat_kv_heads(model: Model) -> Model:
    """The model with each KV head repeated for the query heads it serves (``n_kv_heads = n_heads``).

    Parameters
    ----------
    model : Model
        Any refkv model; a model with one query head per KV head comes back unchanged.

    Returns
    -------
    Model
        Same weights, with ``wk``, ``wv`` (and ``bk``, ``bv``) of shape ``(d_model, H * d)``:
        KV head ``h`` of the result is KV head ``h // g`` of ``model``. Its config is named
        ``<name>-kv-repeated``. The key norm (``k_norm``, per head) is shared and unchanged.

    Notes
    -----
    The cache of the result holds ``g`` times the rows of the original's for the same budget
    per head: a budget ``N`` per query head is ``g N`` rows per KV head of the original.
    """
    cfg: ModelConfig = model.config
    group = cfg.n_heads // cfg.n_kv_heads
    if group == 1:
        return model
    d = cfg.d_head
    hkv = cfg.n_kv_heads
    layers = tuple(
        replace(lw, wk=_repeat_heads(lw.wk, hkv, group, d), wv=_repeat_heads(lw.wv, hkv, group, d),
                bk=_repeat_heads(lw.bk, hkv, group, d), bv=_repeat_heads(lw.bv, hkv, group, d),
                wq=np.array(lw.wq), w_gate=np.array(lw.w_gate), w_up=np.array(lw.w_up))
        for lw in model.weights.layers)
    weights: ModelWeights = replace(model.weights, layers=layers)
    config = replace(cfg, n_kv_heads=cfg.n_heads, name=f"{cfg.name}-kv-repeated")
    return Model(config, weights)
