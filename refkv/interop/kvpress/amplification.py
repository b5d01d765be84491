"""How far a bfloat16 or float16 run of a model moves what an end-to-end golden compares.

An end-to-end golden compares a candidate's eviction scores, the fingerprints of the keys
its cache rows hold, and its final logits with a float32 (or float64) reference run. A
candidate computing in a coarser dtype differs from it by its rounding errors *amplified
through the model* (every layer's keys, queries and attention come from the rounded
layers before). :data:`refkv.oracle.tolerance.E2E_RTOL` states the tolerance of each
coarse dtype as a multiple of that amplification, measured here by running the same
model on the same prompt in ``transformers`` twice, in float64 and in the coarse dtype
(eager attention, the weights of every layer materialised), and comparing, per layer and
KV head, the quantities the policies' scores are made of:

* ``key norms``: ``||k_j||`` (knorm's score);
* ``key cosines``: ``cos(k_j, mean of the head's keys)`` (keydiff's);
* ``key fingerprints``: ``k_j . u`` (:data:`~refkv.oracle.endtoend.PRINT_RULE`: what a
  cache row is checked by);
* ``attention column sums``: ``sum_i A[i, j]`` over the group's queries (h2o's);
* ``last-query attention``: ``A[T-1, j]`` summed over the group (tova's);
* ``window attention``: the last 4 queries' rows summed over the group (snapkv's);
* ``logits``: the last position's logits.

Each is computed in the candidate's dtype from that run's keys and attention weights.

The deviation of a score is measured at the scale an end-to-end check gives it
(:func:`refkv.oracle.tolerance.decision_tolerance`): ``|s_c - s_64| / max(|s_64|, m)``
with ``m`` the median ``|s_64|`` of its (layer, head) row; of a logit at the scale of
:func:`refkv.oracle.walk.compare_final_logits`: ``|l_c - l_64| / (|l_64| + max(1, max |l_64|))``;
of a fingerprint at ``max(1, max |print|)`` (``scaled_atol``). A candidate passes an
end-to-end check where every deviation is within ``rtol``, so ``E2E_RTOL`` must stay above
the largest deviation measured on the models the oracle checks, with a margin for prompts
and checkpoints not measured (``tests/interop/test_interop_amplification.py`` re-measures it
and holds the table to between 2 and 16 times the measurement).
"""

from __future__ import annotations

import numpy as np
import torch

from ...oracle.endtoend import print_vector
from ...oracle.tolerance import decision_tolerance, scale_floor
from ...validation import check_choice
from .models import hf_model

__all__ = ["QUANTITIES", "measure_amplification"]

QUANTITIES = ("key norms", "key cosines", "key fingerprints", "attention column sums", "last-query attention",
              "window attention", "logits")
#: Queries of the window the ``window attention`` quantity sums (the grid's SnapKV window).
WINDOW = 4


def _row_relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest ``|got - want| / max(|want|, median |want| of its row)`` over rows (last axis):
    the deviation in units of the check's own per-score tolerance at ``rtol = 1``."""
    g, w = got.to(torch.float64).cpu().numpy(), want.to(torch.float64).cpu().numpy()
    scale = np.stack([decision_tolerance(row, 1.0) for row in w.reshape(-1, w.shape[-1])]).reshape(w.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(scale > 0, np.abs(g - w) / scale, np.where(g == w, 0.0, np.inf))
    return float(ratio.max())


def _quantities(keys: torch.Tensor, attention: torch.Tensor, d_head: int) -> dict:
    """The scores' ingredients of one layer in the dtype they come in: keys (Hkv, T, d), attention (H, T, T)."""
    hkv, t, _ = keys.shape
    group = attention.reshape(hkv, attention.shape[0] // hkv, t, t)                  # (Hkv, g, T, T)
    u = torch.from_numpy(print_vector(d_head)).to(keys.dtype).to(keys.device)
    return {
        "key norms": keys.norm(dim=-1),                                                 # (Hkv, T)
        "key cosines": torch.nn.functional.cosine_similarity(keys, keys.mean(dim=1, keepdim=True), dim=-1),
        "key fingerprints": keys @ u,
        "attention column sums": group.sum(dim=(1, 2)),
        "last-query attention": group[:, :, -1].sum(dim=1),
        "window attention": group[:, :, -WINDOW:].sum(dim=(1, 2)),
    }


def _run(hf, prompt: torch.Tensor):
    with torch.no_grad():
        out = hf(input_ids=prompt, output_attentions=True, use_cache=True)
    keys = [layer.keys[0] for layer in out.past_key_values.layers]                     # (Hkv, T, d) per layer
    attention = [a[0] for a in out.attentions]                                          # (H, T, T) per layer
    return keys, attention, out.logits[0, -1]


def measure_amplification(model, prompt, dtype: str, *, device: str = "cpu") -> dict:
    """The largest relative deviation of each of :data:`QUANTITIES` in ``dtype`` from float64.

    Parameters
    ----------
    model : refkv.model.Model
        Any model refkv exports to ``transformers`` (:func:`~refkv.interop.kvpress.hf_model`).
    prompt : (T,) int array
        Token ids (T >= the window of 4).
    dtype : {"bfloat16", "float16", "float32"}
        The candidate's dtype.
    device : str
        The torch device of the ``dtype`` run (the float64 run is on the CPU).

    Returns
    -------
    dict
        ``{quantity: largest deviation}`` (module docstring), over every layer and KV head.
    """
    check_choice("dtype", dtype, ("bfloat16", "float16", "float32"))
    ids = torch.as_tensor(np.asarray(prompt, dtype=np.int64))[None, :]
    d_head = int(model.config.d_head)
    ref = _run(hf_model(model, "float64", "eager"), ids)
    got = _run(hf_model(model, dtype, "eager").to(device), ids.to(device))
    out = dict.fromkeys(QUANTITIES, 0.0)
    for k64, a64, kc, ac in zip(ref[0], ref[1], got[0], got[1]):
        want, have = _quantities(k64, a64, d_head), _quantities(kc, ac, d_head)
        for name, w in want.items():
            if name == "key fingerprints":  # compared at max(1, max |print|), as scaled_atol does
                dev = float((have[name].to(torch.float64).cpu() - w).abs().max()) / scale_floor(w.numpy())
            else:
                dev = _row_relative(have[name], w)
            out[name] = max(out[name], dev)
    l64, lc = ref[2], got[2].to(torch.float64).cpu()
    out["logits"] = float(((lc - l64).abs() / (l64.abs() + scale_floor(l64.numpy()))).max())
    return out
