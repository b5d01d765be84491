"""
5. HashEvict: SimHash and the angle estimate
============================================

HashEvict (Liu et al., 2024) decides *before* attention which cached key to drop: the
one whose direction is farthest from the incoming query's. Computing the cosine with
every key would cost as much as attention itself, so it compares short binary codes
instead. Each key is hashed once, when it enters the cache, with SimHash (Eq. 2),

.. math::

   h(x) = H(Rx), \\qquad R \\in \\mathbb R^{c \\times d},\\
   R_{ij} \\sim \\mathcal N(0, 1),

(:math:`H` the element-wise Heaviside step), and the key evicted is the one whose code
is farthest, in Hamming distance, from the query's (Eqs. 5-6). Why that works is one
line of geometry (Eq. 3, Goemans and Williamson 1995): for vectors at angle
:math:`\\theta`,

.. math::

   \\frac1c\\,\\mathbb E\\big[d_H(h(x), h(y))\\big] = \\frac{\\theta}{\\pi}.

This tutorial sees that line happen, measures how noisy the estimate is for the paper's
:math:`c = 16` bits, and runs the policy.
"""

import numpy as np
from scipy.stats import spearmanr

import refkv
from refkv.figures import pyplot
from refkv.lsh import gaussian_planes, hamming, hamming_unpacked, pack_codes, simhash
from refkv.recording import Recorder

plt = pyplot("Tutorial 5")  # matplotlib.pyplot, or one line saying how to install it

# %%
# One bit is one hyperplane
# -------------------------
#
# Row :math:`r` of :math:`R` is the normal of a random hyperplane through the origin,
# and bit :math:`r` of :math:`h(x)` says on which side of it :math:`x` lies. Two vectors
# get different bits exactly when the hyperplane passes *between* them. In two
# dimensions a random line through the origin separates two vectors at angle
# :math:`\theta` with probability :math:`\theta / \pi` -- the angle they span out of the
# half-turn of possible directions. **Predict, then run:** of sixteen random lines, how
# many separate two vectors 1 radian apart? Sixteen random lines (refkv's
# :func:`refkv.lsh.gaussian_planes`):

theta = 1.0                                             # radians, about 57 degrees
x = np.array([1.0, 0.0])
y = np.array([np.cos(theta), np.sin(theta)])
R2 = gaussian_planes(16, 2, seed=1)
codes = simhash(np.stack([x, y]), R2)                   # (2, 16) bools
differ = codes[0] != codes[1]
print("h(x) =", codes[0].astype(int))
print("h(y) =", codes[1].astype(int))
print(f"Hamming distance {differ.sum()} of 16; "
      f"expected 16 * theta / pi = {16 * theta / np.pi:.2f}")

fig, ax = plt.subplots(figsize=(4.2, 4.2))
for normal, split in zip(R2, differ):
    direction = np.array([-normal[1], normal[0]]) / np.linalg.norm(normal)
    ax.plot(*np.stack([-1.4 * direction, 1.4 * direction]).T,
            color="crimson" if split else "lightgrey",
            lw=1.6 if split else 1.0, zorder=1)
ax.annotate("", xy=x, xytext=(0, 0), arrowprops=dict(arrowstyle="->", lw=2.2))
ax.annotate("", xy=y, xytext=(0, 0), arrowprops=dict(arrowstyle="->", lw=2.2))
ax.text(*(1.08 * x), "x")
ax.text(*(1.08 * y), "y")
ax.set(xlim=(-1.4, 1.4), ylim=(-1.4, 1.4), aspect="equal",
       title=f"red: the {differ.sum()} lines that separate x and y")
ax.axis("off")
fig.tight_layout()

# %%
# Eq. 3, measured
# ---------------
#
# In :math:`d = 64` dimensions (SmolLM2's head width) the same holds: only the plane
# spanned by :math:`x` and :math:`y` matters, and a Gaussian normal projects onto it as
# a uniformly random direction. Each bit is then an independent coin with probability
# :math:`p = \theta/\pi` of differing, so :math:`d_H \sim \operatorname{Binomial}(c,
# p)`: mean :math:`cp` (Eq. 3) and standard deviation :math:`\sqrt{c\,p(1-p)}`. We hash
# pairs at 19 angles with 2,000 independent draws of :math:`R` each.

