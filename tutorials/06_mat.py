"""
6. MAT: anchor tokens in deep and shallow layers
================================================

MAT ("Managing Anchor Tokens") starts from two observations about trained decoders
(its Sec. 3):

(i) in **deep** layers a few *anchor* tokens receive large attention logits from
    everything after them, and the logits *between* anchors are low (Table 1);
(ii) in **shallow** layers attention is diffuse: no token dominates.

So a deep layer keeps an anchor cache of :math:`\\beta` tokens next to a recent window,
and picks anchors by their logit to the first token, which is always an anchor: a token
whose own query gives the first key a *low* logit,

.. math::

   \\pi_i = \\frac{q_i^\\top k_0}{\\sqrt d} \\qquad \\text{(MAT Eq. 3)},

is likely another anchor. When the cache is full, the candidate with the *highest*
:math:`\\pi` is evicted (Eq. 4). A shallow layer keeps StreamingLLM's first tokens and a
window. This tutorial checks both observations on SmolLM2-135M-Instruct (anchors are a
property of trained weights) and then runs the policy.
"""

import numpy as np
from scipy.special import softmax
from scipy.stats import spearmanr

import refkv
from refkv.attention import causal_logits
from refkv.figures import pyplot
from refkv.model import load_with_tokenizer
from refkv.model.gguf import ModelNotFoundError
from refkv.policies.mat import (
    LOGIT_FIELD,
    anchor_logits,
    closed_form_keep,
    streaming_keep,
)
from refkv.recording import Recorder

plt = pyplot("Tutorial 6")  # matplotlib.pyplot, or one line saying how to install it

try:
    model, tokenizer = load_with_tokenizer("smollm2")
except ModelNotFoundError as error:
    raise SystemExit(f"Tutorial 6 needs the trained model: {error}") from None

TEXT = (
    "Question: Plants and animals need food for growth. What happens to most of the "
    "food that plants produce?\nAnswer: Most of it is used by the plant itself for "
    "energy and growth; some is stored in roots, seeds and fruits.\n"
    "Question: A student leaves a glass of water on a sunny windowsill for a week. "
    "Where did most of the water go?\nAnswer: It evaporated into the air of the room.\n"
    "Question: Which tool is best for measuring the mass of a small rock?\nAnswer: A "
    "balance.\n"
    "Question: Why does a metal spoon in a cup of hot tea feel warm after a few "
    "minutes?\n"
    "Answer: Heat moves from the tea into the spoon by conduction.\n"
    "Question: What do the roots of a tree take from the soil?\nAnswer:"
)
tokens = tokenizer.encode(TEXT)
T = len(tokens)
cfg = model.config
print(model, "|", T, "tokens")

# %%
# Attention logits, layer by layer
# --------------------------------
#
# As in tutorial 4, a :class:`refkv.recording.Recorder` collects every layer's
# :class:`refkv.policies.View` during one prefill. MAT reads logits, not weights, so the
# recorder asks for queries and keys only and the engine never forms the attention
# matrix; we compute the logits ourselves with :func:`refkv.attention.causal_logits` and
# average each KV head's query group, as refkv's policies do.

recorder = Recorder("full", needs=("keys", "queries"))
refkv.Engine(model, recorder).prefill(tokens)
views = recorder.views()
logits = np.stack([causal_logits(v.queries.astype(np.float64),
                                 v.keys.astype(np.float64),
                                 v.query_positions, v.positions).mean(axis=1)
                   for v in views])                          # (layers, Hkv, T, T)
print("logits:", logits.shape, "(-inf above the diagonal)")

fig, axes = plt.subplots(1, 2, figsize=(10, 4.3))
for ax, layer in zip(axes, (0, 20)):
    shown = np.where(np.isfinite(logits[layer, 0]), logits[layer, 0], np.nan)
    im = ax.imshow(shown, cmap="viridis")
    ax.set(title=f"layer {layer}, KV head 0: attention logits", xlabel="key",
           ylabel="query")
    fig.colorbar(im, ax=ax, fraction=0.046)
