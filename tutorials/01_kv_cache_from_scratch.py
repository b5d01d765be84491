"""
1. A KV cache from scratch
==========================

A decoder generates one token at a time, and every new token attends to all the tokens
before it. Recomputing the keys and values of the whole prefix at every step costs
:math:`t` projections at step :math:`t`, :math:`O(T^2)` over :math:`T` tokens; a *KV
cache* stores them once, so each step projects one token: :math:`O(T)` over the
:math:`T` tokens. (Attention still compares each new query with every cached key:
:math:`O(T^2)` query-key products in all with the cache, :math:`O(T^3)` without; both
counted below.) This tutorial builds a KV cache in a few lines of NumPy,
shows why decoding with it gives the same outputs as recomputing everything, and then
checks a from-scratch cached decoder against refkv's own model and engine.

Everything here runs on random weights: the argument is algebra, not training.
"""

import numpy as np

import refkv
from refkv.figures import pyplot

plt = pyplot("Tutorial 1")  # matplotlib.pyplot, or one line saying how to install it

rng = np.random.default_rng(0)

# %%
# One attention head, no cache
# ----------------------------
#
# Take :math:`T` token embeddings :math:`x_0, \dots, x_{T-1}` and one attention head
# with projections :math:`W_q, W_k, W_v`. Causal attention (KeyDiff Eq. 2) is
#
# .. math::
#
#    O = \operatorname{softmax}\!\left(\frac{Q K^\top}{\sqrt d} + M\right) V,
#    \qquad Q = X W_q,\; K = X W_k,\; V = X W_v,
#
# where the mask :math:`M` is :math:`-\infty` above the diagonal, so token :math:`t`
# only sees tokens :math:`0, \dots, t`.

T, d_model, d = 12, 16, 8
X = rng.standard_normal((T, d_model))
W_q, W_k, W_v = (rng.standard_normal((d_model, d)) / np.sqrt(d_model) for _ in range(3))


def softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def full_attention(X):
    """Every output at once: the whole (T, T) weight matrix, masked."""
    Q, K, V = X @ W_q, X @ W_k, X @ W_v
    logits = Q @ K.T / np.sqrt(d)
    logits[np.triu(np.ones((len(X), len(X)), dtype=bool), k=1)] = -np.inf
    A = softmax(logits)
    return A @ V, A


O_full, A = full_attention(X)
print("outputs", O_full.shape, "weights", A.shape)
print("row 3 of A (token 3 attends to tokens 0..3 only):", np.round(A[3], 3))

# %%
# The same head with a cache
# --------------------------
#
# When token :math:`t` arrives, the keys and values of tokens :math:`0..t-1` are already
# known: they depend only on those tokens' own embeddings. So we keep them in a cache
# :math:`C = (K, V)`, compute only :math:`q_t, k_t, v_t`, append, and attend (KeyDiff
# Eq. 3):
#
# .. math::
#
#    o_t = \operatorname{softmax}\!\left(\frac{q_t\,[K \,\|\, k_t]^\top}{\sqrt d}\right)
#          [V \,\|\, v_t].
#
# No mask is needed: the cache holds only the past. **Predict, then run:** will the
# cached outputs equal the recomputed ones exactly, to the last bit?


class Cache:
    """A KV cache for one head: two growing (n, d) arrays."""

    def __init__(self):
        self.K = np.zeros((0, d))
        self.V = np.zeros((0, d))

    def append(self, k, v):
        self.K = np.vstack([self.K, k])
        self.V = np.vstack([self.V, v])


def decode_step(cache, x_t):
    q, k, v = x_t @ W_q, x_t @ W_k, x_t @ W_v   # one token's projections: O(1) work
    cache.append(k, v)
    a = softmax(q @ cache.K.T / np.sqrt(d))      # (t+1,) weights over the cache
    return a @ cache.V


cache = Cache()
O_cached = np.stack([decode_step(cache, x) for x in X])
error = np.abs(O_cached - O_full).max(axis=-1)
print("largest difference, cached vs recomputed:", error.max())