d, trials = 64, 2000
rng = np.random.default_rng(5)
e1, e2 = np.linalg.qr(rng.standard_normal((d, 2)))[0].T  # two orthonormal directions
angles = np.linspace(0, np.pi, 19)
pairs = np.stack([np.stack([e1, np.cos(a) * e1 + np.sin(a) * e2])
                  for a in angles])  # (19, 2, d)
results = {}
for c in (16, 64):
    R = gaussian_planes(c * trials, d, seed=c)  # trials independent R's, stacked
    bits = simhash(pairs, R).reshape(len(angles), 2, trials, c)
    distances = (bits[:, 0] != bits[:, 1]).sum(axis=-1)         # (angles, trials)
    results[c] = distances / c
    p = angles / np.pi
    worst = np.abs(results[c].mean(axis=1) - p).max()
    print(f"c = {c:>2}: largest |mean d_H / c - theta / pi| = {worst:.4f}; "
          f"std at 90 degrees {results[c][9].std():.3f} "
          f"(binomial: {np.sqrt(0.25 / c):.3f})")

fig, ax = plt.subplots(figsize=(6, 4))
ax.plot(angles / np.pi, angles / np.pi, "k--", lw=1, label=r"$\theta/\pi$ (Eq. 3)")
# The two means nearly coincide: c = 16 as open squares shifted left, c = 64 as dots
# shifted right, so that neither covers the other.
for c, colour, marker, shift in ((16, "C0", "s", -0.006), (64, "C1", "o", 0.006)):
    mean, std = results[c].mean(axis=1), results[c].std(axis=1)
    ax.plot(angles / np.pi + shift, mean, marker, color=colour, ms=5, mfc="none"
            if c == 16 else colour, label=f"mean $d_H/c$, c = {c}")
    ax.fill_between(angles / np.pi, mean - std, mean + std, color=colour, alpha=0.2,
                    label=f"$\\pm$ 1 std, c = {c}")
ax.set(xlabel=r"angle $\theta / \pi$", ylabel=r"Hamming distance $d_H / c$")
ax.legend()
fig.tight_layout()

# %%
# The means sit on the diagonal (Eq. 3 holds to Monte Carlo noise). The bands are one
# standard deviation: with :math:`c = 16` bits, one code pair estimates the angle only
# to about :math:`\pm 0.125\pi` (22 degrees) near :math:`90^\circ`, and the estimate
# :math:`\hat\theta = \pi d_H / c` takes only 17 values. HashEvict does not need an
# accurate angle, only a ranking good enough to find the *worst* key.
#
# Codes are stored packed
# -----------------------
#
# The hash table costs :math:`c` bits per token and head -- 2 bytes for :math:`c = 16`,
# against 128 bytes for a float16 key of width 64. refkv packs codes eight bits to a
# byte (:func:`refkv.lsh.pack_codes`) and computes Hamming distances as the popcount of
# an XOR (:func:`refkv.lsh.hamming`), checked here against plain bit counting:

key_bits = simhash(rng.standard_normal((1000, d)), gaussian_planes(16, d, seed=0))
packed = pack_codes(key_bits)
print("1000 codes of 16 bits:", key_bits.shape, "->", packed.shape, packed.dtype,
      f"({packed.nbytes} bytes)")
same = np.array_equal(hamming(packed[:1], packed),
                      hamming_unpacked(key_bits[:1], key_bits))
print("packed Hamming == bit count:", same)

# %%
# Does the Hamming distance rank keys like the cosine?
# ----------------------------------------------------
#
# Take the keys and queries of the built-in model (random weights are fine here: this is
# about geometry, not about what a trained model attends to) and compare, for the last
# query of a 256-token prompt, the ranking of the keys by :math:`-d_H(h(q), h(k_i))`
# with the ranking by the true :math:`\cos(q, k_i)`, for growing :math:`c`.


model = refkv.load("tiny")
# every layer's view, nothing evicted
recorder = Recorder("full", needs=("keys", "queries"))
refkv.Engine(model, recorder).prefill(
    rng.integers(0, model.config.vocab_size, size=256))
