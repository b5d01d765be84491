"""
2. Block prompt processing under a budget
=========================================

A KV cache with a budget of :math:`N` tokens can still blow its memory limit while the
*prompt* is being read: process a 100,000-token prompt in one go and the cache holds
100,000 entries before any policy gets a chance to evict. KeyDiff (Park et al., 2025,
Sec. 2.4) makes the budget hold all the time by reading the prompt in blocks of
:math:`B` tokens and evicting after each one. This tutorial runs that loop with refkv's
:class:`refkv.Engine` and looks at what it keeps, what it costs, and when the block size
changes the answer.
"""

import numpy as np

import refkv
from refkv.figures import pyplot
from refkv.policies import select
from refkv.policies.keydiff import anchor_scores

plt = pyplot("Tutorial 2")  # matplotlib.pyplot, or one line saying how to install it

model = refkv.load("tiny")           # 4 layers, 4 query heads, 2 KV heads, d_head = 16
rng = np.random.default_rng(0)
T = 384
tokens = rng.integers(0, model.config.vocab_size, size=T)
print(model, "| prompt of", T, "tokens")

# %%
# The loop (KeyDiff Eq. 6)
# ------------------------
#
# Cut the prompt into blocks :math:`X_0, X_1, \dots` of :math:`B` tokens. For each
# block, *inside every layer*:
#
# .. math::
#
#    C_i \leftarrow \big([K_{i-1} \,\|\, k_{\text{block}}],\
#    [V_{i-1} \,\|\, v_{\text{block}}]\big),
#    \qquad C_i' \leftarrow \pi_N(C_i),
#
# where :math:`\pi_N` is the eviction policy keeping :math:`N` tokens. In refkv the
# order within one layer is: project the block to :math:`q, k, v`; append :math:`k, v`
# to the cache; let the block's queries attend over cache and block; let the policy
# observe what it needs; evict down to :math:`N`. The layer's output, computed *before*
# the eviction, goes on to the next layer, which evicts its own cache in turn (KeyDiff
# Fig. 1). So a block attends to at most :math:`N + B` keys, and the next block sees the
# evicted cache.
#
# The loop by hand
# ----------------
#
# Before handing the loop to refkv, write it. The model's pieces (``embed``, ``rope``,
# ``qkv``, ``attn_out``, ``mlp``, ``head``; tutorial 1 uses them the same way) and one
# cache per layer: keys, values and the positions they came from. In each layer, for
# each block: **append** the block's keys and values, **attend** (the block's queries
# over cache and block, causal within the block), **score** every cached token -- here
# with KeyDiff's Eq. 8, :func:`refkv.policies.keydiff.anchor_scores` -- and **keep the
# top** :math:`N` with :func:`refkv.policies.select`.


def softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def keydiff_score(keys, positions):
    return anchor_scores(keys)                                # KeyDiff Eq. 8, per head


def block_prefill(model, tokens, N, B, score=keydiff_score):
    """KeyDiff Eq. 6 by hand: last logits, kept positions (Hkv, N) per layer."""
    cfg = model.config
    g = cfg.n_heads // cfg.n_kv_heads                         # query heads per KV head
    empty = np.zeros((cfg.n_kv_heads, 0, cfg.d_head), dtype=model.dtype)
    K, V = [empty] * cfg.n_layers, [empty] * cfg.n_layers
    P = [np.zeros((cfg.n_kv_heads, 0), dtype=np.int64)] * cfg.n_layers
    for start in range(0, len(tokens), B):
        block = tokens[start:start + B]
        pos = np.arange(start, start + len(block))
        rope, x = model.rope(pos), model.embed(block)
        for l in range(cfg.n_layers):
            # (H, B, d), (Hkv, B, d), (Hkv, B, d)
            q, k, v = model.qkv(l, x, rope)
            K[l] = np.concatenate([K[l], k], axis=1)          # 1. append
            V[l] = np.concatenate([V[l], v], axis=1)
            P[l] = np.concatenate(
                [P[l], np.broadcast_to(pos, (cfg.n_kv_heads, len(pos)))], axis=1)
            logits = (q @ np.repeat(K[l], g, axis=0).transpose(0, 2, 1)
                      / np.sqrt(cfg.d_head))
            future = np.repeat(P[l], g, axis=0)[:, None, :] > pos[None, :, None]
            # 2. attend: (H, B, n)
            attention = softmax(np.where(future, -np.inf, logits))
            x = x + model.attn_out(l, attention @ np.repeat(V[l], g, axis=0))
            x = x + model.mlp(l, x)
            if K[l].shape[1] > N:
                scores = score(K[l], P[l])                    # 3. score: (Hkv, n)
                keep = select(scores, P[l], N)                # 4. keep top N per head
                K[l] = np.take_along_axis(K[l], keep[..., None], axis=1)
                V[l] = np.take_along_axis(V[l], keep[..., None], axis=1)
                P[l] = np.take_along_axis(P[l], keep, axis=1)
    return model.head(x[-1:])[0], P


