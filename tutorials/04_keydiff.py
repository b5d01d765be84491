"""
4. KeyDiff: key geometry and the anchor
=======================================

Attention-based policies need the attention matrix. KeyDiff (Park et al., 2025) asks
whether the keys alone can tell which tokens matter. Its observation (Sec. 3.1, Fig. 2):
keys that point in an unusual direction, with low cosine similarity to the other keys,
tend to receive high attention whatever the query. So it keeps the keys least similar
to the rest (Eq. 7), and, to make that :math:`O(n)`, measures similarity to one *anchor*
vector, the mean of the unit keys (Eq. 8):

.. math::

   s_i = -\\frac{\\langle \\mu(\\hat K), k_i\\rangle}
   {\\lVert\\mu(\\hat K)\\rVert\\,\\lVert k_i\\rVert},
   \\qquad \\mu(\\hat K) = \\frac1n \\sum_{j=1}^n \\frac{k_j}{\\lVert k_j\\rVert},
   \\qquad S = \\operatorname{topk}(s, N).

Key geometry is a property of *trained* weights, so this tutorial uses
SmolLM2-135M-Instruct (30 layers, 3 KV heads of width 64). It reads one paragraph, keeps
every layer's keys and attention, and then asks each policy what it would keep.
"""

from dataclasses import replace

import numpy as np
from scipy.stats import spearmanr

import refkv
from refkv.figures import pyplot
from refkv.model import load_with_tokenizer
from refkv.model.gguf import ModelNotFoundError
from refkv.policies import select
from refkv.policies.keydiff import anchor, anchor_scores, pairwise_scores
from refkv.recording import Recorder

plt = pyplot("Tutorial 4")  # matplotlib.pyplot, or one line saying how to install it

try:
    model, tokenizer = load_with_tokenizer("smollm2")
except ModelNotFoundError as error:
    raise SystemExit(f"Tutorial 4 needs the trained model: {error}") from None

TEXT = (
    "The lighthouse keeper of Skerry Point kept a logbook for forty years. Every "
    "evening he wrote down the weather, the ships that passed, and one sentence about "
    "his day. In the spring of the eleventh year he noted that a grey seal had started "
    "to sleep on the lowest step of the tower. The seal came back every evening for "
    "six weeks, and the keeper named her Marguerite, after his grandmother. When the "
    "autumn storms arrived, the seal disappeared, and the logbook records only wind "
    "speeds for a month. Then, on the first calm morning of November, the keeper "
    "wrote: Marguerite returned with a pup. He painted the lowest step blue so that "
    "the boatmen would not tie their ropes there. The step is still blue today, "
    "although the lighthouse has been automatic since 1974 and the logbook is kept in "
    "the town museum, open on Tuesdays and Saturdays. Visitors who ask the curator "
    "about the blue step are told the story, and most of them want to know one thing: "
    "what name did the keeper give to the pup?"
)
tokens = tokenizer.encode(TEXT)
T = len(tokens)
print(model, "|", T, "tokens")

# %%
# Watching a forward pass
# -----------------------
#
# A policy sees one :class:`refkv.policies.View` per layer. A
# :class:`refkv.recording.Recorder` wraps a policy (here ``full``, which never evicts)
# and keeps every view it is shown; asking it for the keys and the attention weights
# makes the engine form them. One prefill of the whole paragraph then gives us, for all
# 30 layers, the keys after RoPE and the attention matrix.

recorder = Recorder("full", needs=("keys", "attention"))
refkv.Engine(model, recorder).prefill(tokens)
views = recorder.views()
print(len(views), "views; layer 0 keys", views[0].keys.shape,
      "attention", views[0].attention.shape)

# %%
# Do distinctive keys get attention?
# ----------------------------------
#
# For every layer and KV head, score each key by Eq. 7 (minus its summed cosine to all
# keys, :func:`refkv.policies.keydiff.pairwise_scores`) and measure the attention it
# receives (its mean weight over the queries that can see it, group-averaged). If the
# paper's observation holds, the two rank the tokens alike: Spearman's :math:`\rho > 0`.


def received_attention(view, head):
    A = view.attention_by_kv_head()[head].astype(np.float64)   # (T queries, T keys)
    return np.array([A[j:, j].mean() for j in range(A.shape[1])])


rho = np.array([[spearmanr(pairwise_scores(v.keys[h].astype(np.float64)),
                           received_attention(v, h)).statistic
                 for h in range(v.n_kv_heads)] for v in views])
print(f"Spearman rho over {rho.size} heads: median {np.median(rho):+.2f}, "
      f"{(rho > 0.2).sum()} heads above +0.2, {(rho < -0.2).sum()} below -0.2")