view = recorder.views()[2]                       # layer 2
keys, query = view.keys[0], view.queries[0, -1]  # KV head 0 and its first query head
cosine = keys @ query / (np.linalg.norm(keys, axis=1) * np.linalg.norm(query))
for c in (8, 16, 32, 64, 256):
    R = gaussian_planes(c, model.config.d_head, seed=0)
    score = -hamming_unpacked(simhash(query, R), simhash(keys, R))
    print(f"c = {c:>3}: Spearman(-d_H, cos) = {spearmanr(score, cosine).statistic:.2f}")

# %%
# At 16 bits the rank correlation is already substantial and it climbs towards 1 as
# :math:`c` grows. Note what is being estimated: the *angle*. HashEvict ignores the
# key's norm, which the attention logit :math:`q\cdot k/\sqrt d` does not.
#
# The policy
# ----------
#
# ``hashevict`` (:class:`refkv.policies.hashevict.HashEvict`) stores each key's packed
# code as a cache field, protects the first 4 and the last 10 tokens, and -- its
# defining trait -- evicts *before* attention, so a block of :math:`B` tokens makes room
# first and then attends to at most :math:`N` keys. With :math:`B = 1` that is Algorithm
# 1 step for step: one eviction per token once the cache is full.

N = 64
engine = refkv.Engine(model, "hashevict", budget=N, record=True)
engine.prefill(rng.integers(0, model.config.vocab_size, size=200), block_size=1)
s = engine.stats
print(engine.policy.describe())
print(f"peak cache {s.peak_cache_tokens} (= N), "
      f"attention matrix formed {s.attention_materialised} times, "
      f"evictions {s.evictions} = (200 - {N}) tokens x {model.config.n_layers} layers")
print("hash table of layer 0:", engine.caches[0].fields["hash_code"].shape,
      "uint8 per KV head and token")

# %%
# Exercises
# ---------
#
# 1. On the head above, find the smallest number of bits :math:`c` (a power of two) for
#    which the Hamming ranking's Spearman correlation with the cosine exceeds 0.9.
# 2. Predict the standard deviation of :math:`d_H / c` at 90 degrees for :math:`c = 64`
#    (each bit is a fair coin), then compare with the simulation above.
# 3. How many evictions does ``hashevict`` make on 200 tokens at :math:`N = 32`, token
#    by token? Derive it, then run.
#
# Solutions
# ---------
# (The test suite runs these lines; a wrong solution fails it.)


# 1. Try c = 2, 4, 8, ... until rho > 0.9.
def rho_for(c):
    R = gaussian_planes(c, model.config.d_head, seed=0)
    return spearmanr(-hamming_unpacked(simhash(query, R), simhash(keys, R)),
                     cosine).statistic


c = 2
while rho_for(c) <= 0.9:
    c *= 2
print(f"exercise 1: c = {c} gives rho = {rho_for(c):.3f} "
      f"(c = {c // 2}: {rho_for(c // 2):.3f})")
assert rho_for(c) > 0.9 >= rho_for(c // 2)

# 2. d_H / c is a mean of c fair coins: std sqrt(0.25 / c) = 0.0625 for c = 64.
print(f"exercise 2: predicted {np.sqrt(0.25 / 64):.4f}, "
      f"simulated {results[64][9].std():.4f}")
assert abs(results[64][9].std() - np.sqrt(0.25 / 64)) < 0.01

# 3. One eviction per token once the cache is full, in every layer: (200 - 32) x 4.
engine = refkv.Engine(model, "hashevict", budget=32)
engine.prefill(rng.integers(0, model.config.vocab_size, size=200), block_size=1)
print("exercise 3:", engine.stats.evictions, "evictions")
assert engine.stats.evictions == (200 - 32) * model.config.n_layers

# %%
# Saving the figures
# ------------------
# In the documentation the figures above are part of the page. Run by hand, as
# ``python tutorials/05_hashevict.py``, the script saves them as PNG files in
# ``~/.cache/refkv/figures`` (or in the folder named by the ``REFKV_FIGURES``
# environment variable), never in the source tree, and prints each path;
# :func:`refkv.figures.save_figures` does it.

from refkv.figures import save_figures

save_figures()