# %%
# Why they agree
# --------------
#
# Row :math:`t` of the masked softmax has zero weight on every key after :math:`t`, so
# it is a softmax over exactly the keys :math:`k_0..k_t` -- the cache at step :math:`t`.
# And each :math:`k_j, v_j` is a function of :math:`x_j` alone, so computing it once and
# storing it changes nothing. In a deep decoder the same holds layer by layer: causality
# makes the input of layer :math:`\ell` at position :math:`j` depend only on tokens
# :math:`\le j`, so it too is final once computed.
#
# The difference printed above is not exactly zero: the cached route multiplies a
# vector by a matrix where the full route multiplies two matrices, and floating-point
# sums in a different order round differently. It is a few units in the last place of
# float64, which is why refkv's tests compare with a tolerance scaled to the dtype
# rather than with ``==``.

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(9, 3.4))
future = np.triu(np.ones((T, T), dtype=bool), k=1)
im = ax0.imshow(np.ma.masked_where(future, A), cmap="viridis")
ax0.set(title="causal attention weights A", xlabel="key position j",
        ylabel="query position t", xticks=range(0, T, 2), yticks=range(0, T, 2))
fig.colorbar(im, ax=ax0, fraction=0.046)
ax1.semilogy(np.arange(T), np.maximum(error, 1e-18), "o-")
ax1.axhline(np.finfo(np.float64).eps, color="grey", ls="--", label="float64 eps")
ax1.set(title="|cached - recomputed|, per token", xlabel="token t", ylim=(1e-18, 1e-12),
        xticks=range(0, T, 2))
ax1.legend()
fig.tight_layout()

# %%
# What the cache buys
# -------------------
#
# Without a cache, generating token :math:`t+1` means running the *whole model* again
# over all :math:`t+1` tokens: in every layer, the projections of every token, the
# attention of every earlier query (whose outputs nobody reads any more), and the MLP of
# every token. Over a sequence that is :math:`\sum_t (t+1) = T(T+1)/2` token passes
# through each layer's projections and MLP, and :math:`\sum_t (t+1)(t+2)/2 \approx
# T^3/6` query-key products per head. With the cache, each step passes one token through
# the layer and computes one row of :math:`t+1` products: :math:`T` passes and
# :math:`T(T+1)/2` products. Counted on our head, by running both routes and tallying
# what they compute, and checking the formulas:

passes = {"recompute": 0, "cache": 0}
products = {"recompute": 0, "cache": 0}
counting_cache = Cache()
for t in range(T):
    _, A_t = full_attention(X[:t + 1])              # no cache: the whole prefix again
    passes["recompute"] += len(A_t)                 # tokens through W_q, W_k, W_v
    products["recompute"] += np.count_nonzero(np.tri(len(A_t)))  # unmasked A_t entries
    decode_step(counting_cache, X[t])               # cache: one token
    passes["cache"] += 1
    products["cache"] += len(counting_cache.K)      # q_t against every cached key
assert passes["recompute"] == products["cache"] == T * (T + 1) // 2
assert products["recompute"] == T * (T + 1) * (T + 2) // 6
print(f"T = {T}: token passes {passes['recompute']} vs {passes['cache']}, "
      f"query-key products {products['recompute']} vs {products['cache']} "
      "(recompute vs cache)")

for T_long in (1_000, 10_000, 100_000):
    print(f"T = {T_long:>7,}: token passes {T_long * (T_long + 1) // 2:>14,} "
          f"vs {T_long:>7,}, "
          f"products {T_long * (T_long + 1) * (T_long + 2) // 6:>22,} "
          f"vs {T_long * (T_long + 1) // 2:>14,}")

# %%
# The price is memory: the cache grows by one key and one value per token, per layer and
# per KV head -- for a real model tens to hundreds of KiB per token (tutorial 0 does the
# arithmetic). That growth is what eviction policies, the subject of the other
# tutorials, keep under a budget.
#
# %%
# A whole decoder, cached by hand, checked against refkv
# ------------------------------------------------------
#
# refkv's model (:class:`refkv.model.Model`) exposes the pieces of a Llama-family layer:
# ``qkv`` (RMSNorm, projections and RoPE), ``attn_out``, ``mlp`` and ``head``. We reuse
# those pieces, keep our own cache -- one ``(K, V)`` pair per layer -- and do our own
# grouped-query attention (each KV head serves ``g = n_heads / n_kv_heads`` query
# heads). Then we compare with two independent routes:
#
# * :meth:`refkv.model.Model.forward_full`, which recomputes everything with a causal
#   mask and no cache;
# * :class:`refkv.Engine` with the ``full`` policy (no eviction) and block size 1, which
#   is refkv's own cached decoder.

model = refkv.load("tiny")
cfg = model.config
tokens = rng.integers(0, cfg.vocab_size, size=40)


