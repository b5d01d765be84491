"""
3. Attention-based eviction: TOVA, H2O, SnapKV
==============================================

The first generation of eviction policies asks the attention itself which tokens matter:
a token that the queries attend to is kept. KeyDiff (App. A.1) puts them in one frame.
With :math:`A` the attention weights of the current queries over the cached keys and
an *aggregation* :math:`\\phi`, a policy keeps

.. math::

   S = \\operatorname{topk}\\big(\\phi(A), N\\big) \\qquad \\text{(KeyDiff Eq. 5)},

and the three classic choices of :math:`\\phi` are

.. math::

   \\phi_{\\text{TOVA}}(A) = A_{-1,:}, \\qquad
   \\phi_{\\text{H2O}}(A) = A_{\\text{prev}} + A^\\top \\mathbf 1, \\qquad
   \\phi_{\\text{SnapKV}}(A) = (A_W^\\top \\mathbf 1) * K .

TOVA (Oren et al., 2024) reads the last query's row; H2O (Zhang et al., 2023) sums the
column of every query that ever saw the token; SnapKV (Li et al., 2024) sums the last
:math:`w` queries' rows and smooths the result with an averaging kernel :math:`K` of
width :math:`k`. This tutorial computes the three on a small attention matrix by hand,
checks refkv's policies against that, and then runs them in a model.
"""

import numpy as np

import refkv
from refkv.attention import attention_weights
from refkv.figures import pyplot
from refkv.policies import Policy, View, select
from refkv.policies.h2o import accumulated_attention
from refkv.policies.snapkv import pool1d, window_attention
from refkv.policies.tova import last_query_attention
from refkv.recording import Recorder, observed

plt = pyplot("Tutorial 3")  # matplotlib.pyplot, or one line saying how to install it

rng = np.random.default_rng(3)

# %%
# One attention matrix
# --------------------
#
# A cache of 10 tokens (positions 0..9), of which the last :math:`B = 6` are the block
# being processed. One KV head serves two query heads (grouped-query attention), so the
# weights have shape ``(Hkv, g, B, n) = (1, 2, 6, 10)``. The causal mask gives a query
# zero weight on the keys after it.

n, B, d = 10, 6, 4
keys = rng.standard_normal((1, n, d))
values = rng.standard_normal((1, n, d))
queries = 2.0 * rng.standard_normal((2, B, d))
positions = np.arange(n)[None, :]
query_positions = np.arange(n - B, n)
A = attention_weights(queries, keys, query_positions, positions)
print("A:", A.shape, "| each row sums to", np.round(A.sum(-1).ravel(), 12)[:3], "...")

# %%
# Policies score per KV head, so the query heads of a group are averaged first (KeyDiff
# App. B.2); :meth:`refkv.policies.View.attention_by_kv_head` does it. Then the three
# aggregations, with refkv's functions:

A_bar = A.mean(axis=1)[0]                   # (B, n): group average, one KV head
tova = last_query_attention(A_bar)          # last row
h2o = accumulated_attention(A_bar)          # column sums A^T 1
window = 3                                  # SnapKV's w (32 by default)
snap_sum = window_attention(A_bar, window)  # last w rows, summed
snapkv = snap_sum.copy()
snapkv[:-window] = pool1d(snap_sum[:-window], kernel=3)    # pooled outside the window

print("position  " + " ".join(f"{p:>5d}" for p in range(n)))
for name, s in (("TOVA", tova), ("H2O", h2o), ("SnapKV", snapkv)):
    print(f"{name:<8}  " + " ".join(f"{v:5.2f}" for v in s))

# %%
# Read the rows. TOVA's is one probability distribution: the last query's view. H2O's
# column sums favour *old* tokens: positions 0-4 were seen by all six queries, position
# 9 only by the last one, which is why H2O protects a window of recent tokens (by
# default :math:`N/2`). SnapKV's pooling spreads each token's score to its neighbours,
# keeping small neighbourhoods of important tokens together; its zero padding (PyTorch's
# ``avg_pool1d`` rule, see :func:`refkv.policies.snapkv.pool1d`) also damps the first
# position, which the last queries liked but SnapKV will drop.
#
# Keep :math:`N = 5` with the shared selection routine :func:`refkv.policies.select`
# (ties go to the more recent token), once with nothing protected and once with the
# protections the real policies use:

N = 5
pos = positions[0]
print("TOVA   keeps", pos[select(tova[None], positions, N)[0]])
print("H2O    keeps",
      pos[select(h2o[None], positions, N, protected=positions >= n - N // 2)[0]],
      f"(last {N // 2} protected)")
print("SnapKV keeps",
      pos[select(snapkv[None], positions, N, protected=positions >= n - window)[0]],
      f"(last {window} protected)")

# %%
# The same through the policies
# -----------------------------
#
# A policy sees a :class:`refkv.policies.View`, the engine's picture of one layer at
# eviction time. Building one by hand shows that the policy classes compute exactly the
# formulas above. H2O is stateful: ``observe`` adds this block's column sums to an
# accumulator stored in the cache next to each token (a *field*), and ``score`` reads
# it; :func:`refkv.recording.observed` does that step as the engine would, starting from
# an empty accumulator.

view = View(layer=0, n_layers=1, keys=keys, values=values, positions=positions,
            fields={}, queries=queries, query_positions=query_positions,
            block_keys=keys[:, -B:], block_values=values[:, -B:], attention=A, budget=N)
h2o_policy = refkv.policies.get("h2o")
view_after = observed(h2o_policy, view)
checks = {
    "tova": (refkv.policies.get("tova").score(view)[0], tova),
    "h2o": (h2o_policy.score(view_after)[0], h2o),
    "snapkv": (refkv.policies.get("snapkv", window=window, kernel=3).score(view)[0],
               snapkv),
}
for name, (from_policy, by_hand) in checks.items():
    print(f"{name:<7} policy == by hand: "
          f"{np.allclose(from_policy, by_hand, rtol=0, atol=1e-15)}")

# %%
# Which rows does each score need? TOVA reads one row of :math:`A`, SnapKV :math:`w`
# rows, H2O every row of every block. A row is cheap to recompute on its own: the last
# query's logits against the cached keys and one softmax. Recomputed apart from the rest
# of the matrix, it gives the same TOVA score, and the last :math:`w` rows the same
# SnapKV score -- which is what lets a backend pair these two with a fused attention
# kernel (see the end of this tutorial).

last_row = attention_weights(queries[:, -1:], keys, query_positions[-1:],
                             positions)  # (1, 2, 1, 10)
last_rows = attention_weights(queries[:, -window:], keys, query_positions[-window:],
                              positions)
print("TOVA from the last row alone == TOVA:",
      np.allclose(last_row.mean(axis=1)[0, -1], tova, atol=1e-15))
print("SnapKV's sum from the last w rows alone == SnapKV's sum:",
      np.allclose(window_attention(last_rows.mean(axis=1)[0], window), snap_sum,
                  atol=1e-15))

# %%
# A picture of the matrix and the three scores:

fig, axes = plt.subplots(2, 1, figsize=(7.2, 5.6), height_ratios=(1.1, 1), sharex=True)
future = query_positions[:, None] < positions[0][None, :]   # (B, n): masked keys
cmap = plt.get_cmap("magma_r").copy()
cmap.set_bad("#cfd8e3")                          # the masked future: blue-grey
im = axes[0].imshow(np.ma.masked_where(future, A_bar), cmap=cmap, aspect="auto",
                    vmin=0, extent=(-0.5, n - 0.5, n - 0.5, n - B - 0.5))
# the colour bar in an inset, so both panels keep the same width and columns align
fig.colorbar(im, cax=axes[0].inset_axes([1.01, 0, 0.025, 1]), label="weight")
axes[0].set(ylabel="query position",
            title="attention of the block's queries (group mean); blue-grey: future, "
                  "masked", yticks=range(n - B, n))
axes[0].title.set_fontsize(9)
width = 0.27
for i, (name, s) in enumerate((("TOVA", tova), ("H2O / B", h2o / B),
                               ("SnapKV / w", snapkv / window))):
    axes[1].bar(np.arange(n) + (i - 1) * width, s, width, label=name)
axes[1].set(xlabel="key position", ylabel="score (scaled)", xticks=range(n))
axes[1].legend()
fig.tight_layout()

# %%
# In a model
# ----------
#
# Now the three policies in the built-in model, with their default parameters (H2O:
# recent window :math:`N/2`; SnapKV: :math:`w = 32`, :math:`k = 7`, KeyDiff App. B.2), a
# 384-token prompt, budget :math:`N = 64` and blocks of :math:`B = 32`. Each reads
# attention weights, so the engine forms them at every layer call -- but only what the
# policy reads: TOVA the last query's row, SnapKV its window's rows, H2O the column
# sums, never the whole matrix (``attention_matrices`` counts whole ones). KeyDiff, for
# comparison, reads none (the engine counts).

model = refkv.load("tiny")
tokens = rng.integers(0, model.config.vocab_size, size=384)
N, B = 64, 32
engines = {}
for name in ("tova", "h2o", "snapkv", "keydiff"):
    engine = refkv.Engine(model, name, budget=N)
    engine.prefill(tokens, block_size=B)
    engines[name] = engine
    s = engine.stats
    print(f"{name:<8} attention weights read in {s.attention_materialised:>2} "
          f"of {s.attention_calls} layer calls, whole matrices {s.attention_matrices}")
    assert s.attention_matrices == 0  # rows or column sums only

# %%
# Where do the kept tokens lie? **Predict, then run:** sketch, for each policy, where
# along the 384 positions you expect its 64 kept tokens. Then the histogram of the kept
# positions over all layers and KV heads. To read it we need a baseline: a policy that
# scores every token at random, knowing nothing about it, run through the same blocks
# and budget.


class RandomScores(Policy):
    """Scores drawn uniformly at random at every eviction: a policy knowing nothing."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def score(self, view):
        return self.rng.random(view.positions.shape)


engines["random"] = refkv.Engine(model, RandomScores(seed=0), budget=N)
engines["random"].prefill(tokens, block_size=B)
kept = {name: np.concatenate([c.positions.ravel() for c in engine.caches])
        for name, engine in engines.items()}

# One panel per policy, each over the random policy's outline, so that no bar hides
# another (H2O's and SnapKV's last bins are equally tall).
fig, axes = plt.subplots(3, 1, figsize=(7, 5), sharex=True, sharey=True)
bins = np.arange(0, 385, 16)
for ax, name, colour in zip(axes, ("tova", "h2o", "snapkv"), ("C0", "C1", "C2")):
    ax.hist(kept[name], bins=bins, color=colour, alpha=0.75, label=name)
    ax.hist(kept["random"], bins=bins, histtype="step", lw=1.5, ls="--",
            color="k", label="random")
    ax.legend(loc="upper center", fontsize=8, ncol=2)
axes[1].set_ylabel("count (all layers, heads)")
axes[-1].set(xlabel="position of a kept token", xticks=range(0, 385, 64))
fig.tight_layout()

print("kept per 64-token bin (positions 0-63, ..., 320-383):")
for name in ("tova", "random", "h2o", "snapkv"):
    print(f"  {name:<7}", np.histogram(kept[name], bins=np.arange(0, 385, 64))[0])

# %%
# The histogram separates H2O and SnapKV from the rest. **H2O** keeps its protected
# recent window (:math:`N/2 = 32` tokens) and then the *oldest* tokens of the prompt: an
# accumulated sum grows with the number of queries that saw a token, so the first tokens
# win by seniority, whatever their content -- the bias noted above, in its plain form.
# **SnapKV** keeps its protected window (:math:`w = 32`) and clumps of recent tokens,
# scored by the last 32 queries and smoothed.
#
# **TOVA** keeps a recent-leaning spread -- and so does the random policy, bin for bin
# nearly the same. The lean is not TOVA's doing: it is *survival*. Under block eviction
# a token from the first block has faced every eviction and must
# survive all ten of them (the first two blocks fit in :math:`N`); a token of the last
# block has faced one. Whatever the score, old
# tokens have had more chances to go.
#
# One might instead guess that the last query "attends mostly near itself". Measure it,
# without eviction: the share of the last query's attention on its 32 nearest keys, per
# layer and KV head, against :math:`32/384` for uniform attention.

recorder = Recorder("full", needs=("attention",))
refkv.Engine(model, recorder).prefill(tokens)  # one block, no budget
near = np.array([v.attention_by_kv_head()[:, -1, -32:].sum(axis=-1)
                 for v in recorder.views()])
print("last query's weight on its 32 nearest keys: "
      f"{near.min():.3f} .. {near.max():.3f} "
      f"(uniform: {32 / 384:.3f})")
recent_share = {name: np.mean(kept[name] >= 384 - 128) for name in ("tova", "random")}
print("share of kept tokens among the last 128 positions:",
      ", ".join(f"{name} {share:.2f}" for name, share in recent_share.items()))

# The two claims of the paragraphs above, as checks: attention is not local (never even
# twice uniform), and TOVA's recent lean is within a few points of random scoring's.
assert near.max() < 2 * 32 / 384
assert abs(recent_share["tova"] - recent_share["random"]) < 0.1

# %%
# In this random model attention is close to uniform, so TOVA's scores are nearly noise
# and survival decides where its kept tokens lie. In a trained model the last query's
# row is far from uniform, and TOVA's choice departs from random (tutorial 4 shows it on
# SmolLM2).
#
# What none of them can do is anticipate: with blocks, a token is scored by the queries
# of the blocks seen so far, and a token evicted now is gone when a later block would
# have needed it (KeyDiff Sec. 2.4).
#
# And the kernel. FlashAttention-style kernels never form :math:`A`; what that costs
# depends on how much of :math:`A` a policy reads. **TOVA** reads one row and **SnapKV**
# :math:`w` rows: a backend keeps the fused kernel for the attention output and
# recomputes those rows beside it (the last queries' logits against the cache and a
# softmax, :math:`O(w\,n)` extra work; kvpress's ``SnapKVPress`` recomputes its window's
# queries this way), and gets the same scores, as checked above. **H2O** (and
# Scissorhands) accumulate the column of *every* query of every block, so they need the
# whole matrix at every step: they are the ones that really conflict with fused kernels.
# These costs motivate the attention-free policies of tutorials 4-6; tutorial 7 (CAOTE)
# goes the other way and adds the values to these scores.

# %%
# Exercises
# ---------
#
# Back to the 10-token matrix of the first section (``view``, ``h2o``, ``snap_sum``).
#
# 1. Without its protected recent window, which five tokens does H2O keep? Guess from
#    the printed H2O row before computing.
# 2. Set SnapKV's kernel to 1. What does its score become?
# 3. Which SnapKV is TOVA?
#
# Solutions
# ---------
# (The test suite runs these lines; a wrong solution fails it.)

# 1. The five oldest: seniority again (every query saw them).
h2o_unprotected = pos[select(h2o[None], positions, 5)[0]]
print("exercise 1: H2O without protection keeps", h2o_unprotected)
assert h2o_unprotected.tolist() == [0, 1, 2, 3, 4]

# 2. A kernel of 1 averages each score with nothing: the plain sum of the last w rows.
snap_k1 = refkv.policies.get("snapkv", window=window, kernel=1).score(view)[0]
print("exercise 2: SnapKV with k = 1 == sum of the last w rows:",
      np.allclose(snap_k1, snap_sum, atol=1e-15))
assert np.allclose(snap_k1, snap_sum, rtol=0, atol=1e-15)

# 3. A window of one query and no pooling: the last row, TOVA's score.
snap_as_tova = refkv.policies.get("snapkv", window=1, kernel=1).score(view)[0]
print("exercise 3: SnapKV(w = 1, k = 1) == TOVA:",
      np.allclose(snap_as_tova, tova, atol=1e-15))
assert np.allclose(snap_as_tova, tova, rtol=0, atol=1e-15)

# %%
# Saving the figures
# ------------------
# In the documentation the figures above are part of the page. Run by hand, as
# ``python tutorials/03_attention_based_eviction.py``, the script saves them as PNG
# files in ``~/.cache/refkv/figures`` (or in the folder named by the ``REFKV_FIGURES``
# environment variable), never in the source tree, and prints each path;
# :func:`refkv.figures.save_figures` does it.

from refkv.figures import save_figures

save_figures()