fig.tight_layout()

# %%
# The deep layer (right) shows MAT's Fig. 1: the first column, and a few others, stand
# far above the rest for every later query (logits from about -8 to 4) -- the anchor
# tokens. Layer 0 (left) has stripes too, but its logits span a narrow range (about -1
# to 4 here), so after the softmax no column dominates.
#
# How concentrated is attention?
# ------------------------------
#
# Observation (ii) as a number per layer (**predict, then run:** from which layer on do
# five keys take most of a query's attention?): the attention mass that a query gives
# its five most-attended keys (averaged over queries past position 20, heads included),
# and the mass on the first token alone.

weights = softmax(logits, axis=-1)
top5 = np.sort(weights[:, :, 20:], axis=-1)[..., -5:].sum(axis=-1).mean(axis=(1, 2))
first = weights[:, :, 20:, 0].mean(axis=(1, 2))
fig, ax = plt.subplots(figsize=(7, 3.2))
ax.plot(top5, "o-", label="mass on the 5 most attended keys")
ax.plot(first, "s-", label="mass on the first token")
ax.axvspan(-0.5, 1.5, color="grey", alpha=0.2, label="MAT's shallow layers ($L_s = 2$)")
ax.set(xlabel="layer", ylabel="attention mass", ylim=(0, 1))
ax.legend(fontsize=8)
fig.tight_layout()
print("top-5 mass, layers 0-1:", np.round(top5[:2], 2),
      "| layers 2-29: median", np.round(np.median(top5[2:]), 2))

# %%
# Layer 0 spreads its attention most (a quarter of the mass on its five favourite keys),
# layers 1-2 put about half there, and from layer 3 on five keys take about 80 %; the
# first token alone takes half or more in most layers from 12 on. That is MAT's
# shallow/deep split, and its default of :math:`L_s = 2` shallow layers is roughly in
# line with this model.
#
# Does a low logit to the first token mark an anchor?
# ---------------------------------------------------
#
# MAT's selection rule rests on observation (i). To test it, give each token an
# *anchorness*: the mean logit it receives from later queries, each query's logits
# centred first (a query's logits share an arbitrary offset). MAT predicts that tokens
# with a low :math:`\pi_i` (:func:`refkv.policies.mat.anchor_logits`) have a high
# anchorness, i.e. a positive rank correlation between :math:`-\pi` and anchorness.


def anchorness(layer_logits):
    finite = np.isfinite(layer_logits)
    centred = np.where(
        finite,
        layer_logits - np.nanmean(np.where(finite, layer_logits, np.nan), axis=-1,
                                  keepdims=True),
        np.nan)
    return np.array([[np.nanmean(centred[h, j + 1:, j]) for j in range(T - 1)]
                     for h in range(len(centred))])


rho = np.empty((cfg.n_layers, cfg.n_kv_heads))
for layer, v in enumerate(views):
    pi = anchor_logits(v.queries_by_kv_head().astype(np.float64),
                       v.keys[:, None, 0].astype(np.float64))
    pi = pi.mean(axis=1)  # group mean, (Hkv, T)
    score = anchorness(logits[layer])
    rho[layer] = [spearmanr(-pi[h, 1:T - 1], score[h, 1:]).statistic
                  for h in range(cfg.n_kv_heads)]
print("median rho(-pi, anchorness) per layer:", np.round(np.median(rho, axis=1), 2))
print(f"heads with rho > 0: {(rho > 0).mean():.0%} overall, "
      f"{(rho[2:] > 0).mean():.0%} in deep layers")