best_layer, best_head = np.unravel_index(np.argmax(rho), rho.shape)
print(f"strongest: layer {best_layer}, KV head {best_head}, "
      f"rho = {rho[best_layer, best_head]:+.2f}")

# %%
# In this small model, on this one paragraph, the observation is **head-dependent**: a
# minority of heads show a clear positive rank correlation, many show none, and some a
# negative one. (The paper's Fig. 2 shows two heads of Llama 3.2-3B.) Here is the
# strongest head, drawn as KeyDiff's Fig. 2: the pairwise cosine similarity of the first
# 48 keys, and their attention weights.

view = views[best_layer]
K = view.keys[best_head].astype(np.float64)
unit = K / np.linalg.norm(K, axis=1, keepdims=True)
m = 48
fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
im0 = axes[0].imshow(unit[:m] @ unit[:m].T, cmap="coolwarm", vmin=-1, vmax=1)
axes[0].set(title=f"cosine similarity of keys (layer {best_layer}, head {best_head})",
            xlabel="key", ylabel="key")
fig.colorbar(im0, ax=axes[0], fraction=0.046)
A = view.attention_by_kv_head()[best_head]
im1 = axes[1].imshow(np.ma.masked_equal(A[:m, :m], 0.0), cmap="viridis")
axes[1].set(title="attention weights", xlabel="key", ylabel="query")
fig.colorbar(im1, ax=axes[1], fraction=0.046)
fig.tight_layout()

# %%
# Read the left picture by rows: a key whose row is mostly blue (dissimilar to the
# others) is a distinctive key; on the right, the columns that stay bright all the way
# down are the keys every query attends to. The first token is both: the attention sink
# is the most distinctive key of the head.
#
# The anchor is exact for the ranking
# -----------------------------------
#
# Eq. 7 costs :math:`O(n^2)`; Eq. 8 replaces the sum over keys by the anchor. Since
# :math:`\sum_j \cos(k_i, k_j) = \hat k_i \cdot n\,\mu(\hat K) = n\lVert\mu(\hat
# K)\rVert \cos(\mu(\hat K), k_i)`, the two scores differ by a positive factor, so they
# *rank identically* -- the relaxation of Sec. 3.3 loses nothing here. Checked on every
# head:

same = all(np.array_equal(
    np.argsort(pairwise_scores(v.keys[h].astype(np.float64)), kind="stable"),
    np.argsort(anchor_scores(v.keys[h].astype(np.float64)), kind="stable"))
           for v in views for h in range(v.n_kv_heads))
ratio = pairwise_scores(K) / anchor_scores(K)
print("Eq. 7 and Eq. 8 give the same order on all 90 heads:", same)
print(f"ratio on the strongest head: {ratio.min():.4f} .. {ratio.max():.4f}"
      f" = n |mu| = {T * np.linalg.norm(anchor(K)):.4f}")

# %%
# What each policy keeps: the PCA picture
# ---------------------------------------
#
# Now evict to :math:`N = 64` of the 220-odd tokens in one shot (:math:`B = T`). With
# one shot the keys of every layer are those we recorded, whatever the policy, so we can
# ask each policy directly: ``policy.keep_indices(view)`` with ``view.keep = N`` is the
# call the engine makes. Then project the keys of one head onto their two main principal
# components (KeyDiff Fig. 4) and colour what each policy keeps. The head, layer 20's
# first, was picked by eye among a few dozen because it shows the contrast clearly; the
# statistic after the picture covers all 90 heads. **Predict, then run:** sink keeps the
# first four tokens and the last 60; how many of its 64 does TOVA, which follows the
# last query's attention, keep among the last 64 positions -- nearly all, about half, or
# fewer?

N = 64
policies = {name: refkv.policies.get(name) for name in ("sink", "tova", "keydiff")}


def kept_by(policy, view):
    return policy.keep_indices(replace(view, budget=N, keep=N))


LAYER, HEAD = 20, 0
view = views[LAYER]
K = view.keys[HEAD].astype(np.float64)
centred = K - K.mean(axis=0)
_, _, components = np.linalg.svd(centred, full_matrices=False)
xy = centred @ components[:2].T
fig, axes = plt.subplots(1, 3, figsize=(11, 3.8), sharex=True, sharey=True)
for ax, (name, policy) in zip(axes, policies.items()):
    keep = np.zeros(T, dtype=bool)
    keep[kept_by(policy, view)[HEAD]] = True
    ax.scatter(*xy[~keep].T, s=10, c="tab:orange", label="evicted")
    ax.scatter(*xy[keep].T, s=10, c="tab:blue", label="retained")
    ax.set(title=name, xlabel="PC 1")