N, B = 64, 32
by_hand, kept_by_hand = block_prefill(model, tokens, N, B)
engine = refkv.Engine(model, "keydiff", budget=N)
logits = engine.prefill(tokens, block_size=B)
same_kept = all(np.array_equal(kept_by_hand[l], engine.caches[l].positions)
                for l in range(model.config.n_layers))
print("same kept positions in every layer and head:", same_kept)
print("last logits, by hand vs Engine: "
      f"{np.abs(by_hand - logits).max() / np.abs(logits).max():.1e} (relative)")
assert same_kept and np.allclose(by_hand, logits, rtol=0,
                                 atol=1e-9 * np.abs(logits).max())

# %%
# Twenty lines, the same decisions as the engine's and the same logits to rounding. The
# engine adds what the loop leaves out: attention in tiles that never forms the matrix
# when the policy does not need it, policies with state and protected tokens, eviction
# before attention, and the checks and records used below.
#
# Blocks bound the cache
# ----------------------
#
# The engine records the largest cache it ever held. One-shot prefill
# (``block_size=None``, i.e. :math:`B = T`, the setting of most eviction papers) peaks
# at the whole prompt. **Predict, then run:** what is the peak with blocks of :math:`B`
# under :math:`N = 64`, and how many evictions does a 384-token prompt in blocks of 32
# make in 4 layers?

print(f"{'B':>6} {'peak cache':>11} {'evictions':>10} {'KV bytes after':>15}")
for B in (None, 128, 32, 8):
    engine = refkv.Engine(model, "keydiff", budget=N)
    engine.prefill(tokens, block_size=B)
    cache_bytes = sum(c.keys.nbytes + c.values.nbytes for c in engine.caches)
    print(f"{B or T:>6} {engine.stats.peak_cache_tokens:>11} "
          f"{engine.stats.evictions:>10} {cache_bytes:>15,}")

# %%
# The peak is :math:`T = 384` for one-shot prefill and exactly :math:`N + B` otherwise;
# after the prompt every layer holds :math:`N = 64` tokens per KV head. The number of
# evictions is (blocks that overflowed) :math:`\times` (layers): smaller blocks mean
# more, cheaper, eviction calls.
#
# Watching the cache
# ------------------
#
# With ``record=True`` the engine keeps the positions every layer holds after every
# block. Two policies, the same budget and blocks of 32 tokens: StreamingLLM's ``sink``
# (the first 4 tokens and a recent window) and ``keydiff`` (keys least similar to the
# cache's mean direction; tutorial 4). Each row is the cache of layer 0, KV head 0 after
# one block; a dot marks a kept position.

B = 32
fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
for ax, name in zip(axes, ("sink", "keydiff")):
    engine = refkv.Engine(model, name, budget=N, record=True)
    engine.prefill(tokens, block_size=B)
    for block, kept in enumerate(engine.trace.kept):
        positions = kept[0][0]                     # layer 0, KV head 0
        ax.plot(positions, np.full(len(positions), block), "|", ms=5, color="C0")
    ax.set(title=f"{name}: N = {N}, B = {B}", xlabel="token position")
axes[0].set_ylabel("after block")
axes[0].invert_yaxis()
fig.tight_layout()

# %%
# ``sink`` draws a staircase: the first four positions and a window that slides by
# :math:`B` each block. ``keydiff`` keeps a scattered set, some of it old, because its
# score depends on the keys, not on their age. Note also the first two rows: until the
# cache exceeds :math:`N`, nothing is evicted.
#
# No budget, no difference
# ------------------------
#
# Without eviction, block processing is just a KV cache: every block size must give the
# logits of a plain forward pass (KeyDiff Sec. 2.4: :math:`B = T` is processing the
# prompt at once, :math:`B = 1` is token generation). Here is the check against
# :meth:`refkv.model.Model.forward_full`, which recomputes everything without a cache.

short = tokens[:96]
reference = model.forward_full(short)[-1]
for B in (1, 7, 32, None):
    logits = refkv.Engine(model, "full").prefill(short, block_size=B)
    print(f"B = {B!s:>4}: max |logits - forward_full| / max |logits| = "
          f"{np.abs(logits - reference).max() / np.abs(reference).max():.1e}")

