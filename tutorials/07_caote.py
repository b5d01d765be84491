"""
7. CAOTE: the eviction error in closed form
===========================================

Attention-based policies evict the token with the smallest attention weight. But what a
layer passes on is the attention *output*, :math:`X = \\sum_i \\alpha_i v_i`, and a
token with a small weight can still move the output a lot if its value is far from
everyone else's. CAOTE (Goel et al., 2025) scores tokens by the change in output their
eviction causes, and shows that change has a closed form. With attention weights
:math:`\\alpha_1..\\alpha_{b+1}` of the newest query over :math:`b+1` tokens and values
:math:`v_j`:

.. math::

   c_j = \\frac{\\alpha_j}{1 - \\alpha_j}\\,\\big\\lVert V\\alpha - v_j \\big\\rVert_2
   \\qquad \\text{(CAOTE Eq. 8)},

and this is *exactly* the eviction error :math:`\\lVert X - X'_j\\rVert_2` (Theorem
3.2): evict token :math:`j`, let the softmax renormalise the others, and the output
moves by :math:`c_j`. This tutorial checks that against brute force, looks at why it
changes the choice, and runs CAOTE as a meta-policy over TOVA and H2O.
"""

import numpy as np
from matplotlib.colors import LogNorm

import refkv
from refkv.figures import pyplot
from refkv.policies.caote import caote_scores, fast_caote_scores, normalise
from refkv.theory.caote import eviction_errors

plt = pyplot("Tutorial 7")  # matplotlib.pyplot, or one line saying how to install it

rng = np.random.default_rng(7)

# %%
# Brute force against the closed form
# -----------------------------------
#
# One query, :math:`b + 1 = 9` cached tokens, head width 2 (so we can draw the values).
# The brute-force route drops token :math:`j`, recomputes the softmax over the rest, and
# measures how far the output moved (CAOTE Eq. 9). Theorem 3.1 says the remaining
# weights become :math:`\alpha_i / (1 - \alpha_j)`; we do not use it, we recompute.

n, d = 9, 2
logits = 1.5 * rng.standard_normal(n)
values = rng.standard_normal((n, d))
alpha = np.exp(logits - logits.max())
alpha /= alpha.sum()
X = alpha @ values                                          # Eq. 10


def output_without(j):
    keep = np.arange(n) != j
    w = np.exp(logits[keep] - logits[keep].max())
    return (w / w.sum()) @ values[keep]


brute = np.array([np.linalg.norm(X - output_without(j)) for j in range(n)])
closed = caote_scores(alpha, values)                        # refkv.policies.caote
print("token      " + " ".join(f"{j:>6d}" for j in range(n)))
print("alpha      " + " ".join(f"{a:6.3f}" for a in alpha))
print("brute e_j  " + " ".join(f"{e:6.3f}" for e in brute))
print("CAOTE c_j  " + " ".join(f"{c:6.3f}" for c in closed))
print("largest |c - e| =", np.abs(closed - brute).max())
print("refkv.theory.caote.eviction_errors agrees:",
      np.allclose(eviction_errors(logits, values), brute, rtol=1e-12))

# %%
# The closed form is the brute force, to rounding. **Predict, then run:** does the token
# with the smallest weight also move the output least? Compare the two choices of whom
# to evict: the smallest attention weight (what TOVA would do with this query) and the
# smallest :math:`c_j`.

by_attention, by_caote = int(np.argmin(alpha)), int(np.argmin(closed))
print(f"smallest weight: token {by_attention} (error {brute[by_attention]:.3f}); "
      f"smallest c: token {by_caote} (error {brute[by_caote]:.3f})")

fig, ax = plt.subplots(figsize=(5.6, 4.8))
order = np.argsort(-alpha)  # big circles first, small ones on top
points = ax.scatter(values[order, 0], values[order, 1], s=3000 * alpha[order],
                    c=closed[order], cmap="plasma", edgecolor="k", norm=LogNorm(),
                    alpha=0.85)
for j, (vx, vy) in enumerate(values):
    ax.annotate(str(j), (vx, vy), textcoords="offset points", xytext=(-4, -4), zorder=3,
                fontsize=9,
                bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8))
ax.plot(*X, "k*", ms=14, label=r"output $X = V\alpha$")
fig.colorbar(points, ax=ax, label="$c_j$: output change if evicted (log scale)")
ax.set(xlabel="value, dim 1", ylabel="value, dim 2",
       title="values (area = attention weight)")
ax.legend(loc="lower left")
fig.tight_layout()