def cached_decode(model, tokens):
    caches = [(np.zeros((cfg.n_kv_heads, 0, cfg.d_head)),) * 2
              for _ in range(cfg.n_layers)]
    logits = []
    for position, token in enumerate(tokens):
        rope = model.rope(np.array([position]))
        x = model.embed(np.array([token]))                     # (1, d_model)
        for layer in range(cfg.n_layers):
            q, k, v = model.qkv(layer, x, rope)                # (H, 1, d), (Hkv, 1, d)
            K = np.concatenate([caches[layer][0], k], axis=1)  # append to the cache
            V = np.concatenate([caches[layer][1], v], axis=1)
            caches[layer] = (K, V)
            K_h = np.repeat(K, cfg.group_size, axis=0)         # GQA: share each KV head
            V_h = np.repeat(V, cfg.group_size, axis=0)
            a = softmax(q @ K_h.transpose(0, 2, 1) / np.sqrt(cfg.d_head))
            x = x + model.attn_out(layer, a @ V_h)
            x = x + model.mlp(layer, x)
        logits.append(model.head(x)[0])
    return np.stack(logits)


ours = cached_decode(model, tokens)
recomputed = model.forward_full(tokens)
engine = refkv.Engine(model, "full")
refkv_cached = engine.prefill(tokens, block_size=1, all_logits=True)

scale = np.abs(recomputed).max()
print(f"ours vs forward_full:   "
      f"{np.abs(ours - recomputed).max() / scale:.1e} (relative)")
print(f"ours vs refkv's engine: "
      f"{np.abs(ours - refkv_cached).max() / scale:.1e} (relative)")
print("same greedy next token at every position:",
      bool((ours.argmax(-1) == recomputed.argmax(-1)).all()))
print("refkv's layer-0 cache holds", len(engine.caches[0]), "tokens, keys of shape",
      engine.caches[0].keys.shape)

# %%
# All three agree to rounding. The last line shows refkv's cache layout: keys of shape
# ``(n_kv_heads, n, d_head)`` per layer, exactly the ``K`` we built by hand. From here
# on the cache will not be allowed to hold every token: tutorial 2 puts it under a
# budget.

# %%
# Exercises
# ---------
#
# 1. A 1,000-token prompt, then 100 generated tokens. How many token passes through a
#    layer does that cost with the cache, and without it (every step re-runs the whole
#    sequence)?
# 2. The cache is exact *because attention is causal*. Drop the mask from
#    ``full_attention`` (every token sees every other) and compare with the cached
#    outputs again: which rows still agree?
# 3. Check that refkv's engine, reading the 40 tokens in blocks of 7, gives the same
#    logits as ``forward_full``.
#
# Solutions
# ---------
# (The test suite runs these lines; a wrong solution fails it.)

# 1. With the cache: 1,000 for the prompt, then one per generated token. Without: step t
#    re-runs all t + 1 tokens, for t = 1000, ..., 1099 (the prompt read once first).
with_cache = 1000 + 100
without = 1000 + sum(t + 1 for t in range(1000, 1100))
print(f"exercise 1: {with_cache:,} vs {without:,} token passes")
assert without == 1000 + 100 * 1001 + 100 * 99 // 2


# 2. Without the mask, output t mixes the values of tokens after t, which the cache at
#    step t has not seen yet: only the last row, which sees everything either way,
#    agrees.
def bidirectional(X):
    Q, K, V = X @ W_q, X @ W_k, X @ W_v
    return softmax(Q @ K.T / np.sqrt(d)) @ V


rows_agree = np.isclose(bidirectional(X), O_cached, rtol=0, atol=1e-12).all(axis=-1)
print("exercise 2: rows that agree without the mask:", np.flatnonzero(rows_agree))
assert np.flatnonzero(rows_agree).tolist() == [T - 1]

# 3. Any block size gives the same logits as recomputation when nothing is evicted.
blocked = refkv.Engine(model, "full").prefill(tokens, block_size=7)
print("exercise 3: blocks of 7 vs forward_full: "
      f"{np.abs(blocked - recomputed[-1]).max() / scale:.1e}")
assert np.allclose(blocked, recomputed[-1], rtol=0, atol=1e-12 * scale)

# %%
# Saving the figures
# ------------------
# In the documentation the figures above are part of the page. Run by hand, as
# ``python tutorials/01_kv_cache_from_scratch.py``, the script saves them as PNG files
# in ``~/.cache/refkv/figures`` (or in the folder named by the ``REFKV_FIGURES``
# environment variable), never in the source tree, and prints each path;
# :func:`refkv.figures.save_figures` does it.

from refkv.figures import save_figures

save_figures()