# %%
# Differences are rounding only (a few :math:`10^{-16}`). refkv's test suite checks this
# for every block size and for budgets :math:`N \ge T` with every policy.
#
# Under a budget, the block size is part of the answer
# ----------------------------------------------------
#
# Once tokens are evicted, the block size changes what the model computes, for two
# reasons. The policy decides with less information when the block is small (it sees
# only the cache and the current block, never the future: KeyDiff Sec. 2.4, "eviction
# errors compound"), and the tokens of a block attend to a cache that earlier evictions
# already thinned. Below: for each block size, how much of the final layer-0 cache it
# shares with one-shot prefill, and how far the last logits move from the no-eviction
# logits.


def kept_sets(engine):
    return [set(map(int, head)) for head in engine.caches[0].positions]


full_logits = model.forward_full(tokens)[-1]
one_shot = refkv.Engine(model, "keydiff", budget=N)
one_shot.prefill(tokens, block_size=None)
print(f"{'B':>6} {'overlap with B=T':>17} {'logit error':>12}")
for B in (None, 128, 32, 8, 1):
    engine = refkv.Engine(model, "keydiff", budget=N)
    logits = engine.prefill(tokens, block_size=B)
    overlap = np.mean([len(a & b) / N
                       for a, b in zip(kept_sets(engine), kept_sets(one_shot))])
    error = np.linalg.norm(logits - full_logits) / np.linalg.norm(full_logits)
    print(f"{B or T:>6} {overlap:>17.2f} {error:>12.3f}")

# %%
# Every block size below :math:`T` keeps a very different set from one-shot prefill
# (about a quarter in common, not far above the :math:`N/T = 0.17` that two random
# choices would share), and the last logits move by a sizeable fraction -- with no
# simple trend in :math:`B` on this random model. On random weights and random tokens
# this says nothing about quality (there is nothing worth remembering); what it shows is
# that a policy's result is a function of :math:`(N, B)`, so a kernel that reproduces a
# policy must reproduce the block schedule too (refkv's golden files record it; tutorial
# 8).
#
# Evicting before attention
# -------------------------
#
# Most policies read what the attention just computed, so they evict *after* it. A
# policy can instead set ``evict_before_attention``: the engine then shrinks the cache
# to :math:`N - B` *before* appending the block, so the block attends to at most
# :math:`N` keys. HashEvict's Algorithm 1 works this way (tutorial 5).

engine = refkv.Engine(model, "hashevict", budget=N)
engine.prefill(tokens, block_size=16)
print("hashevict evicts before attention:", engine.policy.evict_before_attention,
      "| peak cache:", engine.stats.peak_cache_tokens, "= N")

# %%
# Exercises
# ---------
#
# 1. Predict the peak cache for :math:`N = 100`, :math:`B = 50`, then run it.
# 2. Give ``block_prefill`` a score that is just the position (newer is better). Which
#    registered policy have you written? Check it against the engine.
# 3. How many evictions does the engine make for :math:`T = 384`, :math:`N = 64`,
#    :math:`B = 32` in this 4-layer model? Derive it before counting.
#
# Solutions
# ---------
# (The test suite runs these lines; a wrong solution fails it.)

# 1. Append, then evict: the peak is N + B = 150.
engine = refkv.Engine(model, "keydiff", budget=100)
engine.prefill(tokens, block_size=50)
print("exercise 1: peak", engine.stats.peak_cache_tokens)
assert engine.stats.peak_cache_tokens == 150


# 2. Recency keeps the last N tokens: a sliding window, StreamingLLM without sinks
#    (``sink`` with ``sink=0``; tutorial 0).
def recency(keys, positions):
    return positions.astype(np.float64)


_, kept_window = block_prefill(model, tokens, 64, 32, score=recency)
engine = refkv.Engine(model, refkv.policies.get("sink", sink=0), budget=64)
engine.prefill(tokens, block_size=32)
same = all(np.array_equal(kept_window[l], engine.caches[l].positions)
           for l in range(model.config.n_layers))
print("exercise 2: recency == sink(sink=0):", same,
      "| kept", kept_window[0][0, [0, -1]])
assert same and kept_window[0][0].tolist() == list(range(T - 64, T))

# 3. 12 blocks; the first two fit (32, 64 <= N), the other 10 overflow in each of 4
#    layers.
engine = refkv.Engine(model, "keydiff", budget=64)
engine.prefill(tokens, block_size=32)
print("exercise 3:", engine.stats.evictions, "evictions")
assert engine.stats.evictions == (T // 32 - 2) * model.config.n_layers == 40

# %%
# Saving the figures
# ------------------
# In the documentation the figures above are part of the page. Run by hand, as
# ``python tutorials/02_block_prompt_processing.py``, the script saves them as PNG files
# in ``~/.cache/refkv/figures`` (or in the folder named by the ``REFKV_FIGURES``
# environment variable), never in the source tree, and prints each path;
# :func:`refkv.figures.save_figures` does it.

from refkv.figures import save_figures

save_figures()