# %%
# Read the picture through the formula: :math:`c_j` is the weight factor
# :math:`\alpha_j/(1-\alpha_j)` times the distance from :math:`v_j` to the output (the
# star). A small circle far from the star can cost more than a medium one next to it;
# a value *at* the output costs nothing to evict, whatever its weight, because the
# renormalised mixture of the others lands on the same point.
#
# How often does it matter?
# -------------------------
#
# Over many random draws (:math:`b + 1 = 64` tokens, :math:`d = 64`), how often CAOTE
# evicts a different token than "smallest weight", how much output error that saves, and
# how often FastCAOTE (Eq. 22: :math:`V\alpha` replaced by the mean value, cheaper)
# agrees with CAOTE -- for flat attention (logits of spread 0.5) and peaked attention
# (spread 3):

trials, n, d = 2000, 64, 64
rows = np.arange(trials)
print(f"{'spread':>6} {'CAOTE differs':>14} {'error, min-attention':>21} "
      f"{'error, CAOTE':>13} {'Fast = CAOTE':>13}")
for spread in (0.5, 3.0):
    logits = spread * rng.standard_normal((trials, n))
    values = rng.standard_normal((trials, n, d))
    alpha = np.exp(logits - logits.max(axis=1, keepdims=True))
    alpha /= alpha.sum(axis=1, keepdims=True)
    c, c_fast = caote_scores(alpha, values), fast_caote_scores(alpha, values)
    pick_attention, pick_caote, pick_fast = (alpha.argmin(axis=1), c.argmin(axis=1),
                                             c_fast.argmin(axis=1))
    print(f"{spread:>6} {np.mean(pick_attention != pick_caote):>14.0%} "
          f"{c[rows, pick_attention].mean():>21.2e} "
          f"{c[rows, pick_caote].mean():>13.2e} "
          f"{np.mean(pick_fast == pick_caote):>13.0%}")

# %%
# With flat attention the weights alone barely separate the tokens and the distance term
# often decides: CAOTE evicts another token in about a quarter of the draws, and the
# mean error drops by a few per cent (averaged over all draws, including those where
# both pick the same token). With peaked attention the smallest weight is so small that
# its token is nearly always the cheapest to evict anyway. FastCAOTE mostly agrees with
# CAOTE here, where the values are centred.
#
# With one eviction, CAOTE's choice is optimal by construction -- it *is* the minimum
# error -- so the saving is guaranteed; the question the paper answers experimentally is
# how much that per-step optimum helps over a whole generation.
#
# A meta-policy
# -------------
#
# Eq. 8 needs weights that sum to 1. CAOTE applies to any non-negative score by
# normalising it first (Eqs. 19-21): H2O's accumulated attention sums to more than 1, so
# it is divided by its sum (:func:`refkv.policies.caote.normalise`).

h2o_scores = np.array([3.1, 0.4, 1.7, 0.0, 0.8])
print("H2O scores", h2o_scores, "-> normalised", np.round(normalise(h2o_scores), 3))

# %%
# In refkv, ``caote`` wraps a base policy by name: its protected tokens and state are
# the base's, and the score becomes :math:`c_j` computed from the base's scores and the
# cached values. Here on the built-in model in token-generation mode (:math:`B = 1`, one
# eviction per token, CAOTE's own setting), measuring the relative error of the last
# logits against no eviction:

model = refkv.load("tiny")
tokens = rng.integers(0, model.config.vocab_size, size=160)
reference = model.forward_full(tokens)[-1]
print(f"{'policy':<50} logit error")
for name, params in (("tova", {}), ("caote", {"base": "tova"}),
                     ("caote", {"base": "tova", "fast": True}),
                     ("h2o", {}), ("caote", {"base": "h2o"})):
    policy = refkv.policies.get(name, **params)
    logits = refkv.Engine(model, policy, budget=32).prefill(tokens, block_size=1)
    error = np.linalg.norm(logits - reference) / np.linalg.norm(reference)
    print(f"{policy.describe():<50} {error:.3f}")

# %%
# On a random model these numbers say little about quality; they show the wiring.
#
# Exact for which head?
# ---------------------
#
# Theorem 3.2 is about one query and its own softmax weights. The built-in model, like
# SmolLM2 and Llama 3, uses grouped-query attention: two query heads share each KV head,
# and refkv's policies score per KV head from the group's *mean* weights
# :math:`\bar\alpha` (KeyDiff App. B.2;
# :meth:`refkv.policies.View.attention_by_kv_head`). Each query head :math:`h` still has
# its own weights :math:`\alpha_h` and output :math:`X_h = V\alpha_h`. Evicting
# :math:`j` moves :math:`X_h` by exactly :math:`c_j(\alpha_h)`; but
# :math:`c_j(\bar\alpha)` is neither of those, nor the change of the heads' mean output
# (each head renormalises by its own :math:`1 - \alpha_{h,j}`). Brute force on two query
# heads over one KV head:

g, n, d = 2, 16, 8
group_logits = 1.5 * rng.standard_normal((g, n))
values = rng.standard_normal((n, d))
alpha_h = np.exp(group_logits - group_logits.max(axis=1, keepdims=True))
alpha_h /= alpha_h.sum(axis=1, keepdims=True)         # (g, n): each head's softmax
# (g, n), brute force
per_head = np.stack([eviction_errors(group_logits[h], values) for h in range(g)])
outputs = alpha_h @ values                            # (g, d)


def mean_output_without(j):
    """The heads' mean output after evicting j, each head renormalising its weights."""
    rest = np.delete(values, j, axis=0)
    return np.mean([np.delete(alpha_h[h], j) / (1 - alpha_h[h, j]) @ rest
                    for h in range(g)], axis=0)


mean_change = np.array([np.linalg.norm(outputs.mean(axis=0) - mean_output_without(j))
                        for j in range(n)])
# what a per-KV-head score computes
from_mean = caote_scores(alpha_h.mean(axis=0), values)


def worst(a, b):
    return np.max(np.abs(a - b) / b)


exact = max(worst(caote_scores(alpha_h[h], values), per_head[h]) for h in range(g))
print(f"per query head, c_j(alpha_h) vs brute force: {exact:.1e} "
      "(largest relative gap)")
print("c_j(group mean), largest relative gap to the true change of",
      f"head 0: {worst(from_mean, per_head[0]):.0%}, "
      f"head 1: {worst(from_mean, per_head[1]):.0%},",
      f"the mean output: {worst(from_mean, mean_change):.0%}")
# The statement of this section, checked: exact per query head, not for the group mean.
assert all(np.allclose(caote_scores(alpha_h[h], values), per_head[h], rtol=1e-10)
           for h in range(g))
assert worst(from_mean, mean_change) > 0.01

# %%
# So, precisely: for one evicted token and a query head's own softmax weights (TOVA at
# :math:`B = 1` with one query head per KV head, as in multi-head attention),
# :math:`c_j` is the change in that head's attention output, with nothing approximated.
# Under GQA the per-KV-head score is the closed form evaluated on the group's mean
# weights: a summary of the group. In this draw it is up to about 30 % off the change of
# the heads' mean output, and far more off a single head's change where that head gives
# token :math:`j` almost no weight and the other a lot. And in any case later layers and
# later steps see the change propagate, which no per-step score accounts for.

# %%
# Exercises
# ---------
#
# 1. Predict what happens to every :math:`c_j` when all values are shifted by the same
#    vector, then check on the 9-token example.
# 2. With uniform attention, which token does CAOTE evict?
#
# Solutions
# ---------
# (The test suite runs these lines; a wrong solution fails it.)

# 1. Nothing: V alpha - v_j is unchanged by a common shift, because the weights sum to
#    1.
rng_ex = np.random.default_rng(70)
alpha9 = rng_ex.dirichlet(np.ones(9))
values9 = rng_ex.standard_normal((9, 2))
shifted = caote_scores(alpha9, values9 + np.array([5.0, -3.0]))
print("exercise 1: c unchanged by a shift:",
      np.allclose(shifted, caote_scores(alpha9, values9), atol=1e-12))
assert np.allclose(shifted, caote_scores(alpha9, values9), rtol=0, atol=1e-12)

# 2. alpha_j / (1 - alpha_j) is the same for all j, so c_j ranks by |mean value - v_j|:
#    CAOTE evicts the value nearest the mean.
uniform = np.full(9, 1 / 9)
nearest = int(np.argmin(np.linalg.norm(values9 - values9.mean(axis=0), axis=1)))
print("exercise 2: CAOTE evicts", int(np.argmin(caote_scores(uniform, values9))),
      "| nearest the mean:", nearest)
assert int(np.argmin(caote_scores(uniform, values9))) == nearest

# %%
# Saving the figures
# ------------------
# In the documentation the figures above are part of the page. Run by hand, as
# ``python tutorials/07_caote.py``, the script saves them as PNG files in
# ``~/.cache/refkv/figures`` (or in the folder named by the ``REFKV_FIGURES``
# environment variable), never in the source tree, and prints each path;
# :func:`refkv.figures.save_figures` does it.

from refkv.figures import save_figures

save_figures()