axes[0].set_ylabel("PC 2")
axes[0].legend(loc="best", fontsize=8)
fig.suptitle(f"keys of layer {LAYER}, KV head {HEAD}: {N} of {T} kept")
fig.tight_layout()

# %%
# In this head the keys of the most recent tokens form one cluster (bottom left). Sink
# keeps that window and the four first tokens, so its kept set is one tight clump.
# KeyDiff takes keys from all over the cloud, including the far ends of the arc, and
# leaves many of the crowded recent keys behind. TOVA is in between: it follows the
# last query's attention, which in a trained model is not local, so it keeps some of the
# recent clump and spreads the rest over the arc. Counted:

kept_sets = {name: set(kept_by(policy, view)[HEAD])
             for name, policy in policies.items()}
recent = set(range(T - N, T))  # the last N positions
for name, kept_set in kept_sets.items():
    print(f"{name:<8} keeps {len(kept_set & recent):>2} of its {N} "
          f"in the last {N} positions, "
          f"shares {len(kept_set & kept_sets['sink']):>2} with sink")
# What the paragraph says, checked: TOVA keeps fewer than half of its tokens in the
# recent window, and shares barely more with sink than KeyDiff does.
assert len(kept_sets["tova"] & recent) < N / 2
assert len(kept_sets["tova"] & kept_sets["sink"]) < \
    len(kept_sets["keydiff"] & kept_sets["sink"]) + N / 8

# %%
# One head is an anecdote. KeyDiff Fig. 5 measures the spread of a kept set by the log
# volume it spans, :math:`\log\det(K_S K_S^\top)`; larger means more diverse keys. Over
# all 30 layers and 3 heads:

log_volume = {name: [] for name in policies}
for v in views:
    for name, policy in policies.items():
        kept = kept_by(policy, v)
        for h in range(v.n_kv_heads):
            KS = v.keys[h][kept[h]].astype(np.float64)
            log_volume[name].append(np.linalg.slogdet(KS @ KS.T)[1])
for name, values in log_volume.items():
    print(f"{name:<8} median log det(K_S K_S^T) = {np.median(values):7.1f}")

# %%
# KeyDiff's kept sets span the largest volume, as in the paper's Fig. 5: the selection
# rule does what its derivation (Sec. 3.3, Eqs. 9-10) says it optimises. Whether that
# keeps the *right* tokens for a task is a different question, for the experiments (see
# the Experiments page). And note what KeyDiff never needed: the attention weights. In
# the engine it runs with attention computed tile by tile, never formed
# (``engine.stats.attention_materialised`` stays 0; tutorial 3).

# %%
# Exercises
# ---------
#
# 1. The L2-norm policy (Devoto et al., 2024; ``knorm``) keeps the keys of *lowest*
#    norm. Write its score in one line, keep :math:`N = 64` on layer 20, head 0 with
#    :func:`refkv.policies.select`, and compare with refkv's ``knorm`` and with KeyDiff.
# 2. Predict first: in how many of the 90 heads does KeyDiff keep the first token (the
#    attention sink) at :math:`N = 64`?
#
# Solutions
# ---------
# (The test suite runs these lines; a wrong solution fails it.)

# 1. Score = minus the norm; the rest is the shared top-N.
l2_score = -np.linalg.norm(views[LAYER].keys.astype(np.float64), axis=-1)  # (Hkv, T)
l2_kept = set(select(l2_score, views[LAYER].positions, N)[HEAD])
knorm_kept = set(kept_by(refkv.policies.get("knorm"), views[LAYER])[HEAD])
print(f"exercise 1: ours == knorm: {l2_kept == knorm_kept}; "
      f"shares {len(l2_kept & kept_sets['keydiff'])} of {N} with KeyDiff")
assert l2_kept == knorm_kept

# 2. Count the heads whose kept columns include column 0 (position 0). Nearly all: the
#    sink's key is the most distinctive of its head (the cosine picture above), so
#    KeyDiff keeps StreamingLLM's first token without being told to.
keydiff = policies["keydiff"]
keeps_first = sum(int(0 in kept_by(keydiff, v)[h])
                  for v in views for h in range(v.n_kv_heads))
print(f"exercise 2: KeyDiff keeps token 0 in {keeps_first} "
      f"of {len(views) * views[0].n_kv_heads} heads")
assert keeps_first > 0.8 * len(views) * views[0].n_kv_heads

# %%
# Saving the figures
# ------------------
# In the documentation the figures above are part of the page. Run by hand, as
# ``python tutorials/04_keydiff.py``, the script saves them as PNG files in
# ``~/.cache/refkv/figures`` (or in the folder named by the ``REFKV_FIGURES``
# environment variable), never in the source tree, and prints each path;
# :func:`refkv.figures.save_figures` does it.

from refkv.figures import save_figures

save_figures()