# %%
# On this prompt the rule holds only in part of the model: the correlation is positive
# in most heads of layers 1-11 and *negative* in layers 12-19 and the last two, about
# half the heads overall. MAT's Table 1 comes from LLaMA-2-7B; a model 50 times smaller
# need not share the pattern, and one prompt is a small sample. This is the kind of
# check refkv exists for: the policy below implements MAT exactly; whether its premise
# holds in a given model is measured, not assumed.
#
# The policy
# ----------
#
# ``mat`` keeps, in a deep layer, the first token, the last :math:`N - \beta` tokens,
# and the :math:`\beta - 1` tokens of lowest :math:`\pi` among those that left the
# window (defaults :math:`\beta = N/4`, :math:`L_s = 2`). That closed form equals
# repeating Eq. 4 token by token, which :func:`refkv.policies.mat.streaming_keep` does
# literally. First the two on this prompt's :math:`\pi` of layer 20, then the model
# under the policy with :math:`N = 64`, :math:`\beta = 16`.

N, beta = 64, 16
pi20 = anchor_logits(views[20].queries_by_kv_head().astype(np.float64),
                     views[20].keys[:, None, 0].astype(np.float64)).mean(axis=1)
positions = views[20].positions
same = np.array_equal(closed_form_keep(pi20, positions, N, beta),
                      streaming_keep(pi20, positions, N, beta))
print("closed form == literal Eq. 4 streaming:", same)

# Blocks of B <= N - beta tokens give exactly the token-by-token result (see the
# policy's notes).
mat = refkv.policies.get("mat", beta=beta)
engine = refkv.Engine(model, mat, budget=N)
engine.prefill(tokens, block_size=N - beta)
for layer in (0, 20):
    kept = engine.caches[layer].positions[0]
    window = N - beta if mat.deep(layer) else N - mat.sink
    older = kept[kept < T - window]
    print(f"layer {layer:>2} ({'deep' if mat.deep(layer) else 'shallow'}) "
          f"keeps {len(kept)} tokens: the last {window} and "
          + " ".join(repr(tokenizer.decode([tokens[p]])) for p in older))
print("stored logits of layer 20 (float64, per KV head and token):",
      engine.caches[20].fields[LOGIT_FIELD].shape)

# %%
# Layer 0 is shallow: besides its window it keeps the four first tokens (attention
# sinks). Layer 20 keeps the first token and :math:`\beta - 1 = 15` anchors chosen by
# their low :math:`\pi`, printed above as text: which tokens the model's queries treat
# as "anchor-like" can be read directly.

# %%
# Exercises
# ---------
#
# 1. Predict what MAT keeps in a deep layer with :math:`\beta = 1`, then check with
#    :func:`refkv.policies.mat.closed_form_keep` on layer 20's :math:`\pi`.
# 2. The closed form equals Eq. 4 streamed token by token on layer 20. Check it on every
#    deep layer.
#
# Solutions
# ---------
# (The test suite runs these lines; a wrong solution fails it.)

# 1. An anchor cache of one token: the first (always an anchor), plus the last N - 1.
kept_b1 = closed_form_keep(pi20, positions, N, 1)
print("exercise 1: beta = 1 keeps", positions[0][kept_b1[0]][:3], "...",
      positions[0][kept_b1[0]][-2:])
assert all(positions[0][kept_b1[h]].tolist() == [0, *range(T - N + 1, T)]
           for h in range(cfg.n_kv_heads))


# 2. Every deep layer (2..29), every KV head.
def pi_of(layer):
    v = views[layer]
    return anchor_logits(v.queries_by_kv_head().astype(np.float64),
                         v.keys[:, None, 0].astype(np.float64)).mean(axis=1)


agree = [np.array_equal(closed_form_keep(pi_of(layer), views[layer].positions, N, beta),
                        streaming_keep(pi_of(layer), views[layer].positions, N, beta))
         for layer in range(2, cfg.n_layers)]
print(f"exercise 2: closed form == streaming in {sum(agree)} of {len(agree)} "
      "deep layers")
assert all(agree)

# %%
# Saving the figures
# ------------------
# In the documentation the figures above are part of the page. Run by hand, as
# ``python tutorials/06_mat.py``, the script saves them as PNG files in
# ``~/.cache/refkv/figures`` (or in the folder named by the ``REFKV_FIGURES``
# environment variable), never in the source tree, and prints each path;
# :func:`refkv.figures.save_figures` does it.

from refkv.figures import save_figures

save_figures()
